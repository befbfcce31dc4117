"""Copies between the kernel and a rank on this machine, made by the kernel straight from or into
the rank's memory (``process_vm_readv`` / ``process_vm_writev``).

- **pull**: the rank answers with the addresses and sizes of its out-of-band buffers
  (:mod:`jupyter_shard.transfer.pickling`) and keeps them alive (:class:`Lent`) until the kernel says it read
  them; the kernel reads them into fresh memory of its own.
- **push**: each rank offers fresh memory of the announced sizes (:func:`landing`); the kernel writes
  the buffers into every rank's landing, then sends the in-band pickles that build the values over it.

Why not a shared-memory segment (:mod:`.segments`, still the path where this fails): a memfd is
filled one 4 KiB page at a time (shared memory gets no huge pages here), at about 1.7 GB/s, however
many threads write. Fresh anonymous memory asked for as transparent huge pages fills at 4.7 GB/s from
one thread, and a copy into each rank's own landing, by a thread per core, runs at 8-9 GB/s together
for 2 ranks. Each rank then holds its own copy, as if it had made the value itself.

Why it is safe: the reply naming the addresses is signed with the pool key like every message, and
the in-band pickle, authenticated, alone decides what is built; what moves are raw element bytes of
the arrays it describes, of exactly the signed sizes. Before any copy, the kernel reads a 128-bit
random token from an address the same reply names, in the pid it recorded when the rank started
(never a pid a message names), and compares it: a pid reused by another process, or a rank in another
pid namespace, fails there, and the segment is used instead. The operating system lets a process read
or write another's memory only where it could trace it (the same user, and where Yama's
``ptrace_scope`` is 1, only its descendants: ranks spawned by the kernel); anywhere else the copy
fails and the segment is used.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jupyter_shard.transfer.mapping import MappingError, libc, mapped

__all__ = ["Lent", "PeerMemoryError", "Target", "address_of", "landing", "read", "supported", "write"]

PIECE = 8 << 20  # bytes per system call: threads share the work, and a Ctrl-C is seen, between them
THREADS = max(1, min(4, os.cpu_count() or 1))  # copying threads (the calling one included)
_HUGE_OVER = 2 << 20  # regions from this size ask for transparent huge pages
_ALIGN = 64  # each buffer of a region starts at a multiple of this
TOKEN_BYTES = 16


class PeerMemoryError(Exception):
    """The rank's memory could not be read or written as its reply said (then a segment is used)."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _process_vm(found: Any) -> Any:
    """The C library with ``process_vm_readv``/``process_vm_writev`` declared; None without them."""
    if found is None or not hasattr(found, "process_vm_readv") or not hasattr(found, "process_vm_writev"):
        return None
    for call in (found.process_vm_readv, found.process_vm_writev):
        call.restype = ctypes.c_ssize_t
        call.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IoVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IoVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
    return found


_LIBC = _process_vm(libc)


def supported() -> bool:
    return _LIBC is not None


def address_of(buffer: Any) -> int:
    """Where ``buffer`` (a contiguous buffer, possibly read-only) starts in this process."""
    import numpy as np

    view = memoryview(buffer).cast("B")
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class Lent:
    """What a rank keeps alive for the kernel to copy from or into: its buffers and a fresh token."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self.buffers = list(buffers)
        self.token = bytearray(secrets.token_bytes(TOKEN_BYTES))

    @property
    def addresses(self) -> list[int]:
        return [address_of(b) for b in self.buffers]

    @property
    def token_address(self) -> int:
        return address_of(self.token)


@dataclass(frozen=True)
class Target:
    """A rank's memory as its signed reply names it: where its buffers are and its token."""

    pid: int
    addresses: Sequence[int]
    token: str
    token_address: int


def landing(sizes: Sequence[int]) -> Lent:
    """Fresh memory for buffers of ``sizes`` (one region, freed with the last value built over it),
    lent for the kernel to write a push into."""
    starts, end = _layout(sizes)
    region = _fresh(end)
    return Lent([region[start : start + size] for start, size in zip(starts, sizes, strict=True)])


def _layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each buffer starts in one region (a model's hundreds of parameters cost one mapping,
    not hundreds), and the region's size."""
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // _ALIGN) * _ALIGN
    return starts, end


def _fresh(size: int) -> memoryview:
    """``size`` bytes of fresh anonymous memory (huge pages when large), freed with its last user."""
    if size < _HUGE_OVER:
        return memoryview(bytearray(size))
    try:
        return mapped(size, huge=True)
    except MappingError as exc:
        raise MemoryError(f"no memory for {size} bytes: {exc.strerror}") from None


