"""Start writing a file's dirty pages to the disk while it is still being written.

Why it exists: a suspend writes gigabytes and then fsyncs them. Left alone, Linux starts writing
dirty pages back only once they pass ``vm.dirty_background_ratio`` of memory (10 % by default: about
2.4 GB on a 24 GiB machine), so the disk idles while the ranks serialize and hash, and the fsync at
the end waits for almost everything. :class:`Writeback` asks the kernel, every :data:`STRIDE` bytes,
to begin writing the range just written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: it returns at
once), so the disk works alongside the ranks and the closing fsync finds little left. Where the call
does not exist (not Linux), it does nothing; the fsync still makes the file durable.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["STRIDE", "Writeback"]

STRIDE = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:  # the process's own symbols: libc's, without looking for the library on disk
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


_CALL = _sync_file_range()


class Writeback:
    """Counts the bytes written to one file descriptor and starts their writeback every ``stride``."""

    def __init__(self, fd: int, stride: int = STRIDE) -> None:
        self.fd = fd
        self.stride = stride
        self.written = 0  # bytes written so far
        self.started = 0  # bytes whose writeback was asked for

    def wrote(self, count: int) -> None:
        self.written += count
        if self.written - self.started >= self.stride:
            self.start()

    def start(self) -> None:
        """Ask for the writeback of everything written since the last call (no wait)."""
        if _CALL is not None and self.fd >= 0 and self.written > self.started:
            _CALL(self.fd, self.started, self.written - self.started, _SYNC_FILE_RANGE_WRITE)
        self.started = self.written
