"""DeepSpeed's first build of an op, safe to interrupt: a lock left by a dead build is cleared, the
build shows one live line, and Ctrl-C leaves no lock and no compiler behind.

DeepSpeed compiles an op (``cpu_adam``, ``deepspeed_shm_comm``…) the first time a pool needs it, 30 s
to 4 min, through ``torch.utils.cpp_extension``, in one directory per op under
``TORCH_EXTENSIONS_DIR``. Torch guards that directory with a ``FileBaton``: an empty ``lock`` file made
with ``O_EXCL``, removed by the builder, polled for by everyone else with no message and no end (torch
2.13 records no holder and never ages a lock out). A builder killed mid-build (the escalation's
SIGKILL, a kernel restart, the out-of-memory killer) leaves the file, and every later build of that op
waits on it forever.

:func:`guard_builds` puts :class:`GuardedBaton` in torch's place. Its lock names its holder (host, pid,
process start time) and is touched every few seconds while held. A lock in the way is removed when
:func:`in_use` finds no holder: its recorded process is gone from this host, or from another host its
lock went untouched for ``HEARTBEAT_LOST``; an unrecorded lock (older code, plain torch) once no
process here has it open or works in its directory and it is older than ``UNRECORDED_AGE``. Removal
happens under a ``flock`` on ``lock.check``, so two ranks never remove each other's fresh lock. A
waiter whose builder dies stops with one line instead of loading a half-built op.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from torch.utils.file_baton import FileBaton

__all__ = ["BuildLost", "GuardedBaton", "clear_stale_lock", "guard_builds", "in_use"]

HEARTBEAT = 5.0  # seconds between touches of a held lock
HEARTBEAT_LOST = 60.0  # a lock held on another host and untouched this long has no holder
UNRECORDED_AGE = 600.0  # a lock naming no holder, used by no process here, is stale this old
SHOW_AFTER = 2.0  # a build or wait shorter than this (ninja finding nothing to do) says nothing
_CHECK_EVERY = 2.0  # a waiter asks again whether the builder lives
_PROC = Path("/proc")
_held: list[GuardedBaton] = []  # batons of this process between acquire and release
_held_lock = threading.Lock()


class BuildLost(RuntimeError):
    """The process building an op ended before the op was built."""


class GuardedBaton(FileBaton):
    """Torch's ``FileBaton`` whose lock names its holder and outlives no holder (see the module)."""

    def __init__(
        self, lock_file_path: str, wait_seconds: float = 0.1, warn_after_seconds: float | None = None
    ) -> None:
        super().__init__(lock_file_path, wait_seconds, warn_after_seconds)
        self.lock = Path(lock_file_path)
        self.what = _what(self.lock.parent.name)
        self.thread = threading.get_ident()
        self._fd: int | None = None  # torch's ``fd`` is typed None
        self._inode: tuple[int, int] | None = None
        self._line: _LiveLine | None = None
        self._handling: BaseException | None = None  # an exception the caller handles around the build

    def try_acquire(self) -> bool:
        if self.lock.exists():
            clear_stale_lock(self.lock)
        try:
            self._fd = fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with _held_lock:
            _held.append(self)
        st = os.fstat(fd)
        self._inode = (st.st_dev, st.st_ino)
        os.write(fd, _record(os.getpid()).encode())
        self._handling = sys.exc_info()[1]
        self._line = _LiveLine(f"building {self.what} (first run only, 30 s to 4 min)...", self._beat)
        return True

    def wait(self) -> None:
        line = _LiveLine(f"waiting for {self.what} to be built (first run only, 30 s to 4 min)...")
        checked = -_CHECK_EVERY
        try:
            while self.lock.exists():
                if time.monotonic() - checked >= _CHECK_EVERY:
                    checked = time.monotonic()
                    holder = in_use(self.lock)
                    if holder is None and clear_stale_lock(self.lock):
                        raise BuildLost(
                            f"{self.what} was being built by a process that ended before it finished "
                            "(its lock is removed): run the cell again to build it"
                        )
                    line.text = f"waiting for {self.what} to be built by {holder} (first run only)..."
                time.sleep(self.wait_seconds)
        except BaseException:
            line.stop(None)
            raise
        line.stop(f"{self.what} was built by another process (waited {line.elapsed:.0f} s)")

    def release(self) -> None:
        failure = sys.exc_info()[1]  # in torch's ``finally``: what ended the build, if anything did
        if failure is self._handling:
            failure = None
        if self._line is not None:
            seconds = f"{self._line.elapsed:.0f} s"
            if failure is None:
                self._line.stop(f"built {self.what} in {seconds}")
            elif isinstance(failure, KeyboardInterrupt):
                self._line.stop(f"stopped building {self.what} after {seconds}: the next use builds it again")
            else:
                self._line.stop(f"building {self.what} failed after {seconds}")
            self._line = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if failure is not None:
            _stop_build_processes(self.lock.parent)
        with contextlib.suppress(FileNotFoundError):
            st = self.lock.stat()
            if (st.st_dev, st.st_ino) == self._inode:  # never a lock made since by someone else
                self.lock.unlink()
        with _held_lock:
            if self in _held:
                _held.remove(self)

    def _beat(self) -> None:
        fd = self._fd
        if fd is not None and os.utime in os.supports_fd:
            with contextlib.suppress(OSError):
                os.utime(fd)


