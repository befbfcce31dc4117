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
