"""``%dist_picker ... --find-batch --confirm``: the batch the dry run found, run for real on the live pool.

Why it exists: a dry run predicts; one real training step on every rank says what the ranks really
hold. :func:`pool_plan` checks first, before any dry run, that the kernel's pool can confirm the plan
(running, the same world size, device, precision and a strategy the dry run plans), and names the
plan it runs; :func:`check_on_ranks` checks that the expressions name only what the ranks hold.
:func:`confirm` then runs :func:`jupyter_shard.planner.trial.confirm` on every rank at the found batch
size (the model and batch are built there from the same expressions or cell code), and reports per
rank the measured peak next to the predicted one and whether it fits the free memory. A step that
runs out of memory steps the batch down by the search's bisection between the largest size that ran
(none yet: 0) and the smallest that did not, one real step per size tried, and says so.
:func:`confirm_line` is all of it for a ``%dist_picker`` line, around the dry run's
:func:`~jupyter_shard.notebook.picker_dry_run.plan_line`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jupyter_shard.notebook.picker_dry_run import LINE_PLANS, DryRunArgs, Outcome, parse_line, plan_line
from jupyter_shard.notebook.picker_inputs import resolve_cell_model, resolve_model, resolve_step
from jupyter_shard.planner import estimate as est
from jupyter_shard.planner.free_memory import MemorySnapshot
from jupyter_shard.pool.results import DistributedError
from jupyter_shard.spec import LaunchSpec, Offload, SpecError, format_ranks

if TYPE_CHECKING:
    from jupyter_shard.planner.trial import TrialReport, TrialRequest
    from jupyter_shard.pool.pool import Pool

__all__ = ["Attempt", "Confirmation", "RankStep", "check_on_ranks", "confirm", "confirm_line", "pool_plan"]

TRIAL = "__import__('jupyter_shard.planner.trial', fromlist=['{call}']).{call}({request!r})"
OUT_OF_MEMORY = "TrialOutOfMemory"
TRIAL_ERROR = "TrialError"


@dataclass(frozen=True)
class RankStep:
    """One rank's measured peak, in bytes over what it held before, and its free memory."""

    rank: int
    peak: int
    free: int | None
    how: str


@dataclass(frozen=True)
class Attempt:
    """One real step at ``size``: every rank's measurement, or why it did not fit (``out_of_memory``)."""

    size: int
    predicted: int | None
    ranks: tuple[RankStep, ...] = ()
    out_of_memory: str = ""

    @property
    def ran(self) -> bool:
        return not self.out_of_memory


@dataclass
class Confirmation:
    """What ``--confirm`` did: the plan and pool it ran on, the size found, every size it tried."""

    plan: str
    world_size: int
    found: int
    free: int | None  # per rank, as the picker judged it (a CUDA rank's own figure is in its step)
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def confirmed(self) -> int:
        """The largest batch size that ran for real (0: none did)."""
        return max((a.size for a in self.attempts if a.ran), default=0)

    def fits(self, step: RankStep) -> bool:
        free = step.free if step.free is not None else self.free
        return free is None or step.peak <= free

    def lines(self) -> list[str]:
        fb = est.format_bytes
        lines = [
            f"Confirmed on the live pool ({self.world_size} ranks, {self.plan}): on every rank a real "
            "training step (after one that makes the optimizer's state, as the dry run traces it), at "
            "each size tried:"
        ]
        for attempt in self.attempts:
            if not attempt.ran:
                lines.append(
                    f"  batch {attempt.size}: out of memory ({attempt.out_of_memory}); stepping the batch "
                    "down by bisection"
                )
                continue
            lines.append(f"  batch {attempt.size}:")
            for step in attempt.ranks:
                free = step.free if step.free is not None else self.free
                where = f", {fb(free)} free" if free is not None else ""
                fit = "fits" if self.fits(step) else "does not fit"
                lines.append(
                    f"    rank {step.rank}: measured {fb(step.peak)}, predicted "
                    f"{'?' if attempt.predicted is None else fb(attempt.predicted)}"
                    f"{_off(step.peak, attempt.predicted)}{where}: {fit}"
                )
        lines.append(self._verdict())
        hows = sorted({s.how for a in self.attempts for s in a.ranks})
        lines += [f"  measured with {how}" for how in hows]
        return lines

    def _verdict(self) -> str:
        if not self.attempts:
            return "Nothing to confirm: the dry run found no batch size that fits."
        if not self.confirmed:
            return "No batch size ran on the pool: not even a batch of 1 fits."
        last = next(a for a in reversed(self.attempts) if a.size == self.confirmed)
        fitting = all(self.fits(s) for s in last.ranks)
        if self.confirmed == self.found:
            return f"Batch {self.found} confirmed" + ("" if fitting else ", but over the free memory") + "."
        return (
            f"Batch {self.found} did not fit for real; {self.confirmed} did, the largest the bisection found."
        )


