"""jupyter_shard.planner.sharded_init: which plans fit only when built under shard.init_module()."""

from __future__ import annotations

import pytest

from jupyter_shard.planner.estimate import Plan, compare, estimate, fits
from jupyter_shard.planner.free_memory import FreeMemory
from jupyter_shard.planner.sharded_init import builds_sharded, init_note
from jupyter_shard.spec import Device, Offload, Precision

GIB = 2**30
SHARDED = [
    Plan("fsdp"),
    Plan("fsdp", sharding="SHARD_GRAD_OP"),
    Plan("fsdp", sharding="HYBRID_SHARD"),
    Plan("fsdp", offload=Offload.CPU),
    Plan("deepspeed", 3),
    Plan("deepspeed", 3, offload=Offload.NVME),
]
WHOLE = [Plan("ddp"), Plan("fsdp", sharding="NO_SHARD"), Plan("deepspeed", 1), Plan("deepspeed", 2)]


@pytest.mark.parametrize("plan", SHARDED + WHOLE, ids=lambda p: p.label)
def test_sharded_init_helps_the_plans_that_shard_parameters(plan: Plan) -> None:
    assert builds_sharded(plan) is (plan in SHARDED)


def test_cpu_ranks_that_cannot_all_build_the_whole_model() -> None:
    # 1.4B parameters: 5.2 GiB in fp32; four CPU ranks would build 4 copies in 12 GiB of RAM.
    free = FreeMemory(Device.CPU, 3 * GIB, 12 * GIB, "psutil")
    est = estimate(Plan("fsdp"), 1_400_000_000, 4, Precision.FP32)
    assert init_note(est, free) == (
        "fits only when built under `with shard.init_module():` — every rank building the whole model "
        "first needs 4 × 5.2 GiB of host RAM, 12.0 GiB free"
    )
    assert init_note(estimate(Plan("ddp"), 1_400_000_000, 4, Precision.FP32), free) == ""
    assert init_note(estimate(Plan("fsdp"), 1_400_000_000, 2, Precision.FP32), free) == ""  # 2 × 5.2 fit


def test_a_model_bigger_than_one_gpu() -> None:
    free = FreeMemory(Device.CUDA, 40 * GIB, 1024 * GIB, "nvidia-smi")
    est = estimate(Plan("deepspeed", 3), 13_000_000_000, 8, Precision.BF16_MIXED)  # 48.4 GiB in fp32
    assert fits(est, free)
    assert init_note(est, free) == (
        "fits only when built under `with shard.init_module():` — the whole model (48.4 GiB) is more than "
        "one GPU's 40.0 GiB free, so it must not be moved to a GPU before `shard.prepare`"
    )


def test_both_reasons_and_ranks_per_node() -> None:
    free = FreeMemory(Device.CUDA, 40 * GIB, 100 * GIB, "nvidia-smi")
    est = estimate(Plan("fsdp"), 13_000_000_000, 16, Precision.BF16_MIXED)
    note = init_note(est, free, ranks_per_node=8)
    assert "every rank building the whole model first needs 8 × 48.4 GiB of host RAM, 100.0 GiB free" in note
    assert "; the whole model (48.4 GiB) is more than one GPU's 40.0 GiB free" in note
    one = estimate(Plan("fsdp"), 13_000_000_000, 1, Precision.BF16_MIXED)
    assert "— building the whole model first needs 48.4 GiB of host RAM" in init_note(
        one, FreeMemory(Device.CUDA, 80 * GIB, 40 * GIB, "nvidia-smi")
    )


def test_nothing_to_say_when_memory_is_unknown_or_plenty() -> None:
    est = estimate(Plan("fsdp"), 1_400_000_000, 4, Precision.FP32)
    assert init_note(est, None) == ""
    assert init_note(est, FreeMemory(Device.CUDA, 80 * GIB, None, "nvidia-smi")) == ""
    assert init_note(est, FreeMemory(Device.CUDA, 80 * GIB, 512 * GIB, "nvidia-smi")) == ""


def test_every_compared_plan_gets_the_same_answer_as_its_kind() -> None:
    free = FreeMemory(Device.CPU, 3 * GIB, 12 * GIB, "psutil")
    notes = {e.plan: init_note(e, free) for e in compare(1_400_000_000, 4, Precision.FP32)}
    assert {p for p, n in notes.items() if n} == {p for p in notes if builds_sharded(p)}
