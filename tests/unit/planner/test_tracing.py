"""jupyter_shard.planner.tracing: fake copies of models and batches, the fsdp strategy's unit rule
repeated faithfully, the largest unit, the loss taken from an output."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from jupyter_shard.errors import SpecError
from jupyter_shard.planner import tracing
from jupyter_shard.strategies import fsdp_units as fsdp


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)


MODELS = {
    "small": lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1)),
    "mlp": lambda: nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(3))),
    "stack": lambda: Stack(50_000, 256, 6),
    "big embedding": lambda: Stack(400_000, 64, 2),
    # no repeated block: a module gets a unit of its own from an eighth of the parameters
    "mixed": lambda: nn.Sequential(nn.Linear(2048, 2048), nn.Embedding(1024, 1024), nn.LayerNorm(8)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_units_are_the_fsdp_strategys_units(name: str) -> None:
    with torch.device("meta"):
        model = MODELS[name]()
    ours = [id(m) for m in tracing.default_units(model)]
    assert ours == [id(m) for m in fsdp.default_units(model)]
    assert (ours == []) == (name == "small")
    if name == "mixed":
        assert ours == [id(model[1]), id(model[0])]


def test_the_largest_unit_counts_what_the_root_keeps() -> None:
    with torch.device("meta"):
        model = Stack(50_000, 256, 6)
    name, size = tracing.largest_unit(model, tracing.default_units(model))
    assert (name, size) == (
        "head",
        (256 + 1) * 50_000 * 4,
    )  # the head has a bias besides the embedding's table
    assert tracing.largest_unit(model, []) == ("<root>", sum(p.numel() * 4 for p in model.parameters()))


def test_a_fake_model_keeps_shapes_dtypes_and_ties_without_storage() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    model[0].bias = nn.Parameter(model[0].bias.detach().to(torch.float64), requires_grad=False)
    model[1].weight = model[0].bias  # type: ignore[assignment]
    mode = FakeTensorMode()
    copy = tracing.fake_model(model, mode)
    assert copy is not model
    assert all(isinstance(t, FakeTensor) for t in [*copy.parameters(), *copy.buffers()])
    assert copy[0].bias.dtype == torch.float64 and not copy[0].bias.requires_grad
    assert copy[1].weight is copy[0].bias
    assert [p.shape for p in copy.parameters()] == [p.shape for p in model.parameters()]
    assert not any(isinstance(p, FakeTensor) for p in model.parameters())
    assert [n for n, _ in copy.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert not any(isinstance(b, nn.Parameter) for b in copy.buffers())
    assert [n for n, _ in copy.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_a_batch_becomes_fake_whatever_its_form() -> None:
    mode = FakeTensorMode()
    batch = tracing.fake_batch((torch.ones(2, 3), {"mask": "torch.zeros(2, 3)"}), mode)
    assert isinstance(batch, tuple)
    tensors = tracing.batch_tensors(batch)
    assert [type(t) for t in tensors] == [FakeTensor] * 2 and [t.shape for t in tensors] == [(2, 3)] * 2
    big = tracing.fake_batch("torch.randn(100_000, 100_000)", mode)  # 40 GB, if it were real
    assert isinstance(big, FakeTensor)


def test_the_loss_is_taken_from_what_the_model_returns() -> None:
    out = torch.ones(2, 2)
    assert tracing.scalar_loss(out).item() == 1.0
    assert tracing.scalar_loss((out * 3, out)).item() == 3.0
    assert tracing.scalar_loss({"logits": out * 2}).item() == 2.0

    class Output:
        loss = torch.tensor(5.0)

    assert tracing.scalar_loss(Output()).item() == 5.0
    with pytest.raises(SpecError, match="pass step=fn"):
        tracing.scalar_loss(None)