def guard_builds(cpp_extension: ModuleType | None = None) -> None:
    """Put :class:`GuardedBaton` into ``torch.utils.cpp_extension`` (once), and make an interrupt
    anywhere in a JIT build release the lock it took. ``cpp_extension``: the module as a post-import
    hook passes it; imported here otherwise."""
    if cpp_extension is None:
        import torch.utils.cpp_extension as cpp_extension
    names = vars(cpp_extension)
    if names.get("FileBaton") is GuardedBaton:
        return
    names["FileBaton"] = GuardedBaton
    if callable(names.get("_jit_compile")):
        names["_jit_compile"] = _releasing(names["_jit_compile"])


def in_use(lock: Path) -> str | None:
    """Who holds ``lock`` (``process 4242``…), or None when no holder is left (see the module)."""
    try:
        st = lock.stat()
        text = lock.read_text(errors="replace")
    except FileNotFoundError:
        return None
    if _held_here(lock):
        return f"process {os.getpid()}"
    age = time.time() - st.st_mtime
    parts = text.strip().split(maxsplit=2)
    if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
        pid, started, host = int(parts[0]), int(parts[1]), parts[2]
        if host != _host():
            return f"process {pid} on {host.split('/')[0]}" if age < HEARTBEAT_LOST else None
        if _running(pid, started):
            return f"process {pid}"
    user = next((p for p in _local_processes(lock.parent, lock) if p != os.getpid()), None)
    if user is not None:
        return f"process {user}"
    if len(parts) != 3 and age < UNRECORDED_AGE:
        return f"a process that left no name in {lock} (taken as stale {UNRECORDED_AGE / 60:.0f} min after)"
    return None


def clear_stale_lock(lock: Path) -> bool:
    """Remove ``lock`` if :func:`in_use` finds no holder, and say so on stderr; whether it was removed."""
    with _exclusive(lock.with_name(lock.name + ".check")):
        if not lock.exists() or in_use(lock) is not None:
            return False
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
    print(
        f"jupyter_shard: removed a stale build lock left by an interrupted build: {lock}",
        file=sys.stderr,
        flush=True,
    )
    return True


