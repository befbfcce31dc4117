"""Shared-memory segments that carry a transfer's bulk data between processes on one machine, where
the kernel may not copy into or out of a rank's memory itself (:mod:`.peer_memory`, the faster path).

A push or pull moves a value's out-of-band buffers (:mod:`jupyter_shard.transfer.pickling`) through one
segment: an anonymous ``memfd`` that the notebook kernel creates and owns, for both directions.

- **push**: the kernel writes the buffers into the segment, seals it (no more writes, no resizing)
  and names it in the signed ``push`` message; each rank opens it, checks it, and maps every buffer
  copy-on-write (``MAP_PRIVATE``): no copy is made at all, yet each rank has its own value, since a
  page a rank writes to becomes that rank's private page and the sealed segment never changes.
- **pull**, where the kernel may not read the rank's memory itself (:mod:`.peer_memory`): the kernel
  creates an empty segment and names it in the ``pull`` message; the rank writes its buffers into
  it and replies with their sizes; the kernel seals it, checks its size and maps the buffers the
  same way.

Why this is safe, and why no HMAC runs over the data:

- *Nothing here is ever unpickled.* The in-band pickle, which alone decides what objects are built,
  travels in the message and is authenticated with the pool key like every message. A segment only
  holds raw element bytes of arrays that the authenticated pickle describes, and sizes are checked
  against the signed sizes before anything is built (a short or long segment is refused).
- *Only the pool can name a segment.* The descriptor (kernel pid, fd number, a 128-bit random token)
  is inside the signed message, so a forged or replayed one is dropped by :class:`~.protocol.Wire`.
  A receiver opens ``/proc/<kernel pid>/fd/<fd>`` (which the kernel lets only processes that may
  inspect it open: the same user), then checks that the file it got is a memfd named with that token,
  is a regular file owned by this user with mode 0600, has exactly the signed size and, for a push,
  carries the seals that make it immutable. A segment of another process, or one grown, shrunk or
  rewritten, is refused with a message and the pool keeps working.
- *Nothing can be left behind.* A memfd has no name in ``/dev/shm`` or anywhere else: it lives while
  a process holds it open or mapped, so a crash of either side frees it with the process. The
  kernel closes its descriptor when the transfer ends, also on an interrupt; what ranks mapped lives
  exactly as long as the values built over it.

Authenticating the bytes themselves would cost a hash over every byte (HMAC-SHA256 runs at 1-2 GB/s
here) and cap the transfer below memory speed; the checks above cost microseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jupyter_shard.transfer.mapping import MappingError, mapped
from jupyter_shard.wire.messages import SegmentRef

__all__ = [
    "UNAVAILABLE",
    "Segment",
    "SegmentError",
    "SegmentRef",
    "map_buffers",
    "supported",
    "write_into",
]

PAGE = mmap.PAGESIZE
UNAVAILABLE = "shared memory is not available"  # a receiver's error that sends the value inline
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MAP_OVER = 1 << 20  # buffers from this size are mapped; smaller ones are read (a mapping costs more)
_SPLIT_OVER = 32 << 20  # buffers from this size are written by two threads
_NAME = "jupyter_shard-"


class SegmentError(Exception):
    """A segment that is missing, not ours, or not what the signed message said."""


def supported() -> bool:
    """Whether this platform has sealed memfds (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each buffer starts (page-aligned, so each can be mapped on its own) and the total."""
    offsets, end = [], 0
    for size in sizes:
        if size < 0:
            raise SegmentError(f"a buffer size of {size} bytes is not a size")
        offsets.append(end)
        end += -(-size // PAGE) * PAGE
    return offsets, end


class Segment:
    """A memfd this process created and holds open; closed (and freed once unmapped) by :meth:`close`."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.fd = os.memfd_create(_NAME + self.token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.fchmod(self.fd, 0o600)  # the user's alone, as a file in /dev/shm would be made

    @property
    def ref(self) -> SegmentRef:
        return {"pid": os.getpid(), "fd": self.fd, "token": self.token}

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def fill(self, buffers: Sequence[memoryview]) -> None:
        """Write ``buffers`` (laid out by :func:`layout`) and seal the segment against any change."""
        write_into(self.fd, buffers)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)

    def seal_and_map(self, sizes: Sequence[int]) -> list[Any]:
        """After a rank wrote ``sizes`` into it: seal it, check it, and map its buffers."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        return map_buffers(self.fd, sizes)


def write_into(fd: int, buffers: Sequence[memoryview]) -> None:
    """Size the memfd ``fd`` for ``buffers`` and write them at their :func:`layout` offsets."""
    offsets, total = layout([b.nbytes for b in buffers])
    os.ftruncate(fd, total)
    jobs = []
    for buffer, offset in zip(buffers, offsets, strict=True):
        view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        if view.nbytes >= _SPLIT_OVER:
            half = view.nbytes // 2 // PAGE * PAGE
            jobs += [(view[:half], offset), (view[half:], offset + half)]
        elif view.nbytes:
            jobs.append((view, offset))
    if len(jobs) > 1 and any(v.nbytes >= _SPLIT_OVER // 2 for v, _ in jobs):
        with ThreadPoolExecutor(2, thread_name_prefix="jshard-write") as pool:
            list(pool.map(lambda job: _pwrite(fd, *job), jobs))
    else:
        for job in jobs:
            _pwrite(fd, *job)


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def map_buffers(fd: int, sizes: Sequence[int]) -> list[Any]:
    """The buffers in ``fd`` at their :func:`layout` offsets, each writable and private to this
    process; a :class:`SegmentError` when the segment's size is not what ``sizes`` lay out."""
    offsets, total = layout(sizes)
    actual = os.fstat(fd).st_size
    if actual != total:
        raise SegmentError(
            f"the transfer's segment holds {actual} bytes where its signed sizes need {total}: "
            "truncated or not the segment that was sent"
        )
    out: list[Any] = []
    for size, offset in zip(sizes, offsets, strict=True):
        if size >= _MAP_OVER:
            out.append(_map_private(fd, size, offset))
        else:
            buffer = bytearray(size)
            view, done = memoryview(buffer), 0
            while done < size:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise SegmentError("the transfer's segment ended early")
                done += got
            out.append(buffer)
    return out


