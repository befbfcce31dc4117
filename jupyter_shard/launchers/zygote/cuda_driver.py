"""Whether this process initialised the CUDA driver, asked without initialising it.

A fork shares the CUDA driver's state with the child, which then fails at its first CUDA call; the
state exists from ``cuInit`` on. Mapping the driver library creates none: ``import torch`` maps
``libcuda.so`` on a GPU machine without initialising anything, so a process that merely has it
loaded may fork. To tell the two apart, every ``libcuda.so*`` mapped here (``/proc/self/maps``) is
asked ``cuDeviceGetCount``, through a handle opened with ``RTLD_NOLOAD`` so that asking never loads
the library: before ``cuInit`` the driver answers ``CUDA_ERROR_NOT_INITIALIZED`` and initialises
nothing; any other answer means ``cuInit`` ran. A mapped library that cannot be asked counts as
initialised: spawning a rank is slower, forking an initialised driver is broken.

Open GPU device files (``/dev/nvidiactl``, ``/dev/nvidia0``) are not a sign: NVML opens them
without ``cuInit`` (``nvmlInit``, torch's ``PYTORCH_NVML_BASED_CUDA_CHECK``, which torch documents
as safe to fork after), and ``cuInit`` itself goes through a mapped driver library, which is asked.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable

NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED: what every driver call but cuInit answers before it
MAPS = "/proc/self/maps"
_LIBRARY = re.compile(r"/libcuda\.so[.\d]*$")


def mapped_libraries(maps: str) -> list[str]:
    """The CUDA driver libraries (``libcuda.so*``) mapped, from the text of ``/proc/<pid>/maps``."""
    paths = (line.split(maxsplit=5)[5] for line in maps.splitlines() if len(line.split(maxsplit=5)) == 6)
    return sorted({p.strip() for p in paths if _LIBRARY.search(p.strip())})


def ask(library: str) -> int | str:
    """The ``CUresult`` of ``cuDeviceGetCount`` from ``library``, already loaded in this process;
    why it could not be asked (a string) when it is not loaded or has no such function."""
    try:
        driver = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        device_count = driver.cuDeviceGetCount
    except (OSError, AttributeError) as exc:
        return str(exc) or type(exc).__name__
    device_count.argtypes = [ctypes.POINTER(ctypes.c_int)]
    device_count.restype = ctypes.c_int
    count = ctypes.c_int(0)
    return int(device_count(ctypes.byref(count)))


def initialised(maps_path: str = MAPS, answer: Callable[[str], int | str] = ask) -> str:
    """Why this process holds CUDA driver state: which mapped driver libraries answer that ``cuInit``
    ran, or could not be asked ("" when none is mapped, or every one is uninitialised)."""
    try:
        with open(maps_path) as maps:
            libraries = mapped_libraries(maps.read())
    except OSError:
        libraries = []
    held = (_state(library, answer(library)) for library in libraries)
    return "; ".join(h for h in held if h)


def _state(library: str, result: int | str) -> str:
    if isinstance(result, str):
        return f"{library} is loaded and cannot be asked whether cuInit ran: {result}"
    if result != NOT_INITIALIZED:
        return f"cuInit ran in {library}: cuDeviceGetCount answers {result}, not {NOT_INITIALIZED}"
    return ""
