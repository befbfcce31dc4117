"""jupyter_shard.launchers.zygote.server: its check that forking is safe (no CUDA driver state:
``cuInit`` has not run, though ``libcuda`` may be mapped) after the zygote's imports."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_shard.launchers.zygote.server import cuda_driver_state
from tests.unit.launchers.zygote.test_cuda_driver import fake_driver


def test_this_process_holds_no_cuda_driver_state() -> None:
    assert cuda_driver_state() == ""  # no GPU here: the check must pass (torch imported, CPU build)


def test_torch_initialised_cuda_is_not_safe_to_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert cuda_driver_state() == "torch initialised CUDA"


def test_the_zygotes_imports_leave_it_safe_to_fork_here() -> None:
    code = "from jupyter_shard.launchers.zygote.server import _preload; print(repr(_preload()))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "''"


_QUERIES = """
import os, sys, torch
torchs = len(os.listdir("/proc/self/task"))  # (import torch starts a native thread of its own)
asked = []
def asking(name, real):
    def query(*args, **kwargs):
        asked.append(name)
        return real(*args, **kwargs)
    return query
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_properties",
             "get_device_capability", "is_bf16_supported"):
    setattr(torch.cuda, name, asking(name, getattr(torch.cuda, name)))
for name in ("_cuda_getDeviceCount", "_cuda_init", "_cuda_getDevice"):  # (a CUDA build's own)
    if hasattr(torch._C, name):
        setattr(torch._C, name, asking(name, getattr(torch._C, name)))
from jupyter_shard.launchers.zygote.server import _preload
_preload()
print(repr((asked, len(os.listdir("/proc/self/task")) - torchs, "torch._dynamo" in sys.modules)))
"""


def test_the_zygote_preloads_dynamo_without_asking_cuda_anything_or_starting_a_thread() -> None:
    """A rank's first optimizer imports ``torch._dynamo`` (about 1 s of CPU per rank); the zygote imports
    it once, for every rank it forks. On a GPU machine that import must not reach the driver: no
    device query (``torch.cuda.is_available()`` loads ``libcuda``), and no thread a fork would cut. On this
    CPU build the ``torch._C._cuda_*`` hooks have nothing to catch; that the import loads no ``libcuda`` on
    a CUDA build (2.14.1+cu130, with Triton) was seen with ``LD_DEBUG=libs`` (docs/cuda.md)."""
    done = subprocess.run(
        [sys.executable, "-c", _QUERIES], capture_output=True, text=True, timeout=120, check=True
    )
    asked, threads, preloaded = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert asked == [], f"the zygote's imports asked torch.cuda: {asked}"
    assert threads == 0, f"the zygote's imports after torch's started {threads} thread(s) (Python or native)"
    assert preloaded, "the zygote no longer imports torch._dynamo: each rank's first optimizer pays for it"


def test_a_loaded_driver_is_safe_to_fork_until_cuinit_in_this_process(tmp_path: Path) -> None:
    fake = fake_driver(tmp_path / "lib")
    # Loaded as torch loads it (a plain dlopen), asked before and after cuInit.
    code = f"import ctypes; driver = ctypes.CDLL({str(fake)!r}); {CHECK}; driver.cuInit(0); {CHECK}"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    before, after = done.stdout.splitlines()
    assert before == "''"
    assert after == repr(f"cuInit ran in {fake}: cuDeviceGetCount answers 0, not 3")


def test_a_loaded_library_that_cannot_be_asked_is_not_safe_to_fork(tmp_path: Path) -> None:
    import _json

    fake = tmp_path.resolve() / "libcuda.so.1"  # a real shared library under the driver's name, no API
    shutil.copy(_json.__file__, fake)
    code = f"import ctypes; ctypes.CDLL({str(fake)!r}); {CHECK}"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert ast.literal_eval(done.stdout) == (
        f"{fake} is loaded and cannot be asked whether cuInit ran: {fake}: undefined symbol: cuDeviceGetCount"
    )


CHECK = "from jupyter_shard.launchers.zygote.server import cuda_driver_state as s; print(repr(s()))"
