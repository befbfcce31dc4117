"""F23: DeepSpeed's first build of an op (30 s to 4 min), killed or interrupted midway, leaves nothing
that hangs a later pool: the killed builder's lock is cleared by the next build, an interrupt leaves
no lock, and the build is one live line per rank.

The ranks build through torch's real ``cpp_extension.load`` (its versioner and lock) with the
compiler faked by a sleep, in a directory of the test's own (``<tmp>/torch_extensions/<op>``, as
DeepSpeed's builds sit under ``TORCH_EXTENSIONS_DIR``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.faults.conftest import interrupt_after, rank_pids

pytestmark = pytest.mark.timeout(240)

OP = "deepspeed_shm_comm"
START = "%%distributed --nproc 2 --device cpu\nstarted = True"
SETUP = """%%distributed
import os, time
import torch.utils.cpp_extension as ce

build_seconds = {seconds}


def compile_op(*, name, build_directory, **_):  # the compiler DeepSpeed's first use of an op runs
    time.sleep(build_seconds)
    open(os.path.join(build_directory, name + ".so"), "w").close()


ce._write_ninja_file_and_build_library = compile_op
ce._import_module_from_library = lambda name, path, is_python_module: name


def load_op():
    return ce.load(name={op!r}, sources=[{source!r}], build_directory={build!r})
"""


def _build_dir(tmp_path: Path) -> Path:
    build = tmp_path / "torch_extensions" / OP
    build.mkdir(parents=True)
    (build.parent / "shm.cpp").write_text("int x;\n")
    return build


def _setup(kernel: Any, build: Path, seconds: float) -> None:
    source = str(build.parent / "shm.cpp")
    run = kernel.execute(SETUP.format(seconds=seconds, op=OP, source=source, build=str(build)))
    assert run.ok, run.error_text()


def _live_lines(run: Any) -> list[str]:
    return [
        o["data"]["text/plain"]
        for o in run.outputs
        if o["type"] in ("display_data", "update_display_data") and "text/plain" in o.get("data", {})
    ]


def test_f23_a_builder_killed_midway_leaves_no_lock_that_hangs_the_next_pool(
    kernel: Any, tmp_path: Path
) -> None:
    """The escalation's kill, a kernel restart or the OOM killer ends the builder: the next pool's
    build clears the lock at once, says so in one line, and runs."""
    build, lock = _build_dir(tmp_path), tmp_path / "torch_extensions" / OP / "lock"
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(START).ok
    _setup(kernel, build, seconds=60)
    ranks = rank_pids(kernel)
    killed: list[int] = []

    def kill_the_builder() -> None:  # the rank that holds the lock open, as torch's baton does
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            for pid in ranks:
                with contextlib.suppress(psutil.Error):
                    if str(lock) in (f.path for f in psutil.Process(pid).open_files()):
                        killed.append(pid)
                        os.kill(pid, signal.SIGKILL)
                        return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_builder)
    killer.start()
    run = kernel.execute("%%distributed --timeout 60\nload_op()")
    killer.join()
    assert killed and not run.ok
    assert lock.exists(), "the killed builder left its lock behind"

    assert kernel.execute("%dist_restart").ok
    _setup(kernel, build, seconds=0)
    run = kernel.execute("%%distributed --timeout 30\nload_op()")
    assert run.ok, run.error_text()
    assert run.elapsed < 10.0, f"the next build took {run.elapsed:.1f} s"
    said = run.stream("stderr") + run.stream()
    assert f"removed a stale build lock left by an interrupted build: {lock}" in said, said
    assert not lock.exists()


def test_f23_ctrl_c_during_a_build_leaves_no_lock_and_the_build_is_one_live_line(
    kernel: Any, tmp_path: Path
) -> None:
    build = _build_dir(tmp_path)
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(START).ok
    _setup(kernel, build, seconds=60)
    fired = interrupt_after(kernel, 4.0)
    run = kernel.execute("%%distributed\nload_op()")
    fired.join()
    assert not run.ok
    assert run.error_text().splitlines()[0] == "interrupted: KeyboardInterrupt on rank 0-1"
    assert run.elapsed < 4.0 + 3.0, f"the cell took {run.elapsed:.1f} s after the interrupt"
    assert not (build / "lock").exists()
    lines = _live_lines(run)
    building = f"building the torch extension {OP} (first run only, 30 s to 4 min)..."
    assert any(building in line for line in lines), lines
    waiting = f"waiting for the torch extension {OP} to be built by process"
    assert any(waiting in line for line in lines), lines
    assert f"stopped building the torch extension {OP} after" in "\n".join(lines) + run.stream("stderr")

    assert kernel.execute("%%distributed\nbuild_seconds = 0").ok
    run = kernel.execute("%%distributed --timeout 30\nload_op()")
    assert run.ok, run.error_text()
    assert run.elapsed < 5.0
