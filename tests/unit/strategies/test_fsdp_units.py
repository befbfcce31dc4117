"""The fsdp strategy's default units on the models users train (``tests/zoo.py``): the repeated
block of each, tied weights left to a module that holds all their users, no container without a
``forward``, BatchNorm in float32 units of its own under a low precision, and one line for an
``auto_wrap`` that cannot work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_shard.strategies import fsdp_units as fsdp
from tests import zoo


def build(name: str, **sizes: int) -> nn.Module:
    scope: dict[str, object] = {}
    with torch.device("meta"):
        exec(zoo.code(name, **sizes), scope)
    model = scope["model"]
    assert isinstance(model, nn.Module)
    return model


def users(model: nn.Module) -> dict[int, list[str]]:
    """Per shared parameter, the names of the modules that hold it."""
    found: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), []).append(name.rpartition(".")[0])
    return {k: v for k, v in found.items() if len(v) > 1}


@pytest.mark.parametrize("name", zoo.NAMES)
def test_the_default_units_are_the_models_repeated_block(name: str) -> None:
    model = build(name)
    units = fsdp.default_units(model)
    kinds = [type(m).__name__ for m in units]
    block = zoo.BLOCKS[name]
    if block is None:  # no repeated block: the large modules one by one
        assert sorted(kinds) == ["Embedding", "LSTM", "Linear"]
        return
    everyone = [m for m in model.modules() if type(m).__name__ == block]
    assert [m for m in units if type(m).__name__ == block] == everyone[::-1]  # each, children first
    assert set(kinds) <= {block, "Embedding", "Linear"}, kinds
    assert not any(isinstance(m, nn.ModuleList | nn.ModuleDict) for m in units)


@pytest.mark.parametrize("name", sorted(zoo.TIED))
@pytest.mark.parametrize(("width", "vocab"), [(128, 50_257), (256, 8192), (512, 32_000)])
def test_no_unit_holds_only_some_users_of_a_tied_weight(name: str, width: int, vocab: int) -> None:
    model = build(name, width=width, vocab=vocab)
    shared = users(model)
    assert shared, "the zoo's tied models share their embedding"
    names = {id(m): n for n, m in model.named_modules()}
    for unit in fsdp.default_units(model):
        prefix = names[id(unit)]
        for owners in shared.values():
            inside = [o for o in owners if o == prefix or o.startswith(prefix + ".")]
            assert not inside or len(inside) == len(owners), (prefix, owners)
    assert zoo.BLOCKS[name] in {type(m).__name__ for m in fsdp.default_units(model)}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Heads(nn.Module):
    """Blocks, then two heads of different classes kept in a ``ModuleList``: each head is smaller than
    a block, the two together larger."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(512) for _ in range(4))
        self.heads = nn.ModuleList([nn.Linear(512, 600), nn.Embedding(600, 512)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.heads[0](x)


def test_a_module_list_is_never_a_unit_even_when_it_is_a_large_leftover() -> None:
    with torch.device("meta"):
        model = Heads()
    units = fsdp.default_units(model)
    assert model.heads not in units
    assert units == list(model.blocks)[::-1]  # the heads stay with the root


def test_batch_norms_keep_float32_in_units_of_their_own_under_bf16() -> None:
    model = build("resnet")
    units = fsdp.default_units(model)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    plan = fsdp.unit_policies(model, units, torch.bfloat16)
    policies = {id(m): p for m, p in plan}
    assert all(policies[id(m)].param_dtype == torch.float32 for m in norms)
    assert all(policies[id(m)].output_dtype == torch.bfloat16 for m in norms)
    assert all(policies[id(m)].param_dtype == torch.bfloat16 for m in units)
    assert plan[-1][0] is model and [m for m, _ in plan[: len(norms)]] == norms[::-1]
    # full precision: no extra units
    assert [m for m, _ in fsdp.unit_policies(model, units, None)] == [*units, model]


@pytest.mark.parametrize(
    ("classes", "says"),
    [(["ModuleList"], "has no forward of its own"), (["Embedding"], "tied weights")],
)
def test_an_auto_wrap_that_cannot_work_is_one_line(classes: list[str], says: str) -> None:
    model = build("gpt2 tied")
    with pytest.raises(ValueError, match=says) as caught:
        fsdp.check_named_units(model, frozenset(classes))
    assert "\n" not in str(caught.value) and "auto_wrap" in str(caught.value)


def test_a_stack_held_by_the_root_itself_is_found_and_a_tied_head_stays_with_the_root() -> None:
    with torch.device("meta"):
        embed, head = nn.Embedding(4096, 512), nn.Linear(512, 4096, bias=False)
        head.weight = embed.weight
        model = nn.Sequential(embed, *[Block(512) for _ in range(6)], head)
    units = fsdp.default_units(model)
    assert units == list(model)[1:7][::-1]


def test_a_model_that_is_a_batch_norm_keeps_float32() -> None:
    norm = nn.BatchNorm1d(8)
    assert fsdp.unit_policies(norm, [], torch.bfloat16)[-1][1].param_dtype == torch.float32
