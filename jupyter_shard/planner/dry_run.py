"""Will it fit on N devices, and with which strategy? A dry run of the user's own model and batch.

Why it exists: :mod:`jupyter_shard.planner.estimate` counts 16 bytes a parameter and knows nothing of
activations, the unit FSDP gathers at once or the optimizer the user made, which is what decides
whether a run fits. :func:`dry_run` builds the model under fake tensors, prepares it as each strategy
would at world size N over a fake process group, runs training steps and reports what one rank holds
at its peak, with no GPU and no memory of the model's size. :func:`find_batch` searches the largest
batch that fits. Both are for the picker and for code: ``jupyter_shard.planner.dry_run(...)``.
Offload plans say what stays on the device and what the host holds, and ``precision="bf16-mixed"``
plans each strategy as its ``--precision bf16-mixed`` runs, since both change what a rank must fit.

The fake process group is the default group of this process for the length of a call; where a real
group is already the default (inside a rank), the dry run runs in a forked child so as not to touch it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from jupyter_shard.errors import SpecError, one_line
from jupyter_shard.planner import tracing
from jupyter_shard.planner.cell_model import model_builder
from jupyter_shard.planner.gpu_code import cuda_blocks
from jupyter_shard.planner.isolation import forked
from jupyter_shard.planner.plan import Plan, Plans, Progress, ds_estimate
from jupyter_shard.planner.tracing import Step, Traced

#: every strategy a dry run can follow, by the name its plan is returned under
STRATEGIES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "ddp": MappingProxyType({}),
        "fsdp FULL_SHARD": MappingProxyType({"sharding": "FULL_SHARD"}),
        "fsdp SHARD_GRAD_OP": MappingProxyType({"sharding": "SHARD_GRAD_OP"}),
        "deepspeed ZeRO-3": MappingProxyType({"zero_stage": 3}),
        "fsdp FULL_SHARD + offload": MappingProxyType({"sharding": "FULL_SHARD", "offload": "cpu"}),
        "deepspeed ZeRO-3 + offload": MappingProxyType({"zero_stage": 3, "offload": "cpu"}),
    }
)
_ALIASES = {
    "fsdp": ("fsdp FULL_SHARD", "fsdp SHARD_GRAD_OP", "fsdp FULL_SHARD + offload"),
    "deepspeed": ("deepspeed ZeRO-3", "deepspeed ZeRO-3 + offload"),
}
#: the tracker's categories that an offload plan keeps in host memory: the sharded parameters, their
#: gradients and the optimizer state (the optimizer steps on the host)
HOST_ROLES = ("Sharded Param", "Sharded Grad", "Optstate", "OptState")
MAX_WORLD = 1 << 16
#: seconds a call traces before its live line appears (a quick call prints nothing)
QUIET_FOR = 1.0
MAX_BATCH = 1 << 24
RESULTS = "benchmarks/results/dry_run.md"
RESERVED = (
    "the step's allocations and frees replayed through the caching allocator's rules (2 MiB and 20 MiB "
    "segments, best fit, splits and merges; planner/cuda_allocator.py), what max_memory_reserved reads, "
    "with each formula buffer in a segment of its own; not modelled: per-stream pools, the CUDA context and "
    "NCCL's buffers; not yet measured on a GPU"
)
TRACED = (
    "traced: training steps under fake tensors and a fake process group (on CPU, with gloo's copy of "
    "each reduce-scatter input); against real 2- and 4-rank CPU pools (an MLP, a small GPT, a large "
    f"embedding) the peak of ddp and fsdp came within 2% of the measured one ({RESULTS})"
)
ZERO3 = (
    "modelled: ZeRO-3 cannot be traced without DeepSpeed's internals, so the trace is full sharding per "
    "FSDP unit with DeepSpeed's optimizer layout (AdamW over a flat float32 copy of the partition, a "
    "persistent gradient partition) plus its reduce bucket by formula; against real 2- and 4-rank CPU "
    f"pools it came within 10% of the measured peak, 6% low to 9% high ({RESULTS})"
)
OFFLOAD = (
    "split by role: the trace runs everything on CPU fake tensors, so of its peak the sharded parameters, "
    "their gradients and the optimizer state (what CPUOffloadPolicy keeps on the host, where the "
    "optimizer steps) are host bytes, and the rest (gathered units and their copies to the device, "
    "unsharded gradients, activations, temporaries, buffers) is the device peak"
)
ZERO3_OFFLOAD = (
    "modelled: ZeRO-3 with offload_param and offload_optimizer on the CPU as FSDP2's CPUOffloadPolicy "
    "over the same units, with DeepSpeed's flat float32 optimizer partition on the host; not measured "
    "against a real DeepSpeed pool"
)
DEVICES = ("cuda", "cpu")
#: the ``--precision`` values a dry run follows, each as its strategy applies it
PRECISIONS = ("32", "bf16-mixed")
MIXED = {
    "ddp": "bf16-mixed as the ddp strategy runs it: the forward under CPU autocast to bfloat16 over float32 "
    "parameters (the trace's autocast stands in for CUDA's)",
    "fsdp": "bf16-mixed as the fsdp strategy runs it: FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, "
    "reduce_dtype=float32), so units are gathered and computed in bfloat16 over float32 shards",
    "deepspeed": "bf16-mixed as the deepspeed strategy runs it: bfloat16 parameters and floating-point "
    "inputs, float32 master copies in the optimizer's flat partition",
}


def dry_run(
    model_or_builder: nn.Module | Callable[[], nn.Module] | str,
    batch: object,
    world_size: int,
    device: str = "cuda",
    strategies: Iterable[str] | None = None,
    step: Step | None = None,
    precision: str = "32",
    *,
    namespace: Mapping[str, Any] | None = None,
) -> dict[str, Plan]:
    """Per strategy name (:data:`STRATEGIES`; ``"fsdp"`` and ``"deepspeed"`` name all of theirs),
    what each of ``world_size`` ranks holds at the peak of a training step on ``batch``.

    ``model_or_builder`` is a module (its structure is copied to fake tensors, its storage is never
    touched), a function of no arguments that builds it (run on the meta device), or a string of
    code that builds it: the model is the code's last expression, or else the variable ``model`` it
    defines. The code runs like a builder, under fake tensors on the meta device (a 7B model
    allocates nothing), in a scratch copy of ``namespace`` (the names it may read, such as a class the
    notebook defined; ``torch`` and ``nn`` are there too), so it defines nothing outside. ``batch`` is a
    tensor, a tuple, list or dict of tensors, or an expression such as ``"torch.randn(8, 1024)"``.
    ``step(model, batch)`` replaces the default step (forward, mean of the output, backward, AdamW).
    ``precision`` is ``"32"`` (the model's own dtype) or ``"bf16-mixed"``, applied as each strategy
    applies ``--precision bf16-mixed`` (:data:`MIXED`), so a plan is for the line that would run it.
    Bad input (code that does not compile, raises or defines no model, among the rest) raises
    :class:`~jupyter_shard.errors.SpecError` with one line saying what to pass. From code::

        dry_run("layers = [nn.Linear(4096, 4096) for _ in range(32)]\nnn.Sequential(*layers)",
                "torch.randn(8, 4096)", world_size=8, strategies=["fsdp"])
    """
    if isinstance(model_or_builder, str):
        model_or_builder = model_builder(model_or_builder, namespace)
    names = _strategy_names(strategies)
    _check_world(world_size, names)
    if device not in DEVICES:
        raise SpecError(f"device {device!r} is not valid; choose one of: {', '.join(DEVICES)}")
    if step is not None and not callable(step):
        raise SpecError(f"step must be a function step(model, batch), not a {type(step).__name__}")
    if step is not None and (outside := tracing.outside_optimizers(step)):
        raise SpecError(
            f"the step uses the optimizer {outside[0]!r}, made outside it over your own model: the dry run "
            "traces a copy of the model, so it would count no optimizer state and step your model; make "
            "the optimizer inside step from model.parameters()"
        )
    if precision not in PRECISIONS:
        raise SpecError(f"precision {precision!r} cannot be planned; choose one of: {', '.join(PRECISIONS)}")
    if dist.is_available() and dist.is_initialized():
        # a real default group (inside a rank): plan in a forked child, leaving it alone
        return forked(lambda: _plan_all(model_or_builder, batch, world_size, device, names, step, precision))
    return _plan_all(model_or_builder, batch, world_size, device, names, step, precision)


def find_batch(
    model_or_builder: nn.Module | Callable[[], nn.Module] | str,
    make_batch: Callable[[int], object],
    world_size: int,
    device_bytes: int,
    strategy: str,
    step: Step | None = None,
    device: str = "cuda",
    precision: str = "32",
) -> int:
    """The largest batch size whose dry-run peak per rank fits in ``device_bytes`` with ``strategy``
    (one name of :data:`STRATEGIES`), measured to fit while the size above it is measured not to
    (:mod:`~jupyter_shard.planner.batch_search`). 0 if even a batch of 1 does not fit.
    ``model_or_builder`` is what :func:`dry_run` takes (code runs over no namespace but torch and nn)."""
    args = (model_or_builder, make_batch, world_size, device_bytes, strategy, step, device, precision)
    return find_batch_plan(*args)[0]


def find_batch_plan(
    model_or_builder: nn.Module | Callable[[], nn.Module] | str,
    make_batch: Callable[[int], object],
    world_size: int,
    device_bytes: int,
    strategy: str,
    step: Step | None = None,
    device: str = "cuda",
    precision: str = "32",
) -> tuple[int, Plan | None]:
    """:func:`find_batch`'s size with the plan of that size (None with 0), traced once."""
    from jupyter_shard.planner.batch_search import largest_batch

    if isinstance(model_or_builder, str):
        model_or_builder = model_builder(model_or_builder)
    if strategy not in STRATEGIES:
        raise SpecError(f"find_batch needs one strategy; choose one of: {', '.join(STRATEGIES)}")
    if not isinstance(device_bytes, int) or device_bytes < 1:
        raise SpecError(f"device_bytes {device_bytes!r} is not valid; give the free bytes per rank")

    def measure(size: int) -> Plan:
        try:
            batch = make_batch(size)
        except Exception as exc:
            raise SpecError(
                f"make_batch({size}) raised {one_line(exc)}; pass a function of the batch size "
                "that returns a batch"
            ) from exc
        return dry_run(model_or_builder, batch, world_size, device, [strategy], step, precision)[strategy]

    return largest_batch(measure, device_bytes, MAX_BATCH)


# -- checking what was asked ----------------------------------------------------------------------


def _strategy_names(strategies: Iterable[str] | None) -> list[str]:
    if strategies is None:
        return list(STRATEGIES)
    if isinstance(strategies, str):
        strategies = [strategies]
    names: list[str] = []
    for name in strategies:
        for one in _ALIASES.get(name, (name,)):
            if one not in STRATEGIES:
                choices = ", ".join([*STRATEGIES, *_ALIASES])
                raise SpecError(f"strategy {name!r} cannot be planned; choose from: {choices}")
            names += [one] if one not in names else []
    if not names:
        raise SpecError(f"no strategy to plan; choose from: {', '.join(STRATEGIES)}")
    return names


def _check_world(world_size: object, names: list[str]) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD:
        raise SpecError(
            f"world_size {world_size!r} is not valid; give a whole number of ranks from 1 to {MAX_WORLD}"
        )
    if world_size == 1:
        sharded = [n for n in names if n != "ddp"]
        if sharded and len(sharded) == len(names):
            raise SpecError(f"{', '.join(sharded)} shard over ranks: plan them with world_size of 2 or more")


# -- running the strategies -----------------------------------------------------------------------


def _plan_all(
    model_or_builder: nn.Module | Callable[[], nn.Module],
    batch: object,
    world_size: int,
    device: str,
    names: list[str],
    step: Step | None,
    precision: str = "32",
) -> dict[str, Plan]:
    """Every plan, under a fake default process group made for this call and destroyed after it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook  # init_process_group prefixes it with the rank: the caller's is restored
    # A batch the model cannot take fails in a fake op, which torch logs with its whole traceback
    # before raising; the user is told in one line (tracing's SpecError), so the log stays quiet.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    todo = [n for n in names if world_size > 1 or n == "ddp"]
    progress = Progress(len(todo), QUIET_FOR)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
        plans = Plans()
        for name in todo:
            progress.tracing(name)
            try:
                traced = _trace(name, model_or_builder, batch, mesh, world_size, device, step, precision)
            except SpecError as exc:  # this plan's own failure: the others are still worth showing
                plans.failed[name] = str(exc)
                continue
            plans[name] = _plan(name, traced, world_size, device, step, precision)
        if not plans:
            raise SpecError(next(iter(plans.failed.values())))
        return plans
    except KeyboardInterrupt:
        progress.stopped()
        raise
    finally:
        progress.done()
        dist.destroy_process_group()
        sys.excepthook = hook
        fake_log.setLevel(level)


def _trace(
    name: str,
    model_or_builder: nn.Module | Callable[[], nn.Module],
    batch: object,
    mesh: Any,
    world_size: int,
    device: str,
    step: Step | None,
    precision: str = "32",
) -> Traced:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from jupyter_shard.strategies.fsdp_units import unit_policies
    from jupyter_shard.strategies.precision import Precision, cast_floating_inputs, cast_parameters

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    model = tracing.fake_model(model_or_builder, mode, gpu=device == "cuda")
    inputs = tracing.fake_batch(batch, mode)
    tensors = tracing.batch_tensors(inputs)
    formula: dict[str, int] = {}
    unit = None
    dtype = Precision.parse(precision).dtype
    with mode:
        if name == "ddp":
            if dtype is not None:
                Precision.parse(precision).autocast_forward(model, "cpu")  # fake tensors live on the CPU
            # DDP's reducer keeps one flat copy of the gradients in its buckets (real storage it reads,
            # so DDP itself cannot run on fake tensors)
            formula["transient"] = tracing.parameter_bytes(model)

            def make_tracker(optimizers: list[torch.optim.Optimizer]) -> Any:
                tracker = MemTracker()
                tracker.track_external(model, *optimizers, *tensors)
                return tracker
        else:
            units = tracing.default_units(model)
            unit = tracing.largest_unit(model, units)
            reshard = STRATEGIES[name].get("sharding", "FULL_SHARD") != "SHARD_GRAD_OP"
            whole = tracing.parameter_bytes(model)
            policies: dict[str, Any] = {}  # fully_shard's, as the fsdp strategy passes them
            if dtype is not None and not name.startswith("fsdp"):
                cast_parameters(model, dtype)  # DeepSpeed holds the parameters in the low dtype
                cast_floating_inputs(model, dtype)
            if STRATEGIES[name].get("offload") == "cpu":
                # fake tensors live on the CPU, where pinning would need CUDA: pinning changes no size
                policies["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
            fsdp_dtype = dtype if name.startswith("fsdp") else None
            for module, policy in unit_policies(model, units, fsdp_dtype):
                try:
                    fully_shard(
                        module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, **policies
                    )
                except Exception as exc:
                    raise SpecError(
                        f"{name} cannot shard this model ({one_line(exc)}); plan ddp, or report the "
                        "model's class so its units can be chosen"
                    ) from exc
                if device == "cpu" and name.startswith("fsdp"):
                    # DeepSpeed reduces through its own bucket (counted below), not FSDP's reduce-scatter
                    module.set_custom_reduce_scatter(tracing.gloo_reduce_scatter())  # type: ignore[operator]
            if name.startswith("deepspeed"):
                bucket = 2 if dtype is not None else 4  # DeepSpeed's bucket holds the gradients' dtype
                formula.update(_zero3_buffers(model, whole, world_size, step is None, bucket))

            def make_tracker(optimizers: list[torch.optim.Optimizer]) -> Any:
                tracker = FSDPMemTracker(model, optimizers[0] if optimizers else None)
                tracker.track_inputs(tuple(tensors))
                return tracker

        optimizer: torch.optim.Optimizer | None = None
        run: Step | None = step
        if step is None and name.startswith("deepspeed"):
            run, optimizer = tracing.zero3_step(model, foreach=device == "cuda")
        elif step is None:
            # torch's default on CUDA: one multi-tensor kernel over every parameter, not one by one
            optimizer = torch.optim.AdamW(model.parameters(), foreach=device == "cuda")
            run = tracing.default_step(optimizer)
        assert run is not None
        rounding = cuda_blocks() if device == "cuda" else contextlib.nullcontext()
        with rounding:
            offloaded = "offload" in STRATEGIES[name]
            host = HOST_ROLES if offloaded else ()
            tracker = tracing.run_steps(model, inputs, run, optimizer, make_tracker, device == "cuda", host)
    snap = tracing.peak_snapshot(tracker)
    traced = _breakdown(snap, unit, formula, offloaded, _gradient_shard(model) if offloaded else 0)
    return tracing.with_reserved(traced, tracker)


def _gradient_shard(model: nn.Module) -> int:
    """Bytes of this rank's shard of the gradients (float32, as the shards are): an offload plan holds
    it in host memory from the reduce-scatter to the optimizer step, which the device's peak, read
    earlier in the step, does not show."""
    local = [getattr(p, "_local_tensor", p) for p in model.parameters() if p.requires_grad]
    return sum(t.numel() * t.element_size() for t in local)


def _zero3_buffers(
    model: nn.Module, whole: int, world_size: int, traced_optimizer: bool, bucket_bytes: int = 4
) -> dict[str, int]:
    """DeepSpeed ZeRO-3's own buffers that the trace does not hold: the reduce bucket, which the
    deepspeed strategy sizes to the largest parameter (in the gradients' dtype: bfloat16 under
    bf16-mixed), and, where a user's step replaced the traced optimizer layout, the optimizer's flat
    float32 copy of this rank's partition."""
    largest = max((p.numel() for p in model.parameters()), default=0)
    extra = {"transient": largest * bucket_bytes}
    return extra if traced_optimizer else {**extra, "optimizer": -(-whole // world_size)}


def _breakdown(
    snap: dict[str, int],
    unit: tuple[str, int] | None,
    formula: dict[str, int],
    offloaded: bool = False,
    gradient_shard: int = 0,
) -> Traced:
    """The tracker's categories at the peak as the plan's figures; with ``offloaded``, what the offload
    policy keeps on the host (:data:`HOST_ROLES`) is taken out of the device figures into ``host``,
    which is the host's own peak: the sharded parameters and optimizer state with the whole
    ``gradient_shard``, however much of it existed at the device's peak."""

    def take(*keys: str) -> int:
        return sum(snap.get(k, 0) for k in keys if not (offloaded and k in HOST_ROLES))

    return Traced(
        peak=take("Total") - (sum(snap.get(k, 0) for k in HOST_ROLES) if offloaded else 0),
        parameters=take("Parameter", "Sharded Param", "Buffer"),
        gradients=take("Gradient", "Sharded Grad", "Unsharded Grad"),
        optimizer=take("Optstate", "OptState"),
        activations=take("Activation", "Inputs", "Other"),
        transient=take("Temp", "Unsharded Param", "All Gather", "Reduce Scatter"),
        largest_unit=unit,
        formula=formula,
        host=sum(snap.get(k, 0) for k in HOST_ROLES if k != "Sharded Grad") + gradient_shard
        if offloaded
        else 0,
    )


def _plan(
    name: str, traced: Traced, world_size: int, device: str, step: Step | None, precision: str = "32"
) -> Plan:
    parts = {
        "parameters": traced.parameters,
        "gradients": traced.gradients,
        "optimizer": traced.optimizer,
        "activations": traced.activations,
        "transient": traced.transient,
    }
    offloaded = "offload" in STRATEGIES[name]
    host = traced.host
    source = dict.fromkeys(parts, TRACED)
    notes = _FORMULA_NOTES.get(name.removesuffix(" + offload"), {})
    for key, extra in traced.formula.items():
        if offloaded and key == "optimizer":
            host += extra  # DeepSpeed's float32 partition is offloaded with the optimizer
            continue
        parts[key] += extra
        source[key] = f"traced, plus {notes[key]}"
    peak = sum(parts.values())
    source["peak_bytes"] = "formula and trace" if traced.formula else TRACED
    if name.startswith("deepspeed"):
        source["peak_bytes"] = f"{ZERO3_OFFLOAD if offloaded else ZERO3}; {ds_estimate()}"
    source["host_bytes"] = OFFLOAD if offloaded else "no offload planned"
    if offloaded:
        source["parameters"] = source["gradients"] = source["optimizer"] = f"{TRACED}; {OFFLOAD}"
    source["step"] = "the step function passed" if step is not None else f"{tracing.STEPS} steps of AdamW"
    if step is None and name.startswith("deepspeed"):
        source["step"] += " over DeepSpeed's flat float32 partition"
    if precision != "32":
        source["precision"] = MIXED[name.split()[0]]
    if device == "cuda":
        source["device"] = (
            "traced on CPU shapes, each tensor's block rounded up to 512 bytes as CUDA's caching allocator "
            f"does (torch's round_size); reserved: {RESERVED}"
        )
    return Plan(
        strategy=name,
        options=dict(STRATEGIES[name]),
        world_size=world_size,
        device=device,
        peak_bytes=peak,
        host_bytes=host,
        largest_unit=traced.largest_unit,
        source=source,
        precision=precision,
        reserved_bytes=max(traced.reserved, peak) if device == "cuda" else 0,
        **parts,
    )


_FORMULA_NOTES: dict[str, dict[str, str]] = {
    "ddp": {"transient": "formula: DDP's gradient buckets, one flat copy of the gradients"},
    "deepspeed ZeRO-3": {
        "optimizer": "formula: DeepSpeed's float32 copy of this rank's partition (the step passed replaces "
        "the traced optimizer)",
        "transient": "formula: DeepSpeed's reduce bucket (the largest parameter, float32)",
    },
}


class _CallableModule(ModuleType):
    """This module, callable as :func:`dry_run`: the issue's ``jupyter_shard.planner.dry_run(...)`` names
    the function and the module alike, and once the module is imported the package's attribute is the
    module, so calling it must run the dry run."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Plan]:
        return dry_run(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
