"""``%dist_picker MODEL --batch EXPR``: the picker on a dry run of the user's own model and batch.

Why it exists: the form of :mod:`jupyter_shard.notebook.picker` counts 16 bytes a parameter and leaves
activations out, so it cannot say whether a given batch fits. With ``--batch`` the picker runs
:func:`jupyter_shard.planner.dry_run.dry_run` (fake tensors, a fake process group: no GPU needed) at
the target world size, compares each strategy's traced peak per rank with the free memory of the pool's
devices or of a named GPU, recommends the fastest plan that fits, and says for each faster plan that
does not fit what would make it fit (more ranks, a smaller batch, checkpointing, offload), each with a
predicted peak where one was computed (offload's is its own traced plan, kept last in the order as
the slowest). ``--find-batch`` searches the largest batch that fits, and with ``--confirm`` runs it
for real on the live pool (:mod:`jupyter_shard.notebook.picker_confirm`); ``--precision bf16-mixed``
plans each strategy as it runs that precision, and the recommended line carries it. As a cell magic,
``%%dist_picker --batch EXPR``, the cell's code builds the model (:mod:`jupyter_shard.planner.cell_model`).

This module reads the line and judges each plan (:func:`plan_line`);
:mod:`jupyter_shard.notebook.picker_inputs` reads the model, batch and step out of the kernel, and
:mod:`jupyter_shard.notebook.picker_dry_run_view` shows the result. The planner's dry run (and torch)
is imported only when a dry run is asked for.
"""

from __future__ import annotations

import shlex
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jupyter_shard.errors import one_line
from jupyter_shard.notebook.args import MagicParser
from jupyter_shard.notebook.picker_inputs import (
    BatchShape,
    batch_shape,
    check_cell,
    resolve_cell_model,
    resolve_model,
    resolve_step,
)
from jupyter_shard.planner import estimate as est
from jupyter_shard.planner.free_memory import MemorySnapshot, probe_memory
from jupyter_shard.spec import Device, Offload, Precision, SpecError, visible_gpus

if TYPE_CHECKING:
    from jupyter_shard.planner.plan import Plan
    from jupyter_shard.pool.pool import Pool

__all__ = ["GPUS", "ORDER", "DryRunArgs", "Outcome", "parse_line", "plan_line", "wants_dry_run"]

USAGE = (
    '%dist_picker MODEL --batch "torch.randn(8, 1024)" [--world-size N] [--device cuda|cpu] '
    '[--gpu "H100 80GB"] [--strategy NAME] [--step FN] [--precision 32|bf16-mixed] [--find-batch '
    "[--confirm]]"
)
CELL_USAGE = (
    '%%dist_picker --batch "torch.randn(8, 1024)" [the options of %dist_picker], over a cell whose code '
    "builds the model (its last expression, or a variable model)"
)
#: what the picker calls the model a cell builds
CELL_MODEL = "the cell's model"
MIB = 1 << 20
#: what a CUDA context and the allocator's first pools take before any tensor: not usable by a plan
CONTEXT = 512 * MIB
#: memory.total in MiB as nvidia-smi reports it, per GPU model; a plan may use this less CONTEXT
GPU_TOTAL_MIB: Mapping[str, int] = {
    "H200": 143_771,
    "H100 80GB": 81_559,
    "A100 80GB": 81_920,
    "A100 40GB": 40_960,
    "L40S": 46_068,
    "A10": 23_028,
    "L4": 23_034,
    "RTX 4090": 24_564,
    "V100 32GB": 32_768,
    "V100 16GB": 16_384,
    "T4": 15_360,
}
#: usable bytes per device of each named GPU
GPUS: Mapping[str, int] = {name: mib * MIB - CONTEXT for name, mib in GPU_TOTAL_MIB.items()}
#: the dry run's plans, fastest first (as :func:`jupyter_shard.planner.estimate.plans` orders them)
ORDER = (
    "ddp",
    "fsdp SHARD_GRAD_OP",
    "fsdp FULL_SHARD",
    "deepspeed ZeRO-3",
    "fsdp FULL_SHARD + offload",
    "deepspeed ZeRO-3 + offload",
)
LINE_PLANS: Mapping[str, est.Plan] = {
    "ddp": est.Plan("ddp"),
    "fsdp SHARD_GRAD_OP": est.Plan("fsdp", sharding="SHARD_GRAD_OP"),
    "fsdp FULL_SHARD": est.Plan("fsdp"),
    "deepspeed ZeRO-3": est.Plan("deepspeed", 3),
    "fsdp FULL_SHARD + offload": est.Plan("fsdp", offload=Offload.CPU),
    "deepspeed ZeRO-3 + offload": est.Plan("deepspeed", 3, offload=Offload.CPU),
}
#: each plan that the offload suggestion applies to, and the offload plan the dry run traced for it
OFFLOADED = {
    "fsdp FULL_SHARD": "fsdp FULL_SHARD + offload",
    "fsdp SHARD_GRAD_OP": "fsdp FULL_SHARD + offload",
}
OFFLOADED["deepspeed ZeRO-3"] = "deepspeed ZeRO-3 + offload"
_STRATEGY_NAMES = (*ORDER, "fsdp", "deepspeed")
#: the precisions a dry run follows (:data:`jupyter_shard.planner.dry_run.PRECISIONS`, kept here so
#: that parsing the line does not import torch)
PRECISIONS = (Precision.FP32.value, Precision.BF16_MIXED.value)


