"""What the picker's fields mean: the model's size from ``%dist_picker ARG``, a checked choice, and
the ``%%distributed`` line and ``--config`` JSON that choice needs.

Why it exists: the rules that make a choice runnable (ZeRO stages only with deepspeed, which offload
each strategy supports, bf16 only on GPUs that have it, which options live in the line and which in
a config file) are plain functions, testable without a widget; :mod:`jupyter_shard.notebook.picker`
is the form around them.
"""

from __future__ import annotations

import html
import json
import numbers
import re
import shlex
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jupyter_shard.gpus import gpu_option_text
from jupyter_shard.planner import estimate as est
from jupyter_shard.planner.free_memory import Capability
from jupyter_shard.spec import Device, Offload, Precision, SpecError

USAGE = "pass a model (`%dist_picker model`) or a parameter count (`%dist_picker 1.3B`)"
DEFAULT_CONFIG = {"fsdp": "fsdp_options", "deepspeed": "ds_config"}
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
BF16_CAPABILITY = (8, 0)  # bf16 tensor cores and kernels: Ampere (A100, RTX 30xx) and newer


@dataclass(frozen=True)
class ModelInfo:
    """What the picker knows about the model: its size, and its module classes (for checkpointing)."""

    parameters: int | None = None
    classes: frozenset[str] = frozenset()
    blocks: tuple[str, ...] = ()  # classes that repeat, the usual checkpointing targets


def model_info(arg: str, namespace: Mapping[str, Any]) -> ModelInfo:
    """``ARG`` is empty, a parameter count (``1.3B``), or a name (``model``, ``trainer.model``)."""
    text = arg.strip()
    if not text:
        return ModelInfo()
    names = text.split(".")
    if not all(n.isidentifier() for n in names):
        return ModelInfo(_count(text))
    if names[0] not in namespace:
        raise SpecError(f"%dist_picker: no variable {names[0]!r} in the notebook; {USAGE}")
    value = namespace[names[0]]
    for i, name in enumerate(names[1:], start=1):
        if not hasattr(value, name):
            raise SpecError(f"%dist_picker: {'.'.join(names[:i])} has no attribute {name!r}; {USAGE}")
        value = getattr(value, name)
    return _info(value, text)


def _count(text: str) -> int:
    try:
        return est.parse_count(text)
    except SpecError as exc:
        raise SpecError(f"%dist_picker: {exc}") from None


