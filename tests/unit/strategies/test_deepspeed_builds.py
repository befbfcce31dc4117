"""Torch's JIT build lock under :func:`guard_builds`: a stale lock is cleared, a live one kept, an
interrupted build leaves no lock and no compiler, and the build is one live line.

Each build goes through the real ``torch.utils.cpp_extension.load`` (its versioner, its baton, its
``try``/``finally``) with the compiler and the import faked, in a thread joined with a timeout, so a
hang fails the test instead of stopping the suite. Holders are tiny Python processes (no torch).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from jupyter_shard.strategies import deepspeed as deepspeed_module
from jupyter_shard.strategies import deepspeed_builds
from jupyter_shard.strategies.deepspeed_builds import (
    BuildLost,
    GuardedBaton,
    clear_stale_lock,
    guard_builds,
    in_use,
)

OP = "deepspeed_shm_comm"
HOUR_AGO = time.time() - 3600
# Creates the lock as torch's baton does (O_EXCL, kept open, nothing written) and holds it.
HOLDER = (
    "import os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY)\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """``guard_builds`` on torch's module for this test only (its originals put back after)."""
    for name in ("FileBaton", "_jit_compile"):
        monkeypatch.setitem(vars(cpp_extension), name, vars(cpp_extension)[name])
    guard_builds(cpp_extension)


@dataclass
class FakeCompiler:
    """Torch's ``_write_ninja_file_and_build_library``: runs ``during``, raises ``raises`` or sleeps
    ``seconds`` and writes the library."""

    seconds: float = 0.0
    raises: BaseException | None = None
    during: Callable[[], None] | None = None

    def __call__(self, *, name: str, build_directory: str, **_: Any) -> None:
        if self.during is not None:
            self.during()
        if self.raises is not None:
            raise self.raises
        time.sleep(self.seconds)
        Path(build_directory, f"{name}.so").write_text("built")


@pytest.fixture
def compiler(monkeypatch: pytest.MonkeyPatch) -> FakeCompiler:
    fake = FakeCompiler()
    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_build_library", fake)
    monkeypatch.setattr(cpp_extension, "_import_module_from_library", lambda name, path, py: name)
    return fake


@pytest.fixture
def build_dir(tmp_path: Path, compiler: FakeCompiler) -> Path:
    """``<extensions>/deepspeed_shm_comm``, with the op's source beside it."""
    d = tmp_path / "torch_extensions" / OP
    d.mkdir(parents=True)
    (d.parent / "shm.cpp").write_text("int x;\n")
    return d


class Load:
    """``cpp_extension.load`` of the op in a daemon thread (``through``: a caller standing in for
    DeepSpeed's builder), so that a hang fails the test instead of stopping the suite."""

    def __init__(self, build_dir: Path, through: Callable[..., Any] | None = None) -> None:
        self.lock = build_dir / "lock"
        self.done: dict[str, Any] = {}
        args = {"name": OP, "sources": [str(build_dir.parent / "shm.cpp")], "build_directory": str(build_dir)}
        call = through or (lambda load, **kw: load(**kw))

        def run() -> None:
            try:
                self.done["result"] = call(cpp_extension.load, **args)
            except BaseException as exc:
                self.done["error"] = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def waiting_after(self, seconds: float) -> bool:
        self.thread.join(seconds)
        return self.thread.is_alive()

    def outcome(self, within: float) -> tuple[Any, BaseException | None]:
        """(what ``load`` returned, what it raised); fails if it has not ended ``within`` seconds."""
        left = self.lock.read_text() if self.lock.exists() else "gone"
        assert not self.waiting_after(within), f"the load still waits after {within} s (lock: {left!r})"
        return self.done.get("result"), self.done.get("error")


def _built(result: Any) -> bool:
    """``load`` returned the op (torch names it ``deepspeed_shm_comm_v3`` after other directories)."""
    return isinstance(result, str) and result.startswith(OP)


def _load(build_dir: Path, within: float = 10.0) -> tuple[Any, BaseException | None]:
    return Load(build_dir).outcome(within)