def _map_private(fd: int, size: int, offset: int) -> memoryview:
    """``size`` bytes of ``fd`` from ``offset``, mapped copy-on-write; unmapped when the last object
    over the view is gone. (``mmap.mmap`` would keep a duplicate of ``fd`` open per mapping.)"""
    try:
        return mapped(size, fd=fd, offset=offset)
    except MappingError as exc:
        raise SegmentError(f"the transfer's segment could not be mapped: {exc.strerror}") from None


@contextlib.contextmanager
def opened(ref: SegmentRef, *, writable: bool = False) -> Iterator[int]:
    """The segment ``ref`` names, open (read-only, or for writing by a pull), checked to be the
    kernel's memfd with ``ref``'s token, owned by this user and, read-only, sealed; closed after.

    A :class:`SegmentError` starting with :data:`UNAVAILABLE` when it cannot be reached from here
    (another machine, another pid namespace): the sender then sends the value inline instead.
    """
    path = f"/proc/{int(ref['pid'])}/fd/{int(ref['fd'])}"
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError as exc:
        raise SegmentError(f"{UNAVAILABLE} ({exc.strerror})") from None
    try:
        _check(fd, ref, writable)
        yield fd
    finally:
        os.close(fd)


def _check(fd: int, ref: SegmentRef, writable: bool) -> None:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise SegmentError(f"{UNAVAILABLE} ({exc.strerror})") from None
    if target != f"/memfd:{_NAME}{ref['token']} (deleted)":
        raise SegmentError(f"{UNAVAILABLE} (the descriptor names another file here)")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SegmentError("the transfer's segment is not a private (0600) file of this user: refused")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if writable and (seals or info.st_size):
        raise SegmentError("the segment for this pull was already written to: refused")
    if not writable and seals & SEALS != SEALS:
        raise SegmentError("the transfer's segment is not sealed, so it could still change: refused")