def _info(value: Any, name: str) -> ModelInfo:
    if isinstance(value, str):
        return ModelInfo(_count(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return ModelInfo(_count(str(value)))
    if not callable(getattr(value, "parameters", None)):
        raise SpecError(f"%dist_picker: {name} is a {type(value).__name__}, not a torch module; {USAGE}")
    count = sum(int(p.numel()) for p in value.parameters())
    if count < 1:
        raise SpecError(f"%dist_picker: {name} has no parameters; {USAGE}")
    modules = list(value.modules()) if callable(getattr(value, "modules", None)) else [value]
    repeats = Counter(type(m).__name__ for m in modules[1:] if any(True for _ in m.children()))
    blocks = tuple(sorted(n for n, k in repeats.items() if k > 1))
    return ModelInfo(count, frozenset(type(m).__name__ for m in modules), blocks)


def distributed_line(
    plan: est.Plan,
    device: Device,
    nproc: int,
    precision: Precision,
    config: str | None = None,
    devices: Sequence[int] = (),
) -> str:
    """The ``%%distributed`` line for ``plan``, with only options that ``%%distributed`` takes;
    ``devices`` (a running pool's ``--gpus 0,2``) are kept when there is one per rank."""
    parts = ["%%distributed", "--strategy", plan.strategy]
    if plan.strategy == "deepspeed":
        parts += ["--zero-stage", str(plan.zero_stage)]
    chosen = tuple(devices) if len(devices) == nproc and tuple(devices) != tuple(range(nproc)) else nproc
    gpus = ["--gpus", gpu_option_text(chosen)]
    parts += gpus if device is Device.CUDA else ["--nproc", str(nproc), "--device", "cpu"]
    if precision is not Precision.FP32:
        parts += ["--precision", precision.value]
    if plan.offload is not Offload.NONE:
        parts += ["--offload", plan.offload.value]
    if config is not None:
        parts += ["--config", config]
    return shlex.join(parts)


def strategy_config(plan: est.Plan, checkpoint: tuple[str, ...], nvme_path: str) -> dict[str, Any] | None:
    """What ``--config`` must hold for ``plan`` (None when the line alone says it all)."""
    config: dict[str, Any] = {}
    if plan.strategy == "fsdp":
        if plan.sharding != "FULL_SHARD":
            config["sharding"] = plan.sharding
        if checkpoint:
            config["activation_checkpointing"] = list(checkpoint)
    elif plan.strategy == "deepspeed":
        if plan.offload is Offload.NVME:
            config["nvme_path"] = nvme_path  # the strategy's shorthand for both offload sections
        if checkpoint:
            config["checkpoint_modules"] = list(checkpoint)
    return config or None


def copy_button(text: str, label: str = "Copy") -> str:
    """A button that copies ``text``: a JSON string literal, HTML-escaped for the attribute."""
    script = html.escape(f"navigator.clipboard.writeText({json.dumps(text)})", quote=True)
    return f'<button class="jp-Button" onclick="{script}">{html.escape(label)}</button>'


@dataclass
class Choice:
    """The form's fields, checked: what the line says, and the notes on what was changed and why."""

    plan: est.Plan
    device: Device
    nproc: int
    precision: Precision
    checkpoint: tuple[str, ...]
    notes: list[str] = field(default_factory=list)


def check_fields(
    fields: Mapping[str, Any],
    gpu_count: int,
    model: ModelInfo,
    capabilities: Sequence[Capability | None] = (),
) -> Choice:
    """Turn field values into a choice that works, with a note for every change made.

    ``capabilities`` are the chosen GPUs' compute capabilities (None or missing: unknown, and then
    bf16 is left as chosen)."""
    notes: list[str] = []
    device, nproc = Device(str(fields["device"])), int(fields["nproc"])
    if device is Device.AUTO:
        device = Device.CUDA if gpu_count else Device.CPU
    if device is Device.CUDA and gpu_count == 0:
        notes.append(
            "No CUDA device is visible here, so --gpus would be refused: using CPU ranks (--device cpu)."
        )
        device = Device.CPU
    if device is Device.CUDA and nproc > gpu_count:
        notes.append(f"Only {gpu_count} GPU(s) are visible: the line asks for --gpus {gpu_count}.")
        nproc = gpu_count
    strategy, stage, offload = str(fields["strategy"]), int(fields["zero_stage"]), Offload(fields["offload"])
    if strategy != "deepspeed" and stage:
        notes.append(f"ZeRO stage {stage} applies only to --strategy deepspeed; ignored for {strategy}.")
        stage = 0
    problem = est.offload_problem(strategy, stage, offload)
    if problem:
        keep = offload is Offload.NVME and (strategy == "fsdp" or stage > 0)  # cpu offload still works
        offload = Offload.CPU if keep else Offload.NONE
        notes.append(f"{problem}; using --offload {offload.value}.")
    sharding = str(fields["sharding"]) if strategy == "fsdp" else "FULL_SHARD"
    if sharding == "HYBRID_SHARD":
        notes.append("On one node HYBRID_SHARD shards over all ranks, like FULL_SHARD.")
    plan = est.Plan(strategy, stage, sharding, offload)
    precision = Precision(fields["precision"])
    if device is Device.CUDA and precision is Precision.BF16_MIXED:
        precision = _without_bf16(capabilities[:nproc], notes)
    return Choice(plan, device, nproc, precision, _checkpoint(fields, plan, model, notes), notes)


def bf16_problem(capabilities: Sequence[Capability | None]) -> str:
    """Why bf16 does not suit these GPUs ("" if it does, or if their capability is unknown)."""
    old = [c for c in capabilities if c is not None and c < BF16_CAPABILITY]
    if not old:
        return ""
    shown = " and ".join(f"{major}.{minor}" for major, minor in sorted(set(old)))
    have = "has" if len(old) == 1 else "have"
    return (
        f"bf16 needs compute capability 8.0 (Ampere) or newer, and {len(old)} of the "
        f"{len(capabilities)} GPU(s) chosen {have} {shown}"
    )


def _without_bf16(capabilities: Sequence[Capability | None], notes: list[str]) -> Precision:
    problem = bf16_problem(capabilities)
    if not problem:
        return Precision.BF16_MIXED
    notes.append(f"{problem}: using --precision 16-mixed (fp16 with loss scaling) instead.")
    return Precision.FP16_MIXED


def _checkpoint(
    fields: Mapping[str, Any], plan: est.Plan, model: ModelInfo, notes: list[str]
) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n for n in re.split(r"[,\s]+", str(fields["checkpoint"])) if n))
    if names and plan.strategy == "ddp":
        notes.append(
            "ddp has no activation checkpointing option: choose fsdp or deepspeed, or call "
            "torch.utils.checkpoint in the model's forward."
        )
        return ()
    bad = [n for n in names if not n.isidentifier() or (model.classes and n not in model.classes)]
    if bad:
        known = f" (repeated blocks: {', '.join(model.blocks)})" if model.blocks else ""
        notes.append(f"No module class {', '.join(bad)} in the model{known}; left out of checkpointing.")
    return tuple(n for n in names if n not in bad)


def insert_line(send: Callable[[dict[str, Any]], None], line: str, done: Callable[[str], None]) -> None:
    """The form's "Insert cell": ask the JupyterLab extension for a new cell below holding ``line``."""
    send({"event": "insert-cell", "code": line})
    done("Asked JupyterLab to insert a new cell; without the extension, copy the line above.")


def use_line_as_default(set_default: Callable[[str], None], line: str, done: Callable[[str], None]) -> None:
    """The form's "Use as default": a bare ``%%distributed`` runs as ``line`` from now on."""
    try:
        set_default(line)
    except Exception as exc:  # the caller's error (a bad option) belongs in the form, not the log
        done(f"Could not set the default: {exc}")
        return
    done(f"Default set: a bare %%distributed now runs as {line}")