def _holder(lock: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


@pytest.fixture
def holder(build_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``build_dir/lock`` as torch's baton does, alive until the test ends."""
    proc = _holder(build_dir / "lock")
    yield proc
    proc.kill()
    proc.wait()


def _record_for(pid: int, scratch: Path) -> str:
    """What a guarded baton of process ``pid`` (on this host) writes in its lock: ``pid start host``."""
    baton = GuardedBaton(str(scratch / "lock"))
    assert baton.try_acquire()
    host = (scratch / "lock").read_text().split(maxsplit=2)[2]
    baton.release()
    start = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    return f"{pid} {start} {host}"


# -- a lock left by an interrupted build -------------------------------------------------------------


def test_a_lock_left_by_an_interrupted_build_no_longer_hangs_the_next_load(
    guarded: None, build_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: torch's empty ``lock`` beside the built library, its builder long gone."""
    lock = build_dir / "lock"
    lock.touch()
    os.utime(lock, (HOUR_AGO, HOUR_AGO))
    (build_dir / f"{OP}.so").write_text("built")
    result, error = _load(build_dir)
    assert error is None and _built(result)
    assert not lock.exists()
    assert f"removed a stale build lock left by an interrupted build: {lock}" in capsys.readouterr().err


def test_a_lock_whose_recorded_builder_was_killed_is_cleared_at_once(
    guarded: None, build_dir: Path, tmp_path: Path
) -> None:
    lock = build_dir / "lock"
    proc = _holder(lock)
    lock.write_text(_record_for(proc.pid, tmp_path))
    proc.kill()
    proc.wait()
    started = time.monotonic()
    result, error = _load(build_dir)
    assert error is None and _built(result) and not lock.exists()
    assert time.monotonic() - started < 3.0


def test_an_import_of_deepspeed_guards_its_op_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FileBaton", "_jit_compile"):
        monkeypatch.setitem(vars(cpp_extension), name, vars(cpp_extension)[name])
    monkeypatch.setitem(sys.modules, "deepspeed", type(sys)("deepspeed"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/mine")
    deepspeed_module.import_deepspeed(torch.device("cpu"))
    assert cpp_extension.FileBaton is GuardedBaton
    compile_ = cpp_extension._jit_compile
    guard_builds()
    assert cpp_extension._jit_compile is compile_, "a second time changes nothing"


# -- a live builder -----------------------------------------------------------------------------------


def test_a_lock_held_by_a_live_process_is_kept(
    build_dir: Path, holder: subprocess.Popen[str], tmp_path: Path
) -> None:
    """Recorded or not (torch's own empty lock), and however old, a lock a live process holds stays."""
    lock = build_dir / "lock"
    os.utime(lock, (HOUR_AGO, HOUR_AGO))
    assert in_use(lock) == f"process {holder.pid}"  # it has the file open
    assert not clear_stale_lock(lock) and lock.exists()
    lock.write_text(_record_for(holder.pid, tmp_path))
    os.utime(lock, (HOUR_AGO, HOUR_AGO))
    assert in_use(lock) == f"process {holder.pid}"
    assert not clear_stale_lock(lock) and lock.exists()


def test_a_waiter_waits_for_a_live_builder_and_stops_in_one_line_when_it_dies(
    guarded: None, build_dir: Path, holder: subprocess.Popen[str], tmp_path: Path
) -> None:
    lock = build_dir / "lock"
    lock.write_text(_record_for(holder.pid, tmp_path))
    waiter = Load(build_dir)
    assert waiter.waiting_after(3.0), "past the waiter's first checks, the builder lives"
    assert lock.exists()
    holder.kill()
    holder.wait()
    _, error = waiter.outcome(within=10.0)
    assert isinstance(error, BuildLost)
    assert str(error) == (
        f"the torch extension {OP} was being built by a process that ended before it finished "
        "(its lock is removed): run the cell again to build it"
    )
    assert not lock.exists()
    result, error = _load(build_dir)  # the next run builds it
    assert error is None and _built(result)


def test_this_process_holds_a_lock_only_through_a_baton_it_has_not_released(
    build_dir: Path, tmp_path: Path
) -> None:
    """A rank that took a lock and lost it to an interrupt (its baton gone) does not wait on itself."""
    lock = build_dir / "lock"
    baton = GuardedBaton(str(lock))
    assert baton.try_acquire()
    assert in_use(lock) == f"process {os.getpid()}"
    baton.release()
    lock.write_text(_record_for(os.getpid(), tmp_path))
    assert in_use(lock) is None


def test_a_young_lock_naming_no_process_is_waited_for(build_dir: Path) -> None:
    """Made a moment ago, perhaps by a build on another machine sharing the directory."""
    lock = build_dir / "lock"
    lock.touch()
    assert in_use(lock) is not None and not clear_stale_lock(lock)
    os.utime(lock, (HOUR_AGO, HOUR_AGO))
    assert in_use(lock) is None and clear_stale_lock(lock) and not lock.exists()


def test_a_lock_recorded_on_another_host_lives_while_its_builder_touches_it(build_dir: Path) -> None:
    lock = build_dir / "lock"
    lock.write_text(f"{os.getpid()} 1 elsewhere/pid:[1]\n")
    assert in_use(lock) == f"process {os.getpid()} on elsewhere"
    two_minutes_ago = time.time() - 120
    os.utime(lock, (two_minutes_ago, two_minutes_ago))
    assert in_use(lock) is None


# -- an interrupted build -----------------------------------------------------------------------------


def test_an_interrupted_build_leaves_no_lock(guarded: None, build_dir: Path, compiler: FakeCompiler) -> None:
    compiler.raises = KeyboardInterrupt()
    _, error = _load(build_dir)
    assert isinstance(error, KeyboardInterrupt)
    assert not (build_dir / "lock").exists()
    compiler.raises = None
    result, error = _load(build_dir)
    assert error is None and _built(result)


def test_an_interrupt_right_after_the_lock_is_taken_leaves_no_lock(
    guarded: None, build_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between torch's ``try_acquire`` and its ``try``, where torch's own ``finally`` cannot help."""
    acquire = GuardedBaton.try_acquire

    def acquire_then_interrupted(self: GuardedBaton) -> bool:
        acquire(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(GuardedBaton, "try_acquire", acquire_then_interrupted)
    _, error = _load(build_dir)
    assert isinstance(error, KeyboardInterrupt)
    assert not (build_dir / "lock").exists()


def test_an_interrupted_build_stops_the_compilers_ninja_left(
    guarded: None, build_dir: Path, compiler: FakeCompiler
) -> None:
    compilers: list[subprocess.Popen[bytes]] = []

    def start_compiler() -> None:  # as ninja starts one in the build directory
        compilers.append(subprocess.Popen(["sleep", "60"], cwd=build_dir))

    compiler.during, compiler.raises = start_compiler, KeyboardInterrupt()
    _, error = _load(build_dir)
    assert isinstance(error, KeyboardInterrupt)
    assert compilers[0].wait(timeout=3.0) == -signal.SIGTERM


# -- what the user sees ---------------------------------------------------------------------------------


def test_a_deepspeed_build_is_one_live_line(
    guarded: None,
    build_dir: Path,
    compiler: FakeCompiler,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(deepspeed_builds, "SHOW_AFTER", 0.0)
    compiler.seconds = 1.5
    deepspeed_like: dict[str, Any] = {"__name__": "deepspeed.ops.op_builder.builder"}
    exec("def jit_load(load, **kw):\n    return load(**kw)\n", deepspeed_like)  # a frame of DeepSpeed's
    result, error = Load(build_dir, through=deepspeed_like["jit_load"]).outcome(within=10.0)
    assert error is None and _built(result)
    err = capsys.readouterr().err
    assert err.startswith(f"\rbuilding DeepSpeed's {OP} (first run only, 30 s to 4 min)... 1 s"), err
    assert re.search(rf"\rbuilt DeepSpeed's {OP} in [12] s\n$", err), err
    assert "\n" not in err[:-1], "one line, redrawn in place"


def test_a_build_shorter_than_two_seconds_says_nothing(
    guarded: None, build_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every new rank process runs ninja, which finds the op built: no line for that."""
    result, error = _load(build_dir)
    assert error is None and _built(result)
    assert capsys.readouterr().err == ""