def wants_dry_run(line: str) -> bool:
    """Whether ``%dist_picker``'s line asks for a dry run (any ``--option``); a bare name or count
    keeps the formula form."""
    try:
        return any(token.startswith("--") for token in shlex.split(line))
    except ValueError:
        return '"' in line or "'" in line  # an unclosed quote: let the dry-run parser say so


@dataclass(frozen=True)
class DryRunArgs:
    """``%dist_picker``'s line, parsed."""

    model: str
    batch: str
    world_size: int
    device: Device
    gpu: str | None = None
    strategy: str | None = None
    step: str | None = None
    find_batch: bool = False
    precision: str = Precision.FP32.value
    confirm: bool = False
    code: str | None = None  # the cell's code that builds the model (``%%dist_picker``)


def _parser(cell: bool = False) -> MagicParser:
    p = MagicParser("dist_picker", "%%" if cell else "%", usage=CELL_USAGE if cell else USAGE)
    if not cell:
        p.add_argument("model")
    p.add_argument("--batch", required=True)
    p.add_argument("--world-size", dest="world_size", type=int)
    p.add_argument("--device", choices=[Device.CUDA.value, Device.CPU.value])
    p.add_argument("--gpu")
    p.add_argument("--strategy")
    p.add_argument("--step")
    p.add_argument("--find-batch", dest="find_batch", action="store_true")
    p.add_argument("--precision", choices=PRECISIONS, default=Precision.FP32.value)
    p.add_argument("--confirm", action="store_true")
    return p


def parse_line(
    line: str, pool: Pool | None = None, gpu_count: int | None = None, cell: str | None = None
) -> DryRunArgs:
    """The line's options; the world size and device default to the running pool's, else one rank
    per visible GPU (8 on CUDA when none is visible here: the plan is for another machine). With
    ``cell`` (``%%dist_picker``) the cell's code builds the model, and the line names none."""
    if cell is not None:
        check_cell(line, cell)
    opts = _parser(cell is not None).parse_line(line)
    if opts.confirm and not opts.find_batch:
        raise SpecError(
            "%dist_picker: --confirm runs the batch --find-batch finds on the live pool; add --find-batch"
        )
    spec = pool.spec if pool is not None else None
    gpus = visible_gpus() if gpu_count is None else gpu_count
    device = opts.device or (spec.device.value if spec is not None and spec.device is not Device.AUTO else "")
    device = device or (Device.CPU.value if spec is not None and not gpus else Device.CUDA.value)
    world = (
        opts.world_size if opts.world_size is not None else (spec.nproc if spec is not None else gpus or 8)
    )
    if world < 1:
        raise SpecError(
            f"%dist_picker: --world-size {world} is not valid; give the number of ranks, 1 or more"
        )
    gpu = _gpu_name(opts.gpu) if opts.gpu is not None else None
    if gpu is not None and device != Device.CUDA.value:
        raise SpecError("%dist_picker: --gpu names a GPU; use it with --device cuda")
    if opts.strategy is not None and opts.strategy not in _STRATEGY_NAMES:
        choices = ", ".join(repr(n) for n in _STRATEGY_NAMES)
        raise SpecError(
            f"%dist_picker: --strategy {opts.strategy!r} cannot be planned; choose one of: {choices}"
        )
    return DryRunArgs(
        opts.model if cell is None else CELL_MODEL,
        opts.batch,
        world,
        Device(device),
        gpu,
        opts.strategy,
        opts.step,
        bool(opts.find_batch),
        opts.precision,
        bool(opts.confirm),
        cell,
    )


