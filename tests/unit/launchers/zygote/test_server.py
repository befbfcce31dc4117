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


# torch's CUDA queries a module could call while it is imported; any of them may run cuInit, after
# which the zygote would refuse to fork (on a GPU machine every rank would then be spawned)
_QUERIES = (
    "is_available device_count _lazy_init init current_device get_device_properties get_device_capability"
)
PROBE = f"""
import sys, torch, torch.cuda
called = []
def spy(name, real):
    def call(*args, **kwargs):
        called.append(name)
        return real(*args, **kwargs)
    return call
for name in {_QUERIES!r}.split():
    setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))
for name in [n for n in dir(torch._C) if n.startswith("_cuda_")]:
    setattr(torch._C, name, spy(name, getattr(torch._C, name)))
assert "torch._dynamo" not in sys.modules
from jupyter_shard.launchers.zygote.server import _preload
print(repr(_preload()), "torch._dynamo" in sys.modules, called)
"""


def test_the_zygote_preloads_torchs_compiler_front_end_without_asking_cuda_anything() -> None:
    # torch's optimizers import torch._dynamo when first built (0.9-1.4 s per rank on this machine):
    # imported once in the zygote, a forked rank builds its optimizer at once, and the import must not
    # touch CUDA for the zygote to stay safe to fork
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["''", "True", "[]"], done.stdout + done.stderr


def test_a_forked_rank_finds_its_own_temporary_and_debug_directories(tmp_path: Path) -> None:
    # the zygote's imports asked for its temporary directory and working directory (torch._dynamo
    # keeps the one and puts torch.compile's debug files under the other); a rank with another TMPDIR
    # and working directory gets its own
    rank_dir, rank_tmp = tmp_path / "rank", tmp_path / "tmp"
    rank_dir.mkdir()
    rank_tmp.mkdir()
    code = f"""
import os, tempfile
from jupyter_shard.launchers.zygote.server import _fresh_state, _preload
_preload()
tempfile.gettempdir()
os.chdir({str(rank_dir)!r}); os.environ["TMPDIR"] = {str(rank_tmp)!r}
_fresh_state(dict(os.environ))
import torch._dynamo.config as c
print(tempfile.gettempdir()); print(c.debug_dir_root)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, cwd="/"
    )
    assert done.stdout.splitlines() == [str(rank_tmp), str(rank_dir / "torch_compile_debug")], done.stderr
