"""One training step of the user's model under fake tensors, prepared as a strategy would prepare it.

Why it exists: the bytes a rank holds depend on the model's real shapes, the batch, the optimizer and
what the strategy gathers at once, which no formula over the parameter count sees. ``FakeTensorMode``
runs every operator for its shapes and dtypes only, and torch's memory trackers
(``torch.distributed._tools``) follow those tensors through a forward, backward and optimizer step, so
the step is measured without the memory it describes. The fake process group set up by
:mod:`jupyter_shard.planner.dry_run` stands in for the ranks; this module never starts one.

What cannot run on fake tensors is counted by formula and named as such: DDP's reducer reads real
storage (its gradient buckets are added from the parameter sizes), and DeepSpeed ZeRO-3 is not traced
itself but modelled: full sharding per unit with DeepSpeed's optimizer layout (:func:`zero3_step`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import types
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from jupyter_shard.errors import SpecError, one_line
from jupyter_shard.planner import cuda_allocator
from jupyter_shard.planner.gpu_code import gpu_code_on_cpu, moves_in_place

#: steps run: the second one holds optimizer state through forward and backward, the steady state
STEPS = 2
_CPU = torch.device("cpu")
Step = Callable[[nn.Module, Any], object]


@dataclass(frozen=True)
class Traced:
    """Bytes per rank at the traced peak, by what holds them, and the figures added by formula; the
    figures are the device's, and ``host`` is what an offload plan keeps in host memory."""

    peak: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    transient: int
    largest_unit: tuple[str, int] | None
    formula: dict[str, int] = field(default_factory=dict)
    host: int = 0  # what an offload plan keeps in host memory, not counted in the figures above
    reserved: int = 0  # a CUDA plan's segments reserved by the caching allocator (cuda_allocator)


# -- the model and the batch, fake -----------------------------------------------------------------


def fake_model(
    model_or_builder: nn.Module | Callable[[], nn.Module], mode: FakeTensorMode, gpu: bool = False
) -> nn.Module:
    """The user's model with every parameter and buffer a fake CPU tensor of the same shape and dtype.

    A module is copied with its tensors swapped for meta ones first, so its real storage is never
    read or copied; a builder runs on the meta device under the fake mode, so a 7B model allocates
    nothing.
    """
    if isinstance(model_or_builder, nn.Module):
        memo: dict[int, Any] = {}
        for tensor in [*model_or_builder.parameters(), *model_or_builder.buffers()]:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = (
                nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
            )
        try:
            model = copy.deepcopy(model_or_builder, memo)
        except Exception as exc:
            raise SpecError(
                f"the model cannot be copied to plan it ({one_line(exc)}); pass a function of no "
                "arguments that builds it instead"
            ) from exc
    elif callable(model_or_builder):
        # a layer may make a buffer from a constant (BatchNorm's ``torch.tensor(0)`` count) and then
        # reset it in place: the fake mode takes such tensors in while the model is built, and every
        # buffer and parameter is replaced by a fake one below
        strict = mode.allow_non_fake_inputs
        mode.allow_non_fake_inputs = True
        try:
            gpu_code = gpu_code_on_cpu() if gpu else contextlib.nullcontext()
            with mode, torch.device("meta"), gpu_code, moves_in_place():
                model = model_or_builder()
        except SpecError:  # model code (:mod:`.cell_model`) says itself what went wrong
            raise
        except Exception as exc:
            raise SpecError(
                f"the model builder raised {one_line(exc)}; pass an nn.Module or a function of no "
                "arguments that builds one"
            ) from exc
        finally:
            mode.allow_non_fake_inputs = strict
        if not isinstance(model, nn.Module):
            raise SpecError(
                f"the model builder returned {type(model).__name__}, not an nn.Module; pass a function "
                "that returns the model"
            )
    else:
        raise SpecError(
            f"cannot plan a {type(model_or_builder).__name__}; pass an nn.Module or a function of no "
            "arguments that builds one"
        )
    _materialise(model, mode)
    return model