def _gpu_name(text: str) -> str:
    """The table's name for ``text``, matched without case or spaces (``h100 80gb``, ``RTX4090``)."""
    wanted = "".join(text.split()).upper()
    for name in GPUS:
        if "".join(name.split()).upper() == wanted:
            return name
    raise SpecError(f"%dist_picker: GPU {text!r} is not known; name one of: {', '.join(GPUS)}")


# -- planning --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fix:
    """A change that would make a plan fit, and its predicted peak per rank (None: not computed)."""

    what: str
    peak: int | None = None
    traced: bool = True  # False: the peak is the trace less a formula's saving


@dataclass(frozen=True)
class Verdict:
    """One plan against the usable memory: whether it fits, by how much it does not, and fixes."""

    name: str
    plan: Plan
    fits: bool | None  # None: free memory unknown
    over: int = 0
    fixes: tuple[Fix, ...] = ()


@dataclass
class Outcome:
    """Everything the dry-run picker shows."""

    args: DryRunArgs
    batch: BatchShape
    verdicts: list[Verdict]
    usable: int | None  # bytes per rank a plan may take: HEADROOM of the free memory
    free: int | None
    free_source: str
    recommended: str | None
    reason: str
    largest_batch: tuple[str, int, int | None] | None = None  # plan name, batch size, its peak
    notes: list[str] = field(default_factory=list)


def plan_line(
    line: str,
    namespace: Mapping[str, Any],
    pool: Pool | None = None,
    *,
    cell: str | None = None,
    memory: MemorySnapshot | None = None,
    gpu_count: int | None = None,
    deepspeed: bool = True,
    search: str | None = None,
) -> Outcome:
    """Parse ``line``, dry-run every strategy (or ``--strategy``'s) and judge each against the free
    memory; ``cell`` is ``%%dist_picker``'s code that builds the model. ``--find-batch`` searches the
    batch of ``search`` (a plan's name), else of ``--strategy``'s plan, else of the recommended one.
    ``--confirm`` is :func:`jupyter_shard.notebook.picker_confirm.confirm_line`'s, which calls this.
    Every mistake is one :class:`SpecError` line saying what to pass."""
    args = parse_line(line, pool, gpu_count, cell)
    model = (
        resolve_model(args.model, namespace)
        if args.code is None
        else resolve_cell_model(args.code, namespace)
    )
    step = resolve_step(args.step, namespace)
    shape = batch_shape(args.batch, namespace)
    strategies = [args.strategy] if args.strategy else None
    plans = _run(model, shape.expression(), args.world_size, args.device, strategies, step, args.precision)
    free, source = _free(args, pool, memory)
    usable = int(est.HEADROOM * free) if free is not None else None
    names = [n for n in ORDER if n in plans]
    candidates = [n for n in names if deepspeed or not n.startswith("deepspeed")]
    notes = [] if deepspeed else ["deepspeed is not installed: ZeRO-3 is shown but not recommended."]
    failed: dict[str, str] = getattr(plans, "failed", {})
    notes += [f"{name} is not planned: {why}" for name, why in failed.items()]
    fitting = [n for n in candidates if usable is not None and plans[n].peak_bytes <= usable]
    recommended = fitting[0] if fitting else (candidates[0] if usable is None and candidates else None)
    # what would make each plan faster than the recommendation fit (every plan, when nothing fits)
    faster = names[: names.index(recommended)] if recommended in names else names
    context = _Context(model, shape, args, step, usable, namespace, plans, search)
    more_ranks = _more_ranks(context, [n for n in faster if n != "ddp"]) if usable is not None else {}
    verdicts = []
    for name in names:
        plan = plans[name]
        fits = None if usable is None else plan.peak_bytes <= usable
        over = 0 if usable is None else max(0, plan.peak_bytes - usable)
        fixes = _fixes(context, plan, more_ranks.get(name)) if fits is False and name in faster else ()
        verdicts.append(Verdict(name, plan, fits, over, fixes))
    outcome = Outcome(args, shape, verdicts, usable, free, source, recommended, "", notes=notes)
    outcome.reason = _reason(outcome)
    if args.find_batch:
        outcome.largest_batch = _largest_batch(context, outcome, plans)
    return outcome