def _off(measured: int, predicted: int | None) -> str:
    if not predicted or not measured:
        return ""
    return f" ({(predicted - measured) / measured:+.1%})"


def confirm_line(
    line: str,
    namespace: Mapping[str, Any],
    pool: Pool | None,
    *,
    cell: str | None = None,
    memory: MemorySnapshot | None = None,
    deepspeed: bool = True,
) -> tuple[Outcome, Confirmation]:
    """``%dist_picker ... --find-batch --confirm``: the pool checked first, then the dry run with the
    largest batch of the pool's plan, then that batch for real on the pool."""
    args = parse_line(line, pool, cell=cell)
    name = pool_plan(args, pool)
    assert pool is not None
    check_on_ranks(pool, args)
    outcome = plan_line(line, namespace, pool, cell=cell, memory=memory, deepspeed=deepspeed, search=name)
    assert outcome.largest_batch is not None
    searched, found, peak = outcome.largest_batch
    if searched != name:
        raise SpecError(
            f"%dist_picker: --confirm: the pool runs {name!r}, which cannot be planned at --world-size "
            f"{args.world_size}; restart the pool with the plan's line"
        )
    from jupyter_shard.planner.dry_run import dry_run

    model = (
        resolve_model(args.model, namespace)
        if args.code is None
        else resolve_cell_model(args.code, namespace)
    )
    step = resolve_step(args.step, namespace)

    def predict(size: int) -> int | None:
        if size == found:
            return peak
        batch = outcome.batch.expression(size)
        plans = dry_run(model, batch, args.world_size, args.device.value, [name], step, args.precision)
        return plans[name].peak_bytes

    return outcome, confirm(pool, args, name, found, outcome.batch.size, predict, outcome.free)


def pool_plan(args: DryRunArgs, pool: Pool | None) -> str:
    """The dry-run plan the live pool runs, checked against the line; one :class:`SpecError` line
    when the pool cannot confirm it."""
    if pool is None or not pool.started:
        raise SpecError(
            "%dist_picker: --confirm runs a real step on the live pool, and none is running; start one "
            "with a %%distributed cell (the picker's line), or drop --confirm"
        )
    spec = pool.spec
    differs = []
    if pool.world_size != args.world_size:
        differs.append(f"{pool.world_size} ranks, not --world-size {args.world_size}")
    if spec.device.value != args.device.value:
        differs.append(f"--device {spec.device.value}, not {args.device.value}")
    if spec.precision.value != args.precision:
        differs.append(f"--precision {spec.precision.value}, not {args.precision}")
    if differs:
        raise SpecError(
            f"%dist_picker: --confirm: the pool runs {'; '.join(differs)}; plan for the pool's (drop those "
            "options) or restart the pool with the plan's line"
        )
    name = _plan_name(spec)
    if name is None:
        raise SpecError(
            f"%dist_picker: --confirm: the pool runs {spec.describe()}, a strategy the dry run does not "
            "plan; start the pool with a plan's line (ddp, fsdp, or deepspeed --zero-stage 3)"
        )
    wanted = args.strategy
    if wanted is not None and name != wanted and not name.startswith(f"{wanted} "):
        raise SpecError(
            f"%dist_picker: --confirm: the pool runs {name!r} and the plan is for --strategy {wanted!r}; "
            "drop --strategy to search for the pool's, or restart the pool with the plan's line"
        )
    return name


