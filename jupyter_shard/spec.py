"""What a pool should be: validated launch options shared by the magics and the Python API.

Everything a user types in a ``%%distributed`` line becomes a :class:`LaunchSpec` here, and every
mistake becomes one :class:`SpecError` line that says what is wrong and what is allowed. Nothing in
this module starts a process or imports torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from jupyter_shard._util.plugins import entry_point_map
from jupyter_shard.errors import SpecError
from jupyter_shard.gpus import (
    check_visible,
    format_gpus,
    gpu_option_text,
    parse_gpu_option,
    rank_visible_devices,
    visible_devices,
)
from jupyter_shard.strategies import available_strategies

__all__ = [
    "Device",
    "LaunchSpec",
    "LauncherOptions",
    "Offload",
    "Precision",
    "SpecError",
    "Strategy",
    "format_ranks",
    "parse_ranks",
    "visible_gpus",
]

LAUNCHER_GROUP = "jupyter_shard.launchers"  # the entry-point group of launchers a site installs
BUILTIN_LAUNCHERS = ("local", "torchrun", "slurm")  # the launcher registry's built-ins, by name
UNKNOWN_LAUNCHER = "--launcher {name!r} is not installed; available: {available}"  # the registry's error
DEFAULT_TIMEOUT = 60.0
MAX_RANKS = 1 << 16


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Strategy(str, Enum):
    NONE = "none"
    DDP = "ddp"
    FSDP = "fsdp"
    DEEPSPEED = "deepspeed"


class Offload(str, Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class Precision(str, Enum):
    FP32 = "32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"


def _choice(enum: type[Enum], value: str, option: str) -> Enum:
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in enum)
        raise SpecError(f"{option} {value!r} is not valid; choose one of: {allowed}") from None


def _strategy_name(name: str) -> str:
    """A built-in strategy, one installed through an entry point, or one registered in this process."""
    builtin = [s.value for s in Strategy]
    names = builtin + [n for n in available_strategies() if n not in builtin]
    if name not in names:
        raise SpecError(f"--strategy {name!r} is not valid; choose one of: {', '.join(names)}")
    return name


RUNTIME_LAUNCHERS: set[str] = set()
"""Launchers registered in this process only (``--launcher simulated`` in tests and benchmarks)."""


def launcher_names() -> list[str]:
    """The built-in launchers, those installed through entry points (read, not imported), and those
    registered in this process."""
    return sorted({*BUILTIN_LAUNCHERS, *entry_point_map(LAUNCHER_GROUP), *RUNTIME_LAUNCHERS})


def _launcher_name(name: str) -> str:
    names = launcher_names()
    if name not in names:
        raise SpecError(UNKNOWN_LAUNCHER.format(name=name, available=", ".join(names)))
    return name


def visible_gpus() -> int:
    """How many CUDA devices the kernel sees (its ``CUDA_VISIBLE_DEVICES`` honoured), without
    importing torch or creating a CUDA context; see :func:`jupyter_shard.gpus.visible_devices`."""
    return len(visible_devices())


_RANK_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_ranks(text: str, world_size: int | None = None) -> tuple[int, ...]:
    """Parse ``0``, ``0,2`` or ``1-3`` into sorted unique ranks, checked against ``world_size``."""
    spans: list[tuple[int, int]] = []
    for item in text.replace(" ", "").split(","):
        match = _RANK_ITEM.match(item)
        if not match:
            raise SpecError(f"rank list {text!r} is not valid; write ranks like 0, 0,2 or 1-3")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise SpecError(f"rank range {item!r} runs backwards; write it as {hi}-{lo}")
        spans.append((lo, hi))
    limit = world_size if world_size is not None else MAX_RANKS
    outside = [max(lo, limit) for lo, hi in spans if hi >= limit]
    if outside:
        raise SpecError(f"rank {min(outside)} does not exist: the pool has {limit} ranks (0-{limit - 1})")
    return tuple(sorted({rank for lo, hi in spans for rank in range(lo, hi + 1)}))


def format_ranks(ranks: Sequence[int]) -> str:
    """The inverse of :func:`parse_ranks`: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class LauncherOptions:
    """The options one launcher owns; this base is the local launcher's (it has none).

    A launcher declares a frozen subclass (``--hosts``, ``--partition``...) and builds it from what
    the user gave (:meth:`~jupyter_shard.launchers.base.Launcher.parse_options`); a spec carries it
    as one value. A field's metadata may name the option as typed (``option``) and a hint shown
    when the option is given to another launcher (``hint``).
    """

    def check(self, nodes: int) -> None:
        """Refuse options that disagree with the node count (run as every spec is built)."""

    def items(self) -> list[tuple[str, object]]:
        """``(field name, value)`` of every option, for messages."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


@dataclass(frozen=True)
class LaunchSpec:
    """The shape of a pool: the ranks, their device, the strategy and how they are launched."""

    nproc: int = 2
    device: Device = Device.CPU
    strategy: str = Strategy.NONE.value
    zero_stage: int | None = None
    offload: Offload = Offload.NONE
    precision: Precision = Precision.FP32
    launcher: str = "local"
    nodes: int = 1
    timeout: float = DEFAULT_TIMEOUT
    config: Path | None = None
    accumulate: int = 1
    clip_grad_norm: float | None = None
    env: tuple[tuple[str, str], ...] = field(default=())
    launcher_options: LauncherOptions = field(default_factory=LauncherOptions)
    gpus: tuple[int, ...] | None = None
    """The devices chosen with ``--gpus 0,2``, numbered as the kernel sees them; None: the first
    ``nproc`` (a CUDA pool: ``--gpus 0,1`` is ``--gpus 2``) or none (a CPU pool)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise SpecError(f"--nproc {self.nproc} is not valid; a pool needs at least 1 rank")
        if self.nodes < 1:
            raise SpecError(f"--nodes {self.nodes} is not valid; use 1 or more")
        if self.zero_stage is not None and not 0 <= self.zero_stage <= 3:
            raise SpecError(f"--zero-stage {self.zero_stage} is not valid; choose 0, 1, 2 or 3")
        if not math.isfinite(self.timeout) or self.timeout <= 0:
            raise SpecError(f"--collective-timeout {self.timeout:g} is not valid; give seconds above 0")
        if self.accumulate < 1:
            raise SpecError(
                f"--accumulate {self.accumulate} is not valid; use 1 or more micro-steps per step"
            )
        if self.clip_grad_norm is not None and not (
            math.isfinite(self.clip_grad_norm) and self.clip_grad_norm > 0
        ):
            raise SpecError(f"--clip-grad-norm {self.clip_grad_norm:g} is not valid; give a norm above 0")
        if self.device is Device.AUTO:
            raise SpecError("resolve device 'auto' with LaunchSpec.create before building a spec")
        if self.gpus is not None and (
            self.device is not Device.CUDA
            or len(self.gpus) != self.nproc
            or len(set(self.gpus)) != len(self.gpus)
            or min(self.gpus, default=-1) < 0
        ):
            raise SpecError(
                f"GPUs {self.gpus} do not fit {self.nproc} {self.device.value} rank(s); "
                "give one distinct device per CUDA rank (--gpus 0,2)"
            )
        self.launcher_options.check(self.nodes)

    @property
    def world_size(self) -> int:
        """Ranks in all: ``nproc`` per node on each of ``nodes``."""
        return self.nproc * self.nodes

    @property
    def multi_node(self) -> bool:
        """Whether ranks dial back over TCP (a launcher other than ``local``)."""
        return self.launcher != "local"

    @property
    def devices(self) -> tuple[int, ...]:
        """The GPUs of this machine the local ranks use, numbered as the kernel sees them (rank k
        gets the k-th); empty for CPU ranks and for ranks that a node agent places."""
        if self.device is not Device.CUDA or self.multi_node:
            return ()
        return self.gpus if self.gpus is not None else tuple(range(self.nproc))

    def rank_visible_devices(self, kernel_value: str | None) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` for the local ranks: the chosen devices' physical ids, mapped
        through the kernel's own ``kernel_value``, so rank k's ``cuda:k`` is the k-th chosen device;
        None where the ranks keep what they inherit (CPU ranks, ranks a node agent places)."""
        return rank_visible_devices(self.devices, kernel_value) if self.devices else None

    @classmethod
    def create(
        cls,
        nproc: int | None = None,
        gpus: int | str | Sequence[int] | None = None,
        device: str | Device = Device.AUTO,
        strategy: str | Strategy = Strategy.NONE,
        zero_stage: int | None = None,
        offload: str | Offload = Offload.NONE,
        precision: str | Precision = Precision.FP32,
        launcher: str = "local",
        nodes: int = 1,
        timeout: float = DEFAULT_TIMEOUT,
        config: str | Path | None = None,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        gpu_count: int | None = None,
        launcher_options: LauncherOptions | None = None,
    ) -> LaunchSpec:
        """Resolve user options (``auto`` device, default rank count) into a checked spec.

        ``nproc`` and ``gpus`` count ranks per node; ``gpus`` is a count (``4``) or this machine's
        devices, numbered as the kernel sees them (``"0,2"``, ``(0, 2)``). ``nodes`` > 1 needs the
        torchrun or slurm launcher. On those, ranks may run elsewhere, so a GPU count is not checked
        against this machine's devices, and a device list is refused. A launcher's own options
        (``--hosts``, ``--partition``...) come parsed, as ``launcher_options``:
        :func:`jupyter_shard.launchers.resolve_spec` takes them as typed.
        """
        if nodes < 1:
            raise SpecError(f"--nodes {nodes} is not valid; use 1 or more")
        if nodes > 1 and launcher == "local":
            raise SpecError(
                f"--nodes {nodes} needs --launcher torchrun or slurm; the local launcher runs on this machine"
            )
        remote = launcher != "local"
        selection = parse_gpu_option(gpus, launcher) if gpus is not None else None
        count = len(selection) if isinstance(selection, tuple) else selection
        shown = gpu_option_text(selection) if selection is not None else ""
        available = visible_gpus() if gpu_count is None else gpu_count
        if remote and count is not None:
            available = max(available, count)  # the nodes' GPUs, not this machine's
        dev = Device(_choice(Device, str(getattr(device, "value", device)), "--device"))
        strat = _strategy_name(str(getattr(strategy, "value", strategy)))
        off = Offload(_choice(Offload, str(getattr(offload, "value", offload)), "--offload"))
        prec = Precision(_choice(Precision, str(getattr(precision, "value", precision)), "--precision"))
        if remote and dev is Device.CUDA and nproc is not None:
            available = max(available, nproc)
        if count is not None:
            if nproc is not None and nproc != count:
                raise SpecError(f"--gpus {shown} and --nproc {nproc} disagree; give only one of them")
            if dev is Device.CPU:
                raise SpecError(f"--gpus {shown} needs CUDA but --device is cpu; use --nproc {count}")
            if count < 1:
                raise SpecError(f"--gpus {count} is not valid; use 1 or more")
            if available and isinstance(selection, tuple):
                check_visible(selection, available)
            if count > available:
                raise SpecError(
                    f"--gpus {shown} asked for, but {available} CUDA device(s) are visible; "
                    f"run `--nproc {count} --device cpu` for CPU ranks"
                )
            dev, nproc = Device.CUDA, count
        if dev is Device.AUTO:
            dev = Device.CUDA if available > 0 else Device.CPU
        if dev is Device.CUDA and available == 0:
            raise SpecError(
                "--device cuda asked for, but no CUDA device is visible; "
                "use --device cpu (or auto) for CPU ranks"
            )
        if nproc is None:
            nproc = available if dev is Device.CUDA else 2
        if dev is Device.CUDA and nproc > available:
            raise SpecError(
                f"--nproc {nproc} CUDA ranks need {nproc} GPUs but {available} are visible; "
                f"use --nproc {available} or --device cpu"
            )
        _launcher_name(launcher)
        if zero_stage is not None and strat != Strategy.DEEPSPEED.value:
            raise SpecError("--zero-stage applies only to --strategy deepspeed")
        path = Path(config).expanduser() if config is not None else None
        if path is not None and not path.is_file():
            raise SpecError(f"--config {str(config)!r} does not exist; give a path to a JSON file")
        return cls(
            nproc=nproc,
            device=dev,
            strategy=strat,
            zero_stage=zero_stage,
            offload=off,
            precision=prec,
            launcher=launcher,
            nodes=nodes,
            timeout=timeout,
            config=path,
            accumulate=accumulate,
            clip_grad_norm=clip_grad_norm,
            launcher_options=launcher_options or LauncherOptions(),
            gpus=selection if isinstance(selection, tuple) and selection != tuple(range(nproc)) else None,
        )

    def merged(self, changes: Mapping[str, object]) -> LaunchSpec:
        """The one rule for options across cells: what ``changes`` names changes, every field keeps
        its value otherwise.

        ``changes`` uses the keyword names of :meth:`create`. Three options decide others with
        them, as they would in a first cell: ``gpus`` or ``device`` picks the rank count anew
        (unless ``nproc`` is named too) and ``gpus`` the device; another launcher starts from its
        own defaults for ``nodes`` and its options; another strategy drops a ``zero_stage`` that
        the cell does not name. A device list (``--gpus 0,2``) is kept until a cell names ``gpus``,
        ``nproc``, ``device`` or another launcher: then the devices are chosen anew. A launcher's
        options change as one value (``launcher_options``): :func:`jupyter_shard.launchers.merge_spec`
        merges them option by option.
        """
        unknown = sorted(set(changes) - set(_CREATE_OPTIONS))
        if unknown:
            raise SpecError(f"{unknown[0]!r} is not a pool option; give one of: {', '.join(_CREATE_OPTIONS)}")
        if not changes:
            return self
        kept: dict[str, Any] = {name: getattr(self, name) for name in _KEPT_FIELDS}
        if "gpus" in changes or "device" in changes:
            kept.pop("nproc")
        if "gpus" in changes:
            kept.pop("device")
        if changes.keys() & {"gpus", "nproc", "device"}:
            kept.pop("gpus")
        if changes.get("launcher", self.launcher) != self.launcher:
            for name in ("nodes", "launcher_options", "gpus"):
                kept.pop(name, None)
        if changes.get("strategy", self.strategy) != self.strategy and "zero_stage" not in changes:
            kept.pop("zero_stage")
        fresh = LaunchSpec.create(**{**kept, **changes})
        return replace(fresh, env=self.env)

    def with_changes(self, **changes: object) -> LaunchSpec:
        """These fields replaced as they are, without :meth:`create`'s resolving (tests, internal use)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def rank_options(self) -> dict[str, Any]:
        """What every rank's ``shard`` needs to build the strategy (travels as JSON)."""
        return {
            "precision": self.precision.value,
            "accumulate": self.accumulate,
            "clip_grad_norm": self.clip_grad_norm,
            "zero_stage": self.zero_stage,
            "offload": self.offload.value,
            "config": str(self.config) if self.config is not None else None,
        }

    def describe(self) -> str:
        """``2 CPU ranks · ddp``, ``2 GPU ranks (GPUs 0,2) · fsdp``, ``2 nodes × 4 GPU ranks (torchrun) ·
        ddp``: the local GPUs are listed, as the kernel numbers them."""
        kind = "GPU" if self.device is Device.CUDA else "CPU"
        ranks = f"{self.nproc} {kind} rank{'s' if self.nproc != 1 else ''}"
        if self.launcher == "local":
            devices = self.devices
            where = f" (GPU{'s' if len(devices) != 1 else ''} {format_gpus(devices)})" if devices else ""
            return f"{ranks}{where} · {self.strategy}"
        nodes = f"{self.nodes} node{'s' if self.nodes != 1 else ''}"
        return f"{nodes} × {ranks} ({self.launcher}) · {self.strategy}"


# Fields that :meth:`LaunchSpec.create` takes under the same name; ``env`` is carried over as it is.
_KEPT_FIELDS = (
    "nproc",
    "device",
    "strategy",
    "zero_stage",
    "offload",
    "precision",
    "launcher",
    "nodes",
    "timeout",
    "config",
    "accumulate",
    "clip_grad_norm",
    "launcher_options",
    "gpus",
)
_CREATE_OPTIONS = (*_KEPT_FIELDS, "gpu_count")