def _run(
    model: Any,
    batch: object,
    world: int,
    device: Device,
    strategies: list[str] | None,
    step: Any,
    precision: str,
) -> dict[str, Plan]:
    from jupyter_shard.planner.dry_run import dry_run

    try:
        with warnings.catch_warnings():  # FSDP's warnings about the traced model's views are not the user's
            warnings.simplefilter("ignore")
            return dry_run(model, batch, world, device.value, strategies, step, precision)
    except SpecError as exc:
        raise SpecError(f"%dist_picker: {exc}") from None
    except Exception as exc:  # torch's own failure while tracing: still one line, the kernel stays usable
        raise SpecError(
            f"%dist_picker: the dry run failed: {one_line(exc)}; check that the model trains on this batch "
            "in one process first"
        ) from None


def _free(args: DryRunArgs, pool: Pool | None, memory: MemorySnapshot | None) -> tuple[int | None, str]:
    """Free bytes per rank and where that figure comes from."""
    if args.gpu is not None:
        total = GPU_TOTAL_MIB[args.gpu]
        return GPUS[args.gpu], f"a {args.gpu} ({total} MiB, less {CONTEXT // MIB} MiB for the CUDA context)"
    snapshot = memory if memory is not None else probe_memory(pool)
    free = snapshot.free_for(args.device, args.world_size)
    if free is None:
        return None, ""
    return free.per_rank, free.source


@dataclass(frozen=True)
class _Context:
    model: Any
    shape: BatchShape
    args: DryRunArgs
    step: Any
    usable: int | None
    namespace: Mapping[str, Any]
    plans: Mapping[str, Plan] = field(default_factory=dict)
    search: str | None = None  # the plan whose largest batch --find-batch searches, if named


def _more_ranks(ctx: _Context, names: Sequence[str]) -> dict[str, Plan]:
    """The sharded plans re-run at twice the world size (one dry run for all of them)."""
    from jupyter_shard.planner.dry_run import MAX_WORLD

    world = ctx.args.world_size * 2
    if not names or world > MAX_WORLD:
        return {}
    args = ctx.args
    return _run(ctx.model, ctx.shape.expression(), world, args.device, list(names), ctx.step, args.precision)


def _fixes(ctx: _Context, plan: Plan, doubled: Plan | None) -> tuple[Fix, ...]:
    assert ctx.usable is not None
    fixes: list[Fix] = []
    world = ctx.args.world_size
    if plan.strategy == "ddp":
        fixes.append(Fix("more ranks do not help: every DDP rank holds the whole model and its state"))
    elif doubled is not None:
        verdict = "fits" if doubled.peak_bytes <= ctx.usable else "still does not fit"
        fixes.append(Fix(f"{world * 2} ranks (the same batch on each): {verdict}", doubled.peak_bytes))
    if ctx.shape.size > 1:
        size, found = _find(ctx, plan.strategy)
        if found is not None:
            fixes.append(Fix(f"a batch of {size} (the largest that fits)", found.peak_bytes))
        else:
            fixes.append(Fix("a smaller batch: not even a batch of 1 fits"))
    state = plan.parameters + plan.gradients + plan.optimizer
    if plan.activations > 0 and plan.activations >= state:
        target = _block_name(ctx.model, plan)
        fixes.append(
            Fix(
                f"activation checkpointing of {target} (a suggestion, not traced): saves up to "
                f"{est.format_bytes(plan.activations)} of activations, less the blocks' inputs it keeps",
                plan.peak_bytes - plan.activations,
                traced=False,
            )
        )
    elif plan.strategy in OFFLOADED and OFFLOADED[plan.strategy] in ctx.plans:
        offloaded = ctx.plans[OFFLOADED[plan.strategy]]
        verdict = "fits" if offloaded.peak_bytes <= ctx.usable else "still does not fit"
        fixes.append(
            Fix(
                f"--offload cpu ({offloaded.strategy}, traced): keeps "
                f"{est.format_bytes(offloaded.host_bytes)} of sharded parameters, gradients and optimizer "
                f"state in host RAM, at the cost of a slower step: {verdict}",
                offloaded.peak_bytes,
            )
        )
    elif plan.strategy != "ddp" and "offload" not in plan.options and state:
        fixes.append(
            Fix(
                f"--offload cpu (a suggestion, not traced): moves {est.format_bytes(state)} of parameters, "
                "gradients and optimizer state to host RAM, at the cost of a slower step",
                plan.peak_bytes - state,
                traced=False,
            )
        )
    return tuple(fixes)


