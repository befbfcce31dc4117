"""How much memory each strategy needs per rank, and which strategy to pick for the memory that is free.

Why it exists: choosing between DDP, the ZeRO stages, FSDP's sharding modes and offload is mostly a
question of whether the training state fits. This module counts that state per rank (parameters,
gradients and optimizer state of Adam) for every strategy and recommends the fastest strategy that
fits in the free memory (found by :mod:`jupyter_shard.planner.free_memory`). Activations are not counted:
they depend on batch size and sequence length. Pure functions: no torch, no widgets, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

from jupyter_shard._util.units import format_bytes as format_bytes  # the picker names it here
from jupyter_shard.planner.free_memory import FreeMemory
from jupyter_shard.spec import Device, Offload, Precision, SpecError

#: the fraction of free memory a plan may take (exact, so boundaries are exact); the rest is for activations
HEADROOM = Fraction(4, 5)
MAX_RANKS = 1 << 16
MAX_PARAMETERS = 10**18
SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")  # as strategies/fsdp.py
COMPONENTS = ("params", "grads", "optimizer")
#: bytes per parameter for (parameters, gradients, optimizer state) of Adam
BYTES_PER_PARAMETER = {
    Precision.FP32: (4, 4, 8),  # fp32 weights and gradients, Adam m and v
    Precision.BF16_MIXED: (2, 2, 12),  # 16-bit weights and gradients; fp32 master, m and v
    Precision.FP16_MIXED: (2, 2, 12),
}
CAVEAT = (
    "Activations are not included: they depend on batch size and sequence length, and activation "
    f"checkpointing reduces them. A plan fits if it needs at most {float(HEADROOM):.0%} of the free memory, "
    "leaving the rest for activations."
)
_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_NUMBER = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9][0-9_]*)(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?"
_COUNT = re.compile(rf"^({_NUMBER})\s*([KMBGT]?)$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """A parameter count as typed: ``124M``, ``1.3B``, ``7e9``, ``350000000`` (also ``350_000_000``)."""
    match = _COUNT.match(text.strip())
    value = Decimal(0)
    if match:
        number = Decimal(match.group(1).replace("_", "").replace(",", ""))
        value = number * _SUFFIX[match.group(2).upper()] if number.adjusted() < 100 else number
    if not 1 <= value <= MAX_PARAMETERS:
        raise SpecError(f"parameter count {text!r} is not valid; write it like 124M, 1.3B, 7e9 or 350000000")
    return int(value.to_integral_value())


def format_count(count: int) -> str:
    """``124_000_000`` -> ``124M``, ``1_300_000_000`` -> ``1.3B``."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


@dataclass(frozen=True)
class Plan:
    """One way to train: a strategy, its ZeRO stage or FSDP sharding mode, and where state is offloaded."""

    strategy: str  # ddp | fsdp | deepspeed
    zero_stage: int = 0
    sharding: str = "FULL_SHARD"
    offload: Offload = Offload.NONE

    def __post_init__(self) -> None:
        problem = _plan_problem(self)
        if problem:
            raise SpecError(problem)

    @property
    def label(self) -> str:
        name = {"ddp": "DDP", "fsdp": f"FSDP {self.sharding}"}.get(self.strategy, f"ZeRO-{self.zero_stage}")
        where = {Offload.CPU: " + CPU offload", Offload.NVME: " + NVMe offload"}.get(self.offload, "")
        return name + where

    def sharded(self) -> tuple[bool, bool, bool]:
        """Which of (parameters, gradients, optimizer state) are split over the shard group."""
        if self.strategy == "deepspeed":
            return (self.zero_stage >= 3, self.zero_stage >= 2, self.zero_stage >= 1)
        if self.strategy == "fsdp":
            # SHARD_GRAD_OP keeps gathered parameters from forward to backward: count them whole
            return (self.sharding != "SHARD_GRAD_OP", True, True)
        return (False, False, False)

    def offloaded(self) -> tuple[bool, bool, bool]:
        """Which sharded parts leave the device when offloading: DeepSpeed moves optimizer state (and
        parameters at stage 3); FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state."""
        if self.offload is Offload.NONE:
            return (False, False, False)
        if self.strategy == "fsdp":
            return (True, True, True)
        return (self.zero_stage >= 3, False, True)

    def shard_group(self, nproc: int, ranks_per_node: int) -> int:
        """How many ranks share one copy of the sharded state."""
        if self.strategy == "fsdp" and self.sharding == "NO_SHARD":
            return 1  # a shard group of one rank: every rank holds everything
        if self.strategy == "fsdp" and self.sharding == "HYBRID_SHARD":
            return max(1, min(ranks_per_node, nproc))
        return nproc


