"""A pull from a rank on this machine, read straight out of the rank's memory (``process_vm_readv``).

A pull through a shared-memory segment copies twice in effect: the rank writes its tensors into the
segment's fresh pages (about 2 GB/s here), and the kernel maps them. Reading the rank's own memory
into fresh huge pages of the kernel is one copy at nearly memcpy speed. The rank answers a pull with
the addresses and sizes of its out-of-band buffers (:mod:`jupyter_shard.buffers`) and keeps them
alive until the kernel says it has read them; the kernel reads them from the pid it recorded when the
rank started, never from a pid a message names.

Why it is safe: the reply naming the addresses is signed with the pool key like every message, and
the in-band pickle in it, authenticated, alone decides what is built; what is read are raw element
bytes of the arrays it describes, of exactly the signed sizes. Before any buffer, the kernel reads a
128-bit random token from an address the same reply names and compares it: a pid reused by another
process, or a rank in another pid namespace, fails there and the pull goes through a segment
instead. The operating system lets a process read another's memory only where it could trace it (the
same user, and where Yama's ``ptrace_scope`` is 1, only its descendants: ranks spawned by the
kernel); anywhere else the read fails and the segment is used.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import sys
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["Lent", "PeerMemoryError", "address_of", "read", "supported"]

CHUNK = 64 << 20  # bytes per system call, so that a Ctrl-C is seen between them
_HUGE_OVER = 2 << 20  # destinations from this size ask for transparent huge pages
TOKEN_BYTES = 16


class PeerMemoryError(Exception):
    """The rank's memory could not be read as its reply said (then a segment is used)."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "process_vm_readv"):
        return None
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc() if sys.platform == "linux" else None


def supported() -> bool:
    return _LIBC is not None


def address_of(buffer: Any) -> int:
    """Where ``buffer`` (a contiguous buffer, possibly read-only) starts in this process."""
    import numpy as np

    view = memoryview(buffer).cast("B")
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class Lent:
    """What a rank keeps alive for the kernel to read: its buffers and a fresh token."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self.buffers = list(buffers)
        self.token = bytearray(secrets.token_bytes(TOKEN_BYTES))

    @property
    def addresses(self) -> list[int]:
        return [address_of(b) for b in self.buffers]

    @property
    def token_address(self) -> int:
        return address_of(self.token)


def _fresh(size: int) -> memoryview:
    """``size`` bytes of fresh anonymous memory (huge pages when large), freed with its last user."""
    if size < _HUGE_OVER:
        return memoryview(bytearray(size))
    assert _LIBC is not None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    address = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise MemoryError(f"no memory for {size} bytes: {os.strerror(ctypes.get_errno())}")
    _LIBC.madvise(address, size, mmap.MADV_HUGEPAGE)
    region = (ctypes.c_char * size).from_address(address)
    weakref.finalize(region, _LIBC.munmap, address, size)
    return memoryview(region).cast("B")


def _read_into(pid: int, local: int, remote: int, size: int) -> None:
    assert _LIBC is not None
    done = 0
    while done < size:
        n = min(CHUNK, size - done)
        here, there = _IoVec(local + done, n), _IoVec(remote + done, n)
        got = _LIBC.process_vm_readv(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if got <= 0:
            error = ctypes.get_errno() if got < 0 else 0
            raise PeerMemoryError(
                f"reading rank memory failed: {os.strerror(error) if error else 'short read'}"
            )
        done += got


def read(
    pid: int, addresses: Sequence[int], sizes: Sequence[int], token: str, token_address: int
) -> list[Any]:
    """The buffers at ``addresses`` in process ``pid``, each in fresh writable memory of this
    process; a :class:`PeerMemoryError` unless ``pid`` holds ``token`` at ``token_address``."""
    if _LIBC is None:
        raise PeerMemoryError("this platform cannot read another process's memory")
    if len(addresses) != len(sizes) or any(s < 0 for s in sizes):
        raise PeerMemoryError("the reply's addresses and sizes do not match")
    seen = bytearray(TOKEN_BYTES)
    _read_into(pid, address_of(seen), token_address, TOKEN_BYTES)
    if bytes(seen).hex() != token:
        raise PeerMemoryError("the process with the rank's pid is not the rank that replied")
    # One region for every buffer (a model's hundreds of parameters cost one mapping, not hundreds),
    # each buffer at a 64-byte boundary in it; the region is freed with the last value over it.
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // 64) * 64
    region = _fresh(end)
    base = address_of(region) if end else 0
    out = []
    for address, size, start in zip(addresses, sizes, starts, strict=True):
        if size:
            _read_into(pid, base + start, address, size)
        out.append(region[start : start + size])
    return out