def _find(ctx: _Context, name: str) -> tuple[int, Plan | None]:
    from jupyter_shard.planner.dry_run import find_batch_plan

    assert ctx.usable is not None

    def make(size: int) -> str:
        return ctx.shape.expression(size)

    try:
        args = ctx.args
        return find_batch_plan(
            ctx.model, make, args.world_size, ctx.usable, name, ctx.step, args.device.value, args.precision
        )
    except SpecError as exc:
        raise SpecError(f"%dist_picker: {exc}") from None


def _block_name(model: Any, plan: Plan) -> str:
    """The repeated block to checkpoint: of the module classes that repeat, the one whose instances
    hold the most parameters (the outermost block, ``Block`` rather than the ``Sequential`` inside
    it); a builder is built on the meta device to see it. Else the largest unit's name."""
    import torch
    from torch import nn

    if not isinstance(model, nn.Module):
        try:
            with warnings.catch_warnings(), torch.device("meta"):
                warnings.simplefilter("ignore")
                model = model()
        except Exception:  # the dry run built it already; a builder that differs on a second call
            model = None
    sizes: dict[str, list[int]] = {}
    if isinstance(model, nn.Module):
        for module in list(model.modules())[1:]:
            if any(True for _ in module.children()):
                count = sum(p.numel() for p in module.parameters())
                sizes.setdefault(type(module).__name__, []).append(count)
    repeated = {name: max(counts) for name, counts in sizes.items() if len(counts) > 1}
    if repeated:
        return f"each {max(sorted(repeated), key=lambda n: repeated[n])}"
    if plan.largest_unit is not None:
        return f"each block like {plan.largest_unit[0]}"
    return "each repeated block"


def _reason(out: Outcome) -> str:
    fb = est.format_bytes
    if out.usable is None:
        return (
            f"{out.recommended or 'none'}: free memory is unknown (no pool, nvidia-smi or psutil); name "
            'the GPU with --gpu "H100 80GB" to judge the fit. Shown fastest first.'
        )
    limit = f"{fb(out.usable)} usable ({float(est.HEADROOM):.0%} of {fb(out.free or 0)} free per rank)"
    by_name = {v.name: v for v in out.verdicts}
    if out.recommended is None:
        leanest = min(out.verdicts, key=lambda v: v.plan.peak_bytes)
        return (
            f"Nothing fits in {limit}: the leanest, {leanest.name}, peaks at {fb(leanest.plan.peak_bytes)}. "
            "See what would make each fit."
        )
    chosen = by_name[out.recommended].plan
    first = out.verdicts[0]
    why = "fastest" if first.name == out.recommended else f"the fastest that fits ({first.name} peaks at "
    why += "" if first.name == out.recommended else f"{fb(first.plan.peak_bytes)})"
    return f"{out.recommended}: peaks at {fb(chosen.peak_bytes)} per rank and fits in {limit}; {why}."


def _largest_batch(ctx: _Context, out: Outcome, plans: Mapping[str, Plan]) -> tuple[str, int, int | None]:
    """--find-batch: the largest batch for the plan searched, else ``--strategy``'s plan (its
    fastest), else the recommended one, else the leanest."""
    if ctx.usable is None:
        raise SpecError(
            '%dist_picker: --find-batch needs the free memory: name the GPU with --gpu "H100 80GB", or run '
            "a pool on the devices"
        )
    if ctx.search is not None and ctx.search in plans:
        name = ctx.search
    elif ctx.args.strategy is not None:
        name = next(n for n in ORDER if n in plans)
    elif out.recommended is not None:
        name = out.recommended
    else:
        name = min(plans, key=lambda n: plans[n].peak_bytes)
    size, found = _find(ctx, name)
    return name, size, None if found is None else found.peak_bytes