def _plan_problem(plan: Plan) -> str:
    if plan.strategy not in ("ddp", "fsdp", "deepspeed"):
        return f"strategy {plan.strategy!r} has no memory model; choose ddp, fsdp or deepspeed"
    if not 0 <= plan.zero_stage <= 3 or (plan.zero_stage and plan.strategy != "deepspeed"):
        return f"ZeRO stage {plan.zero_stage} is not valid here; stages 1-3 apply only to deepspeed"
    if plan.sharding not in SHARDING:
        return f"fsdp sharding {plan.sharding!r} is not valid; choose one of: {', '.join(SHARDING)}"
    return offload_problem(plan.strategy, plan.zero_stage, plan.offload)


def offload_problem(strategy: str, zero_stage: int, offload: Offload) -> str:
    """Why this strategy cannot offload this way ("" if it can)."""
    if offload is Offload.NONE:
        return ""
    if strategy == "ddp":
        return "ddp keeps everything on the device: offload needs fsdp or deepspeed ZeRO 1-3"
    if strategy == "fsdp" and offload is Offload.NVME:
        return "fsdp offloads to cpu only: NVMe offload needs deepspeed ZeRO-3"
    if strategy == "deepspeed" and zero_stage == 0:
        return f"--offload {offload.value} needs ZeRO stage 1, 2 or 3"
    if strategy == "deepspeed" and offload is Offload.NVME and zero_stage < 3:
        return "NVMe offload (ZeRO-Infinity) needs ZeRO stage 3"
    return ""