def _plan_name(spec: LaunchSpec) -> str | None:
    """The dry run's name for the strategy the pool runs (None: one it does not plan)."""
    options = _config(spec)
    offload = Offload.CPU if spec.offload is Offload.CPU or options.get("cpu_offload") else spec.offload
    for name, plan in LINE_PLANS.items():
        if plan.strategy != spec.strategy or plan.offload is not offload:
            continue
        if spec.strategy == "fsdp" and plan.sharding != str(options.get("sharding", "FULL_SHARD")).upper():
            continue
        if spec.strategy == "deepspeed" and plan.zero_stage != spec.zero_stage:
            continue
        return name
    return None


def _config(spec: LaunchSpec) -> dict[str, object]:
    if spec.strategy != "fsdp" or spec.config is None:
        return {}
    try:
        loaded = json.loads(spec.config.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


Attempting = Callable[[int], Attempt]


def confirm(
    pool: Pool,
    args: DryRunArgs,
    plan: str,
    found: int,
    batch_size: int,
    predict: Callable[[int], int | None],
    free: int | None,
    attempt: Attempting | None = None,
) -> Confirmation:
    """Run the step at ``found``; out of memory, bisect down between the largest size that ran and
    the smallest that did not. ``attempt`` replaces the real step (tests)."""
    run = attempt or (lambda size: _attempt(pool, args, size, batch_size, predict(size)))
    result = Confirmation(plan, pool.world_size, found, free)
    good, bad = 0, None
    size = found
    while size > 0:
        tried = run(size)
        result.attempts.append(tried)
        good, bad = (size, bad) if tried.ran else (good, size)
        if bad is None or bad - good <= 1:
            break
        size = (good + bad) // 2
    return result


def check_on_ranks(pool: Pool, args: DryRunArgs) -> None:
    """Before any dry run: the ``MODEL``, ``--batch`` and ``--step`` expressions name only what the
    ranks' namespaces hold (the ranks build the model and batch), else one :class:`SpecError` line."""
    try:
        pool.run_own(TRIAL.format(call="check", request=_request(args, 1, 1)))
    except DistributedError as exc:
        raise SpecError(f"%dist_picker: --confirm: {_why(exc)}") from None


def _request(args: DryRunArgs, size: int, batch_size: int) -> TrialRequest:
    return {
        "model": args.model if args.code is None else None,
        "code": args.code,
        "batch": args.batch,
        "batch_size": batch_size,
        "size": size,
        "step": args.step,
    }


def _why(exc: DistributedError) -> str:
    """The trial's own one line where a rank raised one, else the pool's headline."""
    first = next((f for f in exc.failures if f.ename == TRIAL_ERROR), None)
    return first.evalue if first is not None else exc.headline


def _attempt(pool: Pool, args: DryRunArgs, size: int, batch_size: int, predicted: int | None) -> Attempt:
    try:
        pool.run_own(TRIAL.format(call="confirm", request=_request(args, size, batch_size)))
    except DistributedError as exc:
        failures = exc.failures
        short = [f for f in failures if f.ename == OUT_OF_MEMORY]
        if short:
            return Attempt(size, predicted, out_of_memory="; ".join(f.evalue for f in short))
        raise SpecError(f"%dist_picker: --confirm: {_why(exc)}") from None
    reports: dict[int, TrialReport] = {r: pool.last_value(r) for r in range(pool.world_size)}
    missing = [r for r, report in reports.items() if not isinstance(report, dict)]
    if missing:
        raise SpecError(f"%dist_picker: --confirm: rank {format_ranks(missing)} did not report its step")
    steps = tuple(
        RankStep(r, int(report["peak"]), report["free"], str(report["how"])) for r, report in reports.items()
    )
    return Attempt(size, predicted, steps)