def _materialise(model: nn.Module, mode: FakeTensorMode) -> None:
    """Replace every parameter and buffer by a fake CPU tensor, keeping tied tensors tied."""
    made: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    if id(tensor) not in made:
                        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=_CPU)
                        is_param = isinstance(tensor, nn.Parameter)
                        made[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if is_param else empty
                    table[name] = made[id(tensor)]


def fake_batch(batch: object, mode: FakeTensorMode) -> object:
    """The batch as fake tensors: a tensor, a tuple, list or dict of them, or an expression such as
    ``"torch.randn(8, 1024, 2048)"`` evaluated under the fake mode (so it allocates nothing)."""
    if isinstance(batch, str):
        try:
            with mode:
                return fake_batch(eval(batch, {"torch": torch}), mode)
        except SpecError:
            raise
        except Exception as exc:
            raise SpecError(
                f"the batch expression {batch!r} failed: {one_line(exc)}; write one such as "
                '"torch.randn(8, 1024)"'
            ) from exc
    if isinstance(batch, torch.Tensor):
        return mode.from_tensor(batch) if not mode.is_our_fake(batch) else batch
    if isinstance(batch, tuple | list):
        return type(batch)(fake_batch(item, mode) for item in batch)
    if isinstance(batch, Mapping):  # a dict, or a tokenizer's BatchEncoding
        return {key: fake_batch(value, mode) for key, value in batch.items()}
    raise SpecError(
        f"a batch of type {type(batch).__name__} cannot be planned; pass a tensor, a tuple or dict of "
        'tensors or an expression such as "torch.randn(8, 1024)"'
    )


def batch_tensors(batch: object) -> list[torch.Tensor]:
    """Every tensor in the batch, for the trackers to count as inputs."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, tuple | list):
        return [t for item in batch for t in batch_tensors(item)]
    if isinstance(batch, Mapping):
        return [t for item in batch.values() for t in batch_tensors(item)]
    return []


# -- units -------------------------------------------------------------------------------------------


def default_units(model: nn.Module) -> list[nn.Module]:
    """The submodules the fsdp strategy shards on their own, children before parents: its own rule
    (:func:`jupyter_shard.strategies.fsdp.default_units`), so that a plan wraps what a pool would."""
    from jupyter_shard.strategies.fsdp_units import default_units as fsdp_units

    return fsdp_units(model)


def largest_unit(model: nn.Module, units: list[nn.Module]) -> tuple[str, int]:
    """The unit whose gathered (whole) parameters take the most bytes, the root counting what no
    other unit claims; its name (``""`` is the root) and those bytes."""
    names = {id(m): n for n, m in model.named_modules()}
    claimed: set[int] = set()
    best = ("", 0)
    for module in [*units, model]:
        free = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in free)
        size = sum(p.numel() * p.element_size() for p in free)
        if size > best[1]:
            best = (names[id(module)] or "<root>", size)
    return best


def gloo_reduce_scatter() -> Any:
    """An FSDP2 reduce-scatter that, before reducing, holds a scratch tensor the size of its input.

    gloo, the CPU backend, reduce-scatters through a full-size copy of the input (measured with
    ``MemTracker`` on a real 2-rank gloo group: input, output and one more input-sized tensor); the
    fake process group allocates nothing, so without this a CPU plan misses that copy where it makes
    the peak (a large embedding's gradient). NCCL reduce-scatters in place, so CUDA plans do not use it.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class GlooReduceScatter(DefaultReduceScatter):
        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: Any,
            op: Any,
            async_op: bool = False,
        ) -> Any:
            scratch = torch.empty_like(input_tensor)
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            del scratch
            return work

    return GlooReduceScatter()


# -- the step ----------------------------------------------------------------------------------------


def default_step(optimizer: torch.optim.Optimizer) -> Step:
    """Forward, a scalar loss from the output, backward, an optimizer step, gradients set to None:
    what a plain training loop does, with the optimizer made after the strategy's ``prepare`` (as the
    strategies rebuild it) so the trackers know its state for what it is."""

    def step(model: nn.Module, batch: object) -> None:
        loss = scalar_loss(forward(model, batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def zero3_step(model: nn.Module, foreach: bool = False) -> tuple[Step, torch.optim.Optimizer]:
    """DeepSpeed ZeRO-3's optimizer layout on a sharded model: AdamW over one flat float32 copy of this
    rank's partition, whose gradient is the partition's gradients flattened at each step, the result
    copied back into the partition; the partition's gradients stay allocated between steps, as
    DeepSpeed's gradient partition buffer does. A flat tensor makes Adam's temporaries
    partition-sized, which a per-parameter optimizer never holds."""
    params = [p for p in model.parameters() if p.requires_grad]
    shards = [_local(p) for p in params]
    master = nn.Parameter(torch.empty(sum(t.numel() for t in shards), dtype=torch.float32))
    optimizer = torch.optim.AdamW([master], foreach=foreach)

    def step(model: nn.Module, batch: object) -> None:
        scalar_loss(forward(model, batch)).backward()
        master.grad = torch.cat([_local(p.grad).reshape(-1).float() for p in params if p.grad is not None])
        optimizer.step()
        master.grad = None
        with torch.no_grad():
            offset = 0
            for shard in shards:
                shard.copy_(master[offset : offset + shard.numel()].view_as(shard))
                offset += shard.numel()
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()

    return step, optimizer


def _local(tensor: Any) -> torch.Tensor:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    assert isinstance(local, torch.Tensor)
    return local


def forward(model: nn.Module, batch: object) -> object:
    if isinstance(batch, tuple | list):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


def scalar_loss(output: object) -> torch.Tensor:
    """A loss to call ``backward`` on: the output's mean (its ``loss`` or first tensor if it is not one)."""
    if isinstance(output, torch.Tensor):
        return output.float().mean()
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, tuple | list) and output:
        return scalar_loss(output[0])
    if isinstance(output, dict) and output:
        return scalar_loss(next(iter(output.values())))
    raise SpecError(
        f"the model returned a {type(output).__name__}, which has no loss to differentiate; pass "
        "step=fn(model, batch) that runs forward, backward and the optimizer step"
    )


def run_steps(
    model: nn.Module,
    batch: object,
    step: Step,
    optimizer: torch.optim.Optimizer | None,
    make_tracker: Callable[[list[torch.optim.Optimizer]], Any],
    gpu: bool = False,
    host: Collection[str] = (),
) -> Any:
    """One step untracked, then :data:`STEPS` - 1 steps under the tracker ``make_tracker`` returns for
    the optimizers that exist by then; the tracker.

    The first step makes the optimizer's state and warms the fake-tensor and DTensor caches, whose
    first use allocates scratch tensors a real step never holds (a first FSDP step traced cold reads
    some 15% high); the steady-state step after it holds the optimizer state through forward and
    backward, which is the peak a training loop reaches. A failure becomes one line saying what to pass.
    """
    _one_step(model, batch, step, optimizer, gpu)
    optimizers = [optimizer] if optimizer is not None else _optimizers_of(model)
    tracker = make_tracker(optimizers)
    tracker._update_peak_stats = types.MethodType(_global_peak_only, tracker)
    if gpu:  # the caching allocator's segments, replayed from what the tracker sees (``host`` stays off)
        tracker.jshard_allocator = cuda_allocator.follow(tracker, host)
    for opt in optimizers:
        tracker._track_optimizer_states(tracker._ref_class.OPT, opt)
        for group in opt.param_groups:  # a flat copy the optimizer holds (the model's own stay as they are)
            for param in group["params"]:
                tracker._update_and_maybe_create_winfos(param, tracker._ref_class.OPT)
    with tracker:
        for _ in range(STEPS - 1):
            _one_step(model, batch, step, optimizer, gpu)
            tracker.reset_mod_stats()
    return tracker


def with_reserved(traced: Traced, tracker: Any) -> Traced:
    """``traced`` with the peak the caching allocator reserved in :func:`run_steps` (a CUDA plan),
    each buffer counted by formula in a segment of its own."""
    allocator = getattr(tracker, "jshard_allocator", None)
    if allocator is None:
        return traced
    segments = (cuda_allocator.segment_size(cuda_allocator.round_size(b)) for b in traced.formula.values())
    extra = sum(size for size, b in zip(segments, traced.formula.values(), strict=True) if b)
    return dataclasses.replace(traced, reserved=allocator.peak_reserved + extra)


def _global_peak_only(tracker: Any, peak_state: object) -> None:
    """The tracker's peak over the whole step, without its peak per module.

    torch's ``MemTracker._update_peak_stats`` walks every module the tracker has seen after every
    operator to keep each one's own peak, which the dry run never reads: on a 24-layer model that walk
    was half the time of a plan (10 of 22 s)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    for dev, snap in tracker._curr_mem_snap.items():
        if tracker._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
            tracker._peak_mem[dev] = snap[_TOTAL_KEY]
            tracker._peak_mem_snap[dev] = dict(snap)


def _one_step(
    model: nn.Module, batch: object, step: Step, optimizer: torch.optim.Optimizer | None, gpu: bool
) -> None:
    """One step; ``gpu``: a plan for CUDA, where code written for a GPU runs as it would there."""
    try:
        with gpu_code_on_cpu() if gpu else contextlib.nullcontext():
            step(model, batch)
    except SpecError:
        raise
    except Exception as exc:
        if _data_dependent(exc):
            raise SpecError(
                f"the model's forward makes shapes that depend on the data ({one_line(exc)}), as a "
                "Mixture-of-Experts router does, which the dry run's fake tensors cannot trace; measure "
                "it on a live pool (%dist_picker ... --find-batch --confirm) instead"
            ) from exc
        user = optimizer is None
        what = "the step function" if user else "the model's forward or backward on this batch"
        fix = (
            "pass step=fn(model, batch) that runs forward, backward and the optimizer step"
            if user
            else "pass a batch the model's forward takes (its shape and dtype), or a step function"
        )
        raise SpecError(f"{what} raised {one_line(exc)}; {fix}") from exc


def _data_dependent(exc: BaseException) -> bool:
    """Whether tracing failed on shapes only the data decides: torch's fake tensors raise
    ``DynamicOutputShapeException`` (``nonzero``, ``unique``) or ``DataDependentOutputException``
    (``.item()``), and its shape rule for ``grouped_mm`` (a MoE's experts) refuses float32 inputs
    that the CPU kernel takes."""
    from torch._subclasses import fake_tensor

    kinds = (fake_tensor.DynamicOutputShapeException, fake_tensor.DataDependentOutputException)
    return isinstance(exc, kinds) or "mat_a.dtype" in str(exc)


def outside_optimizers(step: Step) -> list[str]:
    """The names under which ``step`` reaches an optimizer it did not make (a global or a variable of
    an enclosing function): one built over the user's own model. The dry run traces a copy of the
    model, so such an optimizer would find no gradients to count (its state read as 0 bytes) and would
    step the user's real parameters with whatever gradients they hold."""
    import dis
    import functools

    if isinstance(step, functools.partial):
        bound = [*step.args, *step.keywords.values()]
        found = [f"{i}" for i, v in enumerate(bound) if isinstance(v, torch.optim.Optimizer)]
        return found + outside_optimizers(step.func)
    code = getattr(step, "__code__", None)
    if code is None:
        return []
    scope = getattr(step, "__globals__", {})
    cells = dict(zip(code.co_freevars, getattr(step, "__closure__", None) or (), strict=False))
    found = []
    for instruction in dis.get_instructions(code):  # the names the step loads, not its attributes
        name = instruction.argval
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            value = scope.get(name)
        elif instruction.opname == "LOAD_DEREF" and name in cells:
            try:
                value = cells[name].cell_contents
            except ValueError:  # a cell not yet filled
                continue
        else:
            continue
        if isinstance(value, torch.optim.Optimizer) and name not in found:
            found.append(name)
    return found


def _optimizers_of(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers over ``model``'s parameters that a user's step made (found among live objects,
    since the step keeps its own)."""
    ids = {id(p) for p in model.parameters()}
    with warnings.catch_warnings():  # isinstance on torch's deprecated lazy objects warns
        warnings.simplefilter("ignore")
        found = [obj for obj in gc.get_objects() if isinstance(obj, torch.optim.Optimizer)]
    return [opt for opt in found if any(id(p) in ids for group in opt.param_groups for p in group["params"])]


def peak_snapshot(tracker: Any) -> dict[str, int]:
    """The tracker's breakdown at its peak on the CPU (where fake tensors live), by category name."""
    snapshot = tracker.get_tracker_snapshot("peak").get(_CPU, {})
    return {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items()}


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