@dataclass(frozen=True)
class Bytes:
    """Bytes one rank holds in one place, by component."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Estimate:
    """What one rank holds for ``plan``: on its device, in host memory, on disk (NVMe offload)."""

    plan: Plan
    parameters: int
    nproc: int
    precision: Precision
    device: Bytes
    host: Bytes
    disk: Bytes

    @property
    def device_bytes(self) -> int:
        return self.device.total

    @property
    def host_bytes(self) -> int:
        return self.host.total

    @property
    def disk_bytes(self) -> int:
        return self.disk.total


def estimate(
    plan: Plan,
    parameters: int,
    nproc: int,
    precision: Precision = Precision.BF16_MIXED,
    ranks_per_node: int | None = None,
) -> Estimate:
    """Per-rank bytes of parameters, gradients and optimizer state (a shard is rounded up)."""
    group = plan.shard_group(nproc, ranks_per_node or nproc)
    places: dict[str, list[int]] = {"device": [0, 0, 0], "host": [0, 0, 0], "disk": [0, 0, 0]}
    away = "disk" if plan.offload is Offload.NVME else "host"
    parts = zip(BYTES_PER_PARAMETER[precision], plan.sharded(), plan.offloaded(), strict=True)
    for i, (per_parameter, sharded, offloaded) in enumerate(parts):
        size = -(-per_parameter * parameters // group) if sharded else per_parameter * parameters
        places[away if sharded and offloaded else "device"][i] = size
    if plan.strategy == "deepspeed" and plan.zero_stage in (1, 2) and precision is not Precision.FP32:
        # ZeRO-1 and -2 copy this rank's gradient partition to float32 for the optimizer's master
        # partition (``single_partition_of_fp32_groups[i].grad``), beside the 16-bit gradients
        places[away if plan.offloaded()[2] else "device"][1] += -(-4 * parameters // group)
    device, host, disk = (Bytes(*places[p]) for p in ("device", "host", "disk"))
    return Estimate(plan, parameters, nproc, precision, device, host, disk)


def plans(multi_node: bool = False) -> list[Plan]:
    """Every strategy the picker compares, fastest first. HYBRID_SHARD beats FULL_SHARD only across
    nodes (less inter-node traffic); on one node it is the same as FULL_SHARD, so it comes after."""
    fsdp = {s: Plan("fsdp", sharding=s) for s in SHARDING}
    hybrid = [fsdp["HYBRID_SHARD"]]
    sharded = [fsdp["FULL_SHARD"], Plan("deepspeed", 3)]
    return [
        Plan("ddp"),
        fsdp["NO_SHARD"],
        Plan("deepspeed", 1),
        Plan("deepspeed", 2),
        fsdp["SHARD_GRAD_OP"],
        *(hybrid + sharded if multi_node else sharded + hybrid),
        Plan("deepspeed", 1, offload=Offload.CPU),
        Plan("deepspeed", 2, offload=Offload.CPU),
        Plan("fsdp", offload=Offload.CPU),
        Plan("deepspeed", 3, offload=Offload.CPU),
        Plan("deepspeed", 3, offload=Offload.NVME),
    ]


def compare(
    parameters: int,
    nproc: int,
    precision: Precision = Precision.BF16_MIXED,
    ranks_per_node: int | None = None,
) -> list[Estimate]:
    """:func:`estimate` for every plan of :func:`plans`, fastest first."""
    per_node = ranks_per_node or nproc
    return [estimate(p, parameters, nproc, precision, per_node) for p in plans(per_node < nproc)]


# -- recommending ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    """The fastest plan that fits (the fastest of all when free memory is unknown), and why."""

    choice: Estimate | None
    fits: bool | None  # None: free memory is unknown
    reason: str

    @property
    def text(self) -> str:
        return f"{self.reason} {CAVEAT}"


def demand(est: Estimate, free: FreeMemory) -> int:
    """Bytes that must fit in ``free.per_rank``: on CPU ranks, host-offloaded state is the same RAM."""
    return est.device_bytes + (est.host_bytes if free.device is Device.CPU else 0)


def fits(est: Estimate, free: FreeMemory) -> bool:
    """At most :data:`HEADROOM` of the free memory per rank, and of host RAM for what all ranks (on this
    one host) offload."""
    if demand(est, free) > HEADROOM * free.per_rank:
        return False
    offloaded = est.host_bytes * est.nproc
    return free.device is Device.CPU or free.host is None or offloaded <= HEADROOM * free.host


def recommend(estimates: Sequence[Estimate], free: FreeMemory | None) -> Recommendation:
    """The first of ``estimates`` (fastest first) that fits in ``free``, with the reason in words."""
    if not estimates:
        raise ValueError("recommend needs at least one estimate")
    first = estimates[0]
    count = format_count(first.parameters)
    if free is None:
        return Recommendation(
            first,
            None,
            f"{first.plan.label}: free memory is unknown (no pool, nvidia-smi or psutil); {count} "
            f"parameters need {needs(first, Device.CUDA)} with the fastest plan.",
        )
    for est in estimates:
        if fits(est, free):
            why = (
                "fastest"
                if est is first
                else (f"the fastest that fits ({first.plan.label} needs {needs(first, free.device)})")
            )
            return Recommendation(
                est,
                True,
                f"{est.plan.label}: {count} parameters need {needs(est, free.device)} and fit in "
                f"{format_bytes(free.per_rank)} free; {why}.",
            )
    return Recommendation(None, False, _nothing_fits(estimates, free))


def ranks_needed(plan: Plan, parameters: int, precision: Precision, free: FreeMemory) -> int | None:
    """The fewest ranks with which ``plan`` fits, each with ``free``; None if no count does."""

    def ok(nproc: int) -> bool:
        return fits(estimate(plan, parameters, nproc, precision), free)

    if not ok(MAX_RANKS):
        return None
    lo, hi = 1, MAX_RANKS
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def needs(est: Estimate, device: Device) -> str:
    """``2.0 GiB per rank (plus 6.0 GiB of host RAM per rank)``: what one rank of ``est`` needs."""
    if device is Device.CPU:
        text = f"{format_bytes(est.device_bytes + est.host_bytes)} per rank"
    else:
        text = f"{format_bytes(est.device_bytes)} per rank"
        text += f" (plus {format_bytes(est.host_bytes)} of host RAM per rank)" if est.host_bytes else ""
    return text + (f" (plus {format_bytes(est.disk_bytes)} on NVMe per rank)" if est.disk_bytes else "")


def _nothing_fits(estimates: Sequence[Estimate], free: FreeMemory) -> str:
    # per kind of offload, the plan that keeps the least on the device
    leanest = [
        min(kind, key=lambda e: demand(e, free))
        for kind in ([e for e in estimates if e.plan.offload is o] for o in Offload)
        if kind
    ]
    needed = "; ".join(f"{e.plan.label} {needs(e, free.device)}" for e in leanest)
    usable = f"at most {float(HEADROOM):.0%} of {format_bytes(free.per_rank)} free per rank"
    if free.device is Device.CPU:
        return (
            f"Nothing fits: {usable} may be used, and the leanest plans need more ({needed}). CPU ranks "
            "share this machine's RAM, so more ranks do not help: use GPUs (--gpus N), NVMe offload, "
            "or a machine with more memory."
        )
    host = f" and of {format_bytes(free.host)} host RAM" if free.host is not None else ""
    text = (
        f"Nothing fits with {estimates[0].nproc} GPUs: {usable}{host} may be used, and the leanest "
        f"plans need more ({needed})."
    )
    hints = []
    for est in leanest:
        ranks = ranks_needed(est.plan, est.parameters, est.precision, free)
        if ranks is not None:
            hints.append(f"{est.plan.label} fits on {ranks} GPUs")
    if not hints:
        return f"{text} The state outgrows GPU and host memory together: use more nodes or a smaller model."
    return f"{text} More GPUs would help: {'; '.join(hints)}."