_Piece = tuple[int, int, int, int]  # pid, local address, remote address, bytes


def _copy_piece(piece: _Piece, write: bool) -> None:
    assert _LIBC is not None
    call = _LIBC.process_vm_writev if write else _LIBC.process_vm_readv
    pid, local, remote, size = piece
    done = 0
    while done < size:
        here, there = _IoVec(local + done, size - done), _IoVec(remote + done, size - done)
        got = call(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if got <= 0:
            error = ctypes.get_errno() if got < 0 else 0
            verb = "writing" if write else "reading"
            raise PeerMemoryError(
                f"{verb} rank memory failed: {os.strerror(error) if error else 'short copy'}"
            )
        done += got


def _copy(pieces: list[_Piece], write: bool) -> dict[int, str]:
    """Copy ``pieces``, cut to :data:`PIECE` bytes and shared among :data:`THREADS` threads; the
    pids whose copies failed, with why (their other pieces are skipped)."""
    cut = [
        (pid, local + at, remote + at, min(PIECE, size - at))
        for pid, local, remote, size in pieces
        for at in range(0, size, PIECE)
    ]
    failed: dict[int, str] = {}
    turns, stop = itertools.count(), threading.Event()

    def work() -> None:
        for turn in turns:  # next() on a count is atomic: each piece is taken once
            if turn >= len(cut) or stop.is_set():
                return
            piece = cut[turn]
            if piece[0] in failed:
                continue
            try:
                _copy_piece(piece, write)
            except PeerMemoryError as exc:
                failed.setdefault(piece[0], str(exc))

    helpers = [
        threading.Thread(target=work, name="jshard-copy", daemon=True)
        for _ in range(min(THREADS, len(cut)) - 1)
    ]
    for helper in helpers:
        helper.start()
    try:
        work()  # this thread copies too, and a Ctrl-C stops it between two pieces
    finally:
        stop.set()  # the helpers finish the piece they hold (a few milliseconds) and stop
        for helper in helpers:
            helper.join()
    return failed


def _check_token(target: Target) -> None:
    seen = bytearray(TOKEN_BYTES)
    failed = _copy([(target.pid, address_of(seen), target.token_address, TOKEN_BYTES)], write=False)
    if failed:
        raise PeerMemoryError(failed[target.pid])
    if bytes(seen).hex() != target.token:
        raise PeerMemoryError("the process with the rank's pid is not the rank that replied")


def read(target: Target, sizes: Sequence[int]) -> list[Any]:
    """The buffers of ``sizes`` at ``target``'s addresses, each in fresh writable memory of this
    process; a :class:`PeerMemoryError` unless ``target``'s pid holds its token."""
    if _LIBC is None:
        raise PeerMemoryError("this platform cannot read another process's memory")
    if len(target.addresses) != len(sizes) or any(s < 0 for s in sizes):
        raise PeerMemoryError("the reply's addresses and sizes do not match")
    _check_token(target)
    starts, end = _layout(sizes)
    region = _fresh(end)
    base = address_of(region) if end else 0
    pieces = [
        (target.pid, base + start, address, size)
        for address, size, start in zip(target.addresses, sizes, starts, strict=True)
        if size
    ]
    failed = _copy(pieces, write=False)
    if failed:
        raise PeerMemoryError(failed[target.pid])
    return [region[start : start + size] for start, size in zip(starts, sizes, strict=True)]


def write(targets: Sequence[Target], sources: Sequence[memoryview]) -> dict[int, str]:
    """Write ``sources`` into every target's landing, all at once; the pids that could not be
    written (their token did not match, or the copy failed), with why."""
    if _LIBC is None:
        return {t.pid: "this platform cannot write another process's memory" for t in targets}
    failed: dict[int, str] = {}
    pieces: list[_Piece] = []
    local = [address_of(s) for s in sources]
    sizes = [memoryview(s).nbytes for s in sources]
    for target in targets:
        if len(target.addresses) != len(sources):
            failed[target.pid] = "the reply's addresses and the buffers do not match"
            continue
        try:
            _check_token(target)
        except PeerMemoryError as exc:
            failed[target.pid] = str(exc)
            continue
        pieces += [
            (target.pid, here, there, size)
            for here, there, size in zip(local, target.addresses, sizes, strict=True)
            if size
        ]
    failed.update(_copy(pieces, write=True))
    return failed
