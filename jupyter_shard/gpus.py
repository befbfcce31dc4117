"""Which GPUs the notebook kernel can see, and which ones a pool's ranks get, without importing CUDA.

The kernel must never create a CUDA context (it holds GPU memory, and CUDA does not survive a fork),
so every GPU fact here comes from the environment, ``/dev`` and ``nvidia-smi`` run as a separate
process. ``CUDA_VISIBLE_DEVICES`` is read the way CUDA (and torch's own parser) reads it: indices or
``GPU-``/``MIG-`` UUIDs, the list ending at the first invalid entry, a repeated entry hiding every
device. A pool's choice (``--gpus 0,2``) is numbered as the kernel sees its devices; the ranks get
the matching physical ids in their own ``CUDA_VISIBLE_DEVICES``, so rank k's ``cuda:k`` is the k-th
chosen device and two notebooks on one node can use disjoint GPUs.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from jupyter_shard.errors import SpecError

__all__ = [
    "check_visible",
    "format_gpus",
    "gpu_option_text",
    "nvidia_smi",
    "parse_cuda_visible_devices",
    "parse_gpu_option",
    "physical_gpu_count",
    "rank_visible_devices",
    "visible_devices",
]

VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
WSL_NVIDIA_SMI = "/usr/lib/wsl/lib/nvidia-smi"  # WSL2: GPUs are behind /dev/dxg, not /dev/nvidiaN
GPU_OPTION_HINT = (
    "give a count (--gpus 4) or the devices to use, numbered as this kernel sees them "
    "(--gpus 0,2 or --gpus 4-7; one device: --gpus 3,)"
)
_DEVICE_NODE = re.compile(r"nvidia\d+")
_ORDINAL = re.compile(r"[+-]?\d+")
_GPU_ITEM = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cuda_visible_devices(value: str) -> list[str]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names, as CUDA reads it (torch's
    ``_parse_visible_devices`` is the reference): ``"1gpu2,2"`` is ``["1", "2"]`` (a number's
    leading digits count), ``"0,-1,1"`` is ``["0"]`` (an invalid entry ends the list), ``"0,0"`` is
    ``[]`` (a repeat hides every device); a list that starts with ``GPU-`` or ``MIG-`` is UUIDs."""
    for prefix in ("GPU-", "MIG-"):
        if value.startswith(prefix):
            uuids: list[str] = []
            for entry in value.split(","):
                if entry in uuids:
                    return []
                if not entry.startswith(prefix):
                    break
                uuids.append(entry)
            return uuids
    ordinals: list[int] = []
    for entry in value.split(","):
        match = _ORDINAL.match(entry.strip())
        number = int(match.group()) if match else -1
        if number in ordinals:
            return []
        if number < 0:
            break
        ordinals.append(number)
    return [str(n) for n in ordinals]


def nvidia_smi(*args: str, timeout: float = 5.0) -> str | None:
    """``nvidia-smi`` run with ``args`` as a separate process (found on PATH, or where WSL2 keeps
    it); its output, or None when it is missing, fails or hangs."""
    exe = shutil.which("nvidia-smi") or (WSL_NVIDIA_SMI if os.path.isfile(WSL_NVIDIA_SMI) else None)
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def physical_gpu_count() -> int:
    """GPUs on this machine: ``/dev/nvidia<N>`` nodes; where there are none but ``/dev/dxg`` is
    there (WSL2), the GPUs ``nvidia-smi`` lists. Never spawns anything on a machine without either."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return 0
    nodes = sum(1 for n in names if _DEVICE_NODE.fullmatch(n))
    if nodes or "dxg" not in names:
        return nodes
    return _listed_gpus()


@functools.cache
def _listed_gpus() -> int:
    """How many GPUs ``nvidia-smi`` lists (asked once per process: it takes a good fraction of a second)."""
    text = nvidia_smi("--query-gpu=uuid", "--format=csv,noheader")
    return sum(1 for line in (text or "").splitlines() if line.strip().startswith(("GPU-", "MIG-")))


def visible_devices(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The devices a CUDA process started with ``environ`` (default: the kernel's) would see, in
    CUDA's order, each as ``CUDA_VISIBLE_DEVICES`` names it (``"3"``, ``"GPU-8a1c..."``)."""
    value = (os.environ if environ is None else environ).get(VISIBLE_VAR)
    physical = physical_gpu_count()
    if value is None:
        return tuple(str(i) for i in range(physical))
    entries = parse_cuda_visible_devices(value)
    for i, entry in enumerate(entries):
        if entry.isdigit() and int(entry) >= physical:  # CUDA stops at a device that does not exist
            entries = entries[:i]
            break
    return tuple(entries[:physical])


