"""jupyter_shard.launchers.zygote.cuda_driver: the zygote's check that
forking is safe (no CUDA driver state: ``cuInit`` has not run, though ``libcuda`` may be mapped)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from jupyter_shard.launchers.zygote import cuda_driver

# -- the no-CUDA guard ------------------------------------------------------------------------------------

# /proc/<pid>/maps of a process that imported a CUDA build of torch on a GPU machine: the driver
# library (twice: native and WSL2's) and its UVM mapping, torch's CUDA library and the runtime.
CUDA_MAPS = """\
55d0c3a00000-55d0c3a2e000 r--p 00000000 08:01 1048602  /usr/bin/python3.11
7f1b2c000000-7f1b2c021000 rw-p 00000000 00:00 0
7f1b30000000-7f1b30200000 ---p 00000000 00:00 0
7f1b3a000000-7f1b3a400000 rw-s 00000000 00:05 4221  /dev/nvidia-uvm
7f1b41200000-7f1b41a5c000 r--p 00000000 08:01 2363031  /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1b41a5c000-7f1b42d33000 r-xp 0085c000 08:01 2363031  /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1b43000000-7f1b43100000 r-xp 00000000 08:01 2363044  /usr/lib/wsl/lib/libcuda.so.1.1
7f1b44000000-7f1b44100000 r-xp 00000000 08:01 2363050  /opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12
7f1b45000000-7f1b45100000 r-xp 00000000 08:01 2363051  /opt/venv/torch/lib/libtorch_cuda.so
7ffd8e3f1000-7ffd8e412000 rw-p 00000000 00:00 0  [stack]
"""
NATIVE, WSL = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", "/usr/lib/wsl/lib/libcuda.so.1.1"

# A process with no driver library mapped (a CPU build of torch, or no driver installed).
NO_DRIVER_MAPS = "\n".join(line for line in CUDA_MAPS.splitlines() if "libcuda.so" not in line)

# A C shared library that answers as the CUDA driver does: CUDA_ERROR_NOT_INITIALIZED (3) to
# cuDeviceGetCount until cuInit has run, then success (0).
FAKE_DRIVER_C = """\
static int initialised;
int cuInit(unsigned int flags) { (void)flags; initialised = 1; return 0; }
int cuDeviceGetCount(int *count) { if (!initialised) return 3; *count = 1; return 0; }
"""


def fake_driver(folder: Path) -> Path:
    """``folder/libcuda.so.1``, built from :data:`FAKE_DRIVER_C` (the test is skipped without gcc)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is missing: the fake CUDA driver library (a C shared object) cannot be built")
    folder.mkdir(parents=True, exist_ok=True)
    source, library = folder / "fake_cuda.c", folder / "libcuda.so.1"
    source.write_text(FAKE_DRIVER_C)
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-o", str(library), str(source)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return library.resolve()  # as /proc/self/maps names it


def _maps(tmp_path: Path, text: str) -> str:
    maps = tmp_path / "maps"
    maps.write_text(text)
    return str(maps)


def test_cuda_driver_library_is_found_in_proc_maps() -> None:
    assert cuda_driver.mapped_libraries(CUDA_MAPS) == [WSL, NATIVE]
    assert cuda_driver.mapped_libraries(NO_DRIVER_MAPS) == []
    assert cuda_driver.mapped_libraries("") == []


def test_no_driver_library_mapped_is_safe_to_fork(tmp_path: Path) -> None:
    def never(library: str) -> int | str:
        raise AssertionError(f"{library} asked, though not mapped")

    assert cuda_driver.initialised(_maps(tmp_path, NO_DRIVER_MAPS), never) == ""
    assert cuda_driver.initialised(str(tmp_path / "missing"), never) == ""


def test_a_mapped_driver_is_safe_to_fork_until_cuinit_ran(tmp_path: Path) -> None:
    maps = _maps(tmp_path, CUDA_MAPS)
    answers: dict[str, int | str] = {NATIVE: 3, WSL: 3}
    assert cuda_driver.initialised(maps, answers.__getitem__) == ""  # mapped by import torch, no cuInit
    answers[NATIVE] = 0
    assert cuda_driver.initialised(maps, answers.__getitem__) == (
        f"cuInit ran in {NATIVE}: cuDeviceGetCount answers 0, not 3"
    )
    answers[NATIVE] = 100  # CUDA_ERROR_NO_DEVICE: cuInit ran, and failed; its state is there all the same
    answers[WSL] = "undefined symbol: cuDeviceGetCount"  # when in doubt, spawn
    assert cuda_driver.initialised(maps, answers.__getitem__) == (
        f"{WSL} is loaded and cannot be asked whether cuInit ran: undefined symbol: cuDeviceGetCount; "
        f"cuInit ran in {NATIVE}: cuDeviceGetCount answers 100, not 3"
    )


def test_asking_never_loads_the_driver(tmp_path: Path) -> None:
    fake = fake_driver(tmp_path / "lib")
    assert isinstance(cuda_driver.ask(str(fake)), str)  # not loaded here: not asked
    assert str(fake) not in cuda_driver.mapped_libraries(Path("/proc/self/maps").read_text())
