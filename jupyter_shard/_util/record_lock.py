"""One writer at a time for a kept pool's record: an exclusive ``flock`` on ``kept.lock`` in the
pool's private directory.

Kernels attaching or taking over, the kernel letting go, and rank 0 noting that its kernel went all
read the record, change it and write it back; without the lock two kernels attaching at once both
found no owner and both bound the pool's socket. The lock is re-entrant within a process (a
failed attach lets go of the pool while it holds it), and a process that dies holding it loses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_FILE", "RecordBusy", "record_lock"]

LOCK_FILE = "kept.lock"
_held = threading.local()  # directories this thread holds the lock of, with their depth


class RecordBusy(TimeoutError):
    """Another process held the record's lock for longer than the wait."""


@contextlib.contextmanager
def record_lock(directory: Path, wait: float = 15.0) -> Iterator[None]:
    """Hold ``directory``'s record lock (waiting up to ``wait`` seconds: :class:`RecordBusy`).
    Re-entrant in one thread; another thread or process waits (each open of the file is its own
    ``flock``)."""
    key = os.path.realpath(directory)
    depths: dict[str, int] = _held.__dict__.setdefault("depths", {})
    if depths.get(key):
        depths[key] += 1
        try:
            yield
        finally:
            depths[key] -= 1
        return
    fd = os.open(Path(directory) / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RecordBusy(f"{directory} is being changed by another process") from None
                time.sleep(0.02)
        depths[key] = 1
        try:
            yield
        finally:
            depths.pop(key, None)
    finally:
        os.close(fd)  # releases the lock