class _LiveLine:
    """One line on stderr, redrawn each second with the time so far once ``SHOW_AFTER`` passed (a rank
    shows a line written after ``\\r`` in place); ``beat`` runs every ``HEARTBEAT`` meanwhile."""

    def __init__(self, text: str, beat: Callable[[], None] | None = None) -> None:
        self.text = text
        self._beat = beat
        self._started = time.monotonic()
        self._shown = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jupyter_shard-build-line", daemon=True)
        self._thread.start()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def stop(self, final: str | None) -> None:
        """End the line, with ``final`` in its place, if it was shown."""
        self._done.set()
        self._thread.join()
        if self._shown:
            _write(f"\r{final}\n" if final else "\n")

    def _run(self) -> None:
        beaten = self._started
        while not self._done.wait(1.0):
            now = time.monotonic()
            if self._beat is not None and now - beaten >= HEARTBEAT:
                beaten = now
                self._beat()
            if now - self._started >= SHOW_AFTER and not self._done.is_set():
                self._shown = True
                _write(f"\r{self.text} {now - self._started:.0f} s")


def _write(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # a closed stderr at exit
        sys.stderr.write(text)
        sys.stderr.flush()


def _releasing(compile_: Callable[..., Any]) -> Callable[..., Any]:
    """``compile_`` (torch's ``_jit_compile``) releasing any baton this thread took in it and still
    holds when it ends: an interrupt between torch's acquire and its ``try`` would leave the lock."""

    @functools.wraps(compile_)
    def compile_releasing(*args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        with _held_lock:
            before = [b for b in _held if b.thread == me]
        try:
            return compile_(*args, **kwargs)
        finally:
            with _held_lock:
                left = [b for b in _held if b.thread == me and b not in before]
            for baton in left:
                baton.release()

    return compile_releasing


def _what(op: str) -> str:
    """``DeepSpeed's cpu_adam`` when DeepSpeed is building it, ``the torch extension x`` otherwise."""
    frame = inspect.currentframe()
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith("deepspeed."):
            return f"DeepSpeed's {op}"
        frame = frame.f_back
    return f"the torch extension {op}"


@functools.cache
def _host() -> str:
    """This host and PID namespace: pids recorded under another are not this machine's to check."""
    try:
        return f"{socket.gethostname()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def _start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started (so a reused pid is not taken for it); None if
    it is gone or a zombie."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _record(pid: int) -> str:
    return f"{pid} {_start_time(pid) or 0} {_host()}\n"


def _held_here(lock: Path) -> bool:
    """Whether a baton of this process holds ``lock`` (one it took and lost to an interrupt does not)."""
    with _held_lock:
        return any(b.lock == lock for b in _held)


def _running(pid: int, started: int) -> bool:
    if pid == os.getpid():
        return False  # this process holds its locks through its batons (:func:`_held_here`)
    if not _PROC.is_dir():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    now = _start_time(pid)
    return now is not None and started in (0, now)  # 0: the holder could not read its own


def _local_processes(directory: Path, lock: Path | None = None) -> Iterator[int]:
    """Pids of this user's processes working in ``directory`` (ninja, the compilers) or with ``lock``
    open (torch's own baton keeps it open while it builds)."""
    if not _PROC.is_dir():
        return
    where = os.path.realpath(directory)
    held = os.path.realpath(lock) if lock is not None else None
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            if cwd == where or cwd.startswith(where + os.sep):
                yield int(entry.name)
                continue
            if held is not None and any(os.readlink(fd) == held for fd in (entry / "fd").iterdir()):
                yield int(entry.name)
        except OSError:  # another user's process, or one that just ended
            continue


def _stop_build_processes(directory: Path) -> None:
    """End what an interrupted build left running in ``directory``: Python kills ninja when an
    interrupt stops its wait, not the compilers ninja started, which would write on into the next build."""
    group = os.getpgrp()
    left = []
    for pid in _local_processes(directory):
        with contextlib.suppress(OSError):
            if pid != os.getpid() and os.getpgid(pid) == group:  # started by this rank
                os.kill(pid, signal.SIGTERM)
                left.append(pid)
    deadline = time.monotonic() + 1.0
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if _start_time(pid) is not None]
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` for the block (none where the filesystem has no locks)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
