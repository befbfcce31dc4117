"""jupyter_shard.strategies.deepspeed_dcp: the pieces that need no DeepSpeed engine and no process group.

The partition arithmetic must be ZeRO-3's and ``torch.chunk``'s at once (that is what lets a flat
partition be a ``Shard(0)`` DTensor); the optimizer-state creation must leave every weight as it was;
scalars must come back in the form the live state holds them. Saving and loading a real engine is in
``tests/integration/test_deepspeed_dcp.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from jupyter_shard.strategies import deepspeed_dcp as dcp_module
from jupyter_shard.strategies.deepspeed_dcp import chunk_bounds, padded, state_name

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [1, 4, 5, 32, 33, 165, 1056])
def test_chunk_bounds_are_torch_chunk_and_zero3_partitions(numel: int, world: int) -> None:
    flat = torch.arange(numel)
    chunks = list(torch.chunk(flat, world))
    size = -(-numel // world)  # ZeRO-3: aligned size / world, the padding at the end
    for rank in range(world):
        start, end = chunk_bounds(numel, world, rank)
        expected = chunks[rank] if rank < len(chunks) else flat[:0]
        assert torch.equal(flat[start:end], expected)
        padded_partition = torch.cat([flat, torch.full((size * world - numel,), -1)])[rank * size :][:size]
        assert torch.equal(padded_partition[: end - start], expected)
        assert (padded_partition[end - start :] == -1).all()  # the rest is padding only


def test_padded_appends_zeros() -> None:
    assert torch.equal(padded(torch.tensor([1.0, 2.0]), 4), torch.tensor([1.0, 2.0, 0.0, 0.0]))
    assert padded(torch.empty(0, dtype=torch.bfloat16), 3).dtype == torch.bfloat16


def test_state_names_drop_wrapper_levels() -> None:
    assert state_name("layers.0._checkpoint_wrapped_module.linear.weight") == "layers.0.linear.weight"
    assert state_name("_orig_mod.head.bias") == "head.bias"
    assert state_name("head.bias") == "head.bias"


def test_creating_optimizer_state_changes_no_weight() -> None:
    """ZeRO-3 empties the inner optimizer's groups between steps; the state is made over the flats."""
    flats = [torch.randn(6), torch.randn(4)]
    before = [f.clone() for f in flats]
    inner = torch.optim.AdamW([{"params": [flats[0]]}, {"params": [flats[1]]}], lr=0.5, weight_decay=0.1)
    for group in inner.param_groups:
        group["params"] = []
    grad = torch.ones(4)
    flats[1].grad = grad
    dcp_module._create_state(inner, [(0, flats[0]), (1, flats[1])])
    assert all(torch.equal(f, b) for f, b in zip(flats, before, strict=True))
    assert sorted(inner.state[flats[0]]) == ["exp_avg", "exp_avg_sq", "step"]
    assert [g["params"] for g in inner.param_groups] == [[], []] and inner.param_groups[0]["lr"] == 0.5
    assert flats[0].grad is None and flats[1].grad is grad
    inner.state[flats[0]]["exp_avg"].fill_(3.0)
    dcp_module._create_state(inner, [(0, flats[0]), (1, flats[1])])  # state exists: left alone
    assert (inner.state[flats[0]]["exp_avg"] == 3.0).all()


def test_scalars_come_back_in_their_live_form() -> None:
    step = torch.tensor(3.0)
    assert dcp_module._like(step, torch.tensor(7.0)) is step and step.item() == 7.0
    assert dcp_module._like(3, dcp_module._scalar(9)) == 9
    assert isinstance(dcp_module._like(1.5, dcp_module._scalar(2.5)), float)
    live = torch.tensor(4.0)
    copy = dcp_module._scalar(live)
    live.add_(1)
    assert copy.item() == 4.0  # a copy: the live value keeps changing after the save


def test_partitions_are_the_entries_shaped_like_the_flat_state() -> None:
    state: dict[str, Any] = {
        "step": torch.tensor(2.0),
        "exp_avg": torch.zeros(8),
        "exp_avg_sq": torch.zeros(8),
    }
    assert dcp_module._is_partition(state["exp_avg"], state)
    assert not dcp_module._is_partition(state["step"], state)
    assert not dcp_module._is_partition(5, state)


def test_cpu_adam_native_steps_are_replayed_in_sequence() -> None:
    """After a reset (other betas), steps 1 … N: the native ``beta^step`` is built as training built it."""
    calls: list[tuple[int, float, float]] = []

    def adam_update(opt_id: int, step: int, lr: float, b1: float, b2: float, *rest: Any) -> None:
        assert lr == 0.0 and all(t.numel() == 0 for t in rest[-4:])
        calls.append((step, b1, b2))

    inner = SimpleNamespace(
        ds_opt_adam=SimpleNamespace(adam_update=adam_update),
        opt_id=0,
        param_groups=[{"betas": (0.9, 0.99), "eps": 1e-8, "bias_correction": True}],
        state={"a": {"step": 3}, "b": {"step": 3}},
    )
    dcp_module._replay_cpu_adam(inner)
    assert calls == [(0, 0.0, 0.0), (1, 0.9, 0.99), (2, 0.9, 0.99), (3, 0.9, 0.99)]


def test_engine_counters_and_loss_scaler_state() -> None:
    engine = SimpleNamespace(global_steps=4, global_samples=24, skipped_steps=0, micro_steps=4)
    counters = dcp_module._counters(engine)  # type: ignore[arg-type]
    assert {k: int(v) for k, v in counters.items()} == vars(engine)
    optimizer = SimpleNamespace(loss_scaler=SimpleNamespace(cur_scale=1024.0, cur_iter=7, other="x"))
    scaler = dcp_module._scaler_state(optimizer)
    assert sorted(scaler) == ["cur_iter", "cur_scale"] and scaler["cur_scale"].dtype == torch.float64
    assert dcp_module._scaler_state(SimpleNamespace()) == {}
