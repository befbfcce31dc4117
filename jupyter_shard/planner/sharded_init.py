"""When a plan fits only if the model is built under ``with shard.init_module():``.

Why it exists: :mod:`~jupyter_shard.planner.estimate` counts what one rank holds once the model is
sharded. Before that, a model built the usual way (``model = Big()``) is whole on every rank: fp32,
4 bytes per parameter, in host RAM, on all the ranks of a machine at once; ``shard.prepare`` only
then shards it. ``shard.init_module()`` builds it on the meta device (FSDP) or partitioned (ZeRO-3),
so no rank ever holds the whole model. For the plans that shard parameters, this module says when
that is what makes the plan fit: the whole model built by every rank of a node is more than the free
host RAM, or the whole model is more than one GPU's free memory (the strategies never move an
unsharded model to the GPU, but code that calls ``model.cuda()`` before ``shard.prepare`` does).
Pure functions: no torch, no I/O.
"""

from __future__ import annotations

from jupyter_shard.planner.estimate import Estimate, Plan, format_bytes
from jupyter_shard.planner.free_memory import FreeMemory
from jupyter_shard.spec import Device

__all__ = ["BUILD_BYTES_PER_PARAMETER", "INIT_MODULE", "builds_sharded", "init_note"]

BUILD_BYTES_PER_PARAMETER = 4  # a model built as usual holds fp32 parameters, whatever the precision
INIT_MODULE = "`with shard.init_module():`"


def builds_sharded(plan: Plan) -> bool:
    """Whether ``shard.init_module()`` keeps this plan's ranks from ever holding the whole model:
    FSDP sharding parameters (every mode but NO_SHARD) and ZeRO stage 3."""
    if plan.strategy == "fsdp":
        return plan.sharding != "NO_SHARD"
    return plan.strategy == "deepspeed" and plan.zero_stage == 3


def init_note(est: Estimate, free: FreeMemory | None, ranks_per_node: int | None = None) -> str:
    """``fits only when built under `with shard.init_module():` — …`` for a plan that needs it with
    this free memory; "" for a plan it does not help, or when building whole fits (or is unknown)."""
    if free is None or not builds_sharded(est.plan):
        return ""
    whole = BUILD_BYTES_PER_PARAMETER * est.parameters
    per_node = min(ranks_per_node or est.nproc, est.nproc)
    reasons = []
    if free.host is not None and per_node * whole > free.host:
        building = f"{per_node} × {format_bytes(whole)}" if per_node > 1 else format_bytes(whole)
        every = "every rank building" if per_node > 1 else "building"
        reasons.append(
            f"{every} the whole model first needs {building} of host RAM, {format_bytes(free.host)} free"
        )
    if free.device is Device.CUDA and whole > free.per_rank:
        reasons.append(
            f"the whole model ({format_bytes(whole)}) is more than one GPU's {format_bytes(free.per_rank)} "
            "free, so it must not be moved to a GPU before `shard.prepare`"
        )
    return f"fits only when built under {INIT_MODULE} — {'; '.join(reasons)}" if reasons else ""
