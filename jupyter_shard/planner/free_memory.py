"""How much memory is free for each rank, and what the GPUs can do, found without importing CUDA
in the notebook kernel.

Why it exists: the picker compares each strategy's per-rank memory with what is free, but the kernel
must never create a CUDA context (it would hold GPU memory and break forked tools). Sources, in order:
a running pool's ranks report ``cuda_free``/``cuda_total``; else ``nvidia-smi`` runs as a separate
process; host RAM (CPU ranks, CPU offload) comes from ``psutil``. Each GPU's compute capability
(bf16 needs 8.0, Ampere) comes from ``nvidia-smi`` too. Every source can be replaced in tests.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import psutil

from jupyter_shard.gpus import nvidia_smi
from jupyter_shard.spec import Device

Capability = tuple[int, int]  # (major, minor): 8.0 is (8, 0)
_Row = TypeVar("_Row")
_CAPABILITY = re.compile(r"(\d+)\.(\d+)")

if TYPE_CHECKING:
    from jupyter_shard.pool.ranks import RankSnapshot


class StatusSource(Protocol):
    def status(self) -> Sequence[RankSnapshot]: ...


@dataclass(frozen=True)
class MemorySnapshot:
    """Free memory as seen now: (free, total) bytes per GPU in rank order, and available host RAM;
    each visible GPU's compute capability (None where unknown)."""

    gpus: tuple[tuple[int, int], ...] = ()
    host_available: int | None = None
    gpu_source: str = ""  # "the running pool" or "nvidia-smi"
    capabilities: tuple[Capability | None, ...] = ()

    def capabilities_of(self, devices: Sequence[int]) -> tuple[Capability | None, ...]:
        """The compute capability of each of ``devices`` (numbered as the kernel sees them)."""
        known = self.capabilities
        return tuple(known[d] if d < len(known) else None for d in devices)

    def free_for(self, device: Device, nproc: int) -> FreeMemory | None:
        """What each of ``nproc`` ranks on ``device`` may use; None when it is unknown."""
        if device is Device.CUDA:
            if not self.gpus:
                return None
            free = min(f for f, _ in (self.gpus[:nproc] or self.gpus))
            return FreeMemory(device, free, self.host_available, self.gpu_source)
        if self.host_available is None:
            return None  # CPU ranks all share the host's RAM
        return FreeMemory(device, self.host_available // nproc, self.host_available, "psutil")


@dataclass(frozen=True)
class FreeMemory:
    device: Device
    per_rank: int  # bytes on each rank's device (CPU ranks: available host RAM / ranks)
    host: int | None  # host RAM available to all ranks together (for CPU offload)
    source: str


def parse_nvidia_smi(text: str, visible: str | None = None) -> tuple[tuple[int, int], ...]:
    """``memory.free, memory.total`` lines in MiB -> (free, total) bytes; ``visible`` is
    CUDA_VISIBLE_DEVICES (indices keep those GPUs in that order; UUIDs keep all)."""
    gpus: list[tuple[int, int]] = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and all(f.isdigit() for f in fields):
            gpus.append((int(fields[0]) << 20, int(fields[1]) << 20))
    return _visible(gpus, visible)


def parse_compute_caps(text: str, visible: str | None = None) -> tuple[Capability | None, ...]:
    """``compute_cap`` lines (``8.0``, ``7.5``; ``[N/A]`` is None) -> (major, minor) per GPU, the GPUs
    that ``visible`` (CUDA_VISIBLE_DEVICES) keeps, in its order."""
    caps: list[Capability | None] = []
    for line in (raw.strip() for raw in text.splitlines()):
        if line:
            match = _CAPABILITY.fullmatch(line)
            caps.append((int(match.group(1)), int(match.group(2))) if match else None)
    return _visible(caps, visible)


def _visible(rows: list[_Row], visible: str | None) -> tuple[_Row, ...]:
    """nvidia-smi's rows (every GPU of the machine) as the kernel sees them: CUDA_VISIBLE_DEVICES
    indices keep those GPUs in that order; UUIDs keep all."""
    indices = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if visible is not None and all(i.isdigit() for i in indices):
        return tuple(rows[int(i)] for i in indices if int(i) < len(rows))
    return tuple(rows)


def run_nvidia_smi(timeout: float = 5.0) -> str | None:
    """nvidia-smi's free/total memory query (a separate process: the kernel never imports CUDA)."""
    query = ("--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits")
    return nvidia_smi(*query, timeout=timeout)


def run_compute_caps(timeout: float = 5.0) -> str | None:
    """nvidia-smi's compute capability query (``8.0`` per line; drivers before 510 refuse it: None)."""
    return nvidia_smi("--query-gpu=compute_cap", "--format=csv,noheader", timeout=timeout)


def host_available() -> int | None:
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return None


def probe_memory(
    pool: StatusSource | None = None,
    smi: Callable[[], str | None] = run_nvidia_smi,
    host: Callable[[], int | None] = host_available,
    caps: Callable[[], str | None] = run_compute_caps,
) -> MemorySnapshot:
    """GPU memory from a running pool's ranks, else from nvidia-smi; host RAM from psutil; compute
    capabilities from nvidia-smi (asked only where there are GPUs)."""
    gpus: tuple[tuple[int, int], ...] = ()
    source = ""
    if pool is not None:
        try:
            rows = sorted(pool.status(), key=lambda r: r.rank)
        except Exception:  # a dead or stopping pool: fall back to the other sources
            rows = []
        gpus = tuple((r.memory["cuda_free"], r.memory["cuda_total"]) for r in rows if "cuda_free" in r.memory)
        source = "the running pool" if gpus else ""
    if not gpus:
        text = smi()
        gpus = parse_nvidia_smi(text, os.environ.get("CUDA_VISIBLE_DEVICES")) if text else ()
        source = "nvidia-smi" if gpus else ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    cap_text = caps() if gpus else None
    capabilities = parse_compute_caps(cap_text, visible) if cap_text else ()
    return MemorySnapshot(gpus, host(), source, capabilities)
