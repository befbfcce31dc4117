"""jupyter_shard.strategies.precision: what ``--precision`` means.

(``cast_floating``, ``cast_floating_inputs`` with ``cast_parameters``, and bf16-mixed through the
``none`` strategy are tested in ``tests/unit/test_strategies.py``.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_shard.strategies.precision import PRECISIONS, Precision, cast_floating_inputs, cast_parameters


class Probe(nn.Module):
    """Records the dtype its linear layer computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        self.seen.append(out.dtype)
        return out


@pytest.mark.parametrize(
    ("name", "dtype"), [("32", None), ("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)]
)
def test_each_precision_names_the_dtype_it_computes_in(name: str, dtype: torch.dtype | None) -> None:
    assert Precision.parse(name) == Precision(name, dtype)


def test_an_unknown_precision_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        Precision.parse("bf16")
    assert str(info.value) == "precision 'bf16' is not valid; choose one of: 32, bf16-mixed, 16-mixed"
    assert list(PRECISIONS) == ["32", "bf16-mixed", "16-mixed"]


def test_32_leaves_the_forward_alone() -> None:
    model = Probe()
    Precision.parse("32").autocast_forward(model, "cpu")
    assert "forward" not in vars(model)
    model(torch.ones(1, 2))
    assert model.seen == [torch.float32]


def test_mixed_precision_autocasts_this_instances_forward_only() -> None:
    model, other = Probe(), Probe()
    Precision.parse("bf16-mixed").autocast_forward(model, "cpu")
    model(torch.ones(1, 2))
    other(torch.ones(1, 2))
    assert model.seen == [torch.bfloat16] and other.seen == [torch.float32]
    assert model.lin.weight.dtype == torch.float32, "the weights stay in float32"
    assert model.forward.__name__ == "forward" and not torch.is_autocast_enabled("cpu")


def test_cast_floating_inputs_stops_when_its_handle_is_removed() -> None:
    seen: list[torch.dtype] = []
    module = nn.Identity()
    module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    handle = cast_floating_inputs(module, torch.float16)
    module(torch.ones(2))
    handle.remove()
    module(torch.ones(2))
    assert seen == [torch.float16, torch.float32]


def test_cast_parameters_casts_floating_parameters_and_batch_norm_statistics_only() -> None:
    model = nn.Module()
    model.w = nn.Parameter(torch.ones(2))
    model.counts = nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)
    model.register_buffer("scale", torch.ones(1))
    cast_parameters(model, torch.bfloat16)
    assert model.w.dtype == torch.bfloat16 and model.w.requires_grad
    assert model.counts.dtype == torch.int64
    assert model.scale.dtype == torch.float32, "a buffer such as RoPE's inv_freq keeps float32"
    norm = nn.BatchNorm1d(3)
    cast_parameters(norm, torch.bfloat16)
    assert norm.running_mean.dtype == norm.running_var.dtype == norm.weight.dtype == torch.bfloat16
    assert norm.num_batches_tracked.dtype == torch.int64