def parse_gpu_option(value: int | str | Sequence[int], launcher: str = "local") -> int | tuple[int, ...]:
    """``--gpus``: a count (``4``) or devices as the kernel numbers them (``"0,2"``, ``"4-7"``,
    ``"3,"`` for one device, or a sequence from the Python API), kept in the order given. A list
    is this machine's devices, so only the local launcher takes one: node agents (torchrun, SLURM)
    place ranks on their own node's GPUs."""
    selection = _parse_gpus(value)
    if isinstance(selection, tuple) and launcher != "local":
        raise SpecError(
            f"--gpus {gpu_option_text(selection)} chooses this machine's devices, but --launcher "
            f"{launcher} places ranks on each node's own GPUs; give a count (--gpus {len(selection)}) "
            f"and set {VISIBLE_VAR} on the nodes to choose devices there"
        )
    return selection


def gpu_option_text(selection: int | tuple[int, ...]) -> str:
    """How ``--gpus`` is typed for ``selection``: ``4``, ``0,2``, ``4-7``, ``3,``."""
    if isinstance(selection, int):
        return str(selection)
    return format_gpus(selection) + ("," if len(selection) == 1 else "")


def check_visible(selection: tuple[int, ...], available: int) -> None:
    """Refuse a device list that names a device the kernel does not see, saying which it sees."""
    hidden = [d for d in selection if d >= available]
    if not hidden:
        return
    cvd = os.environ.get(VISIBLE_VAR)
    numbered = f" ({VISIBLE_VAR}={cvd} numbers them from 0)" if cvd is not None else ""
    fitting = tuple(range(min(len(selection), available)))
    raise SpecError(
        f"--gpus {gpu_option_text(selection)}: GPU {hidden[0]} is not visible; this kernel sees "
        f"{available} GPU(s), numbered 0-{available - 1}{numbered}; choose among them "
        f"(--gpus {gpu_option_text(fitting)})"
    )


def _parse_gpus(value: int | str | Sequence[int]) -> int | tuple[int, ...]:
    if isinstance(value, bool):
        raise SpecError(f"--gpus {value!r} is not valid; {GPU_OPTION_HINT}")
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        devices = tuple(int(d) for d in value)
        shown = gpu_option_text(devices)
    else:
        shown = value.replace(" ", "")
        if shown.isdigit():
            return int(shown)
        items = shown.removesuffix(",").split(",")
        spans = [_GPU_ITEM.fullmatch(item) for item in items]
        if not shown or not all(spans):
            raise SpecError(f"--gpus {value!r} is not valid; {GPU_OPTION_HINT}")
        devices = ()
        for span in spans:
            assert span is not None
            lo, hi = int(span.group(1)), int(span.group(2) or span.group(1))
            if hi < lo:
                raise SpecError(
                    f"--gpus {value!r}: the range {lo}-{hi} runs backwards; write it as {hi}-{lo}"
                )
            devices += tuple(range(lo, hi + 1))
    repeated = sorted({d for d in devices if devices.count(d) > 1})
    if repeated:
        raise SpecError(f"--gpus {shown} names device {repeated[0]} twice; give each device once")
    if not devices or min(devices) < 0:
        raise SpecError(f"--gpus {shown!r} is not valid; {GPU_OPTION_HINT}")
    return devices


def format_gpus(devices: Sequence[int]) -> str:
    """``(0, 1, 2, 3)`` -> ``0-3``, ``(2, 0)`` -> ``2,0``: the order kept, ascending runs joined."""
    parts: list[str] = []
    i = 0
    while i < len(devices):
        j = i
        while j + 1 < len(devices) and devices[j + 1] == devices[j] + 1:
            j += 1
        parts.append(str(devices[i]) if i == j else f"{devices[i]}-{devices[j]}")
        i = j + 1
    return ",".join(parts)


def rank_visible_devices(chosen: Sequence[int], kernel_value: str | None) -> str:
    """The ranks' ``CUDA_VISIBLE_DEVICES``: the ``chosen`` devices (numbered as the kernel sees
    them) by their physical ids, through the kernel's own ``CUDA_VISIBLE_DEVICES`` if it has one."""
    if kernel_value is None:
        return ",".join(str(d) for d in chosen)
    entries = parse_cuda_visible_devices(kernel_value)
    missing = [d for d in chosen if d >= len(entries)]
    if missing:
        raise SpecError(
            f"GPU {missing[0]} is not visible: {VISIBLE_VAR}={kernel_value} gives this kernel "
            f"{len(entries)} device(s); choose from 0-{len(entries) - 1} with --gpus"
            if entries
            else f"GPU {missing[0]} is not visible: {VISIBLE_VAR}={kernel_value!r} hides every device"
        )
    return ",".join(entries[d] for d in chosen)
