"""Memory mappings that Python's ``mmap`` module does not give: a region freed with the last object
over it, with no file descriptor kept open per mapping, and anonymous memory asked for as
transparent huge pages (:mod:`.segments` maps a transfer's memfd; :mod:`.peer_memory` fills fresh
memory)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref
from typing import Any

__all__ = ["MappingError", "libc", "mapped"]


class MappingError(OSError):
    """The system refused the mapping."""


def _load() -> Any:
    found = ctypes.CDLL(None, use_errno=True)
    found.mmap.restype = ctypes.c_void_p
    found.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    found.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    found.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return found


libc: Any = _load() if sys.platform == "linux" else None


def mapped(size: int, *, fd: int = -1, offset: int = 0, huge: bool = False) -> memoryview:
    """``size`` writable bytes: of ``fd`` from ``offset``, copy-on-write, or (``fd`` -1) fresh
    anonymous memory, as huge pages when ``huge``; unmapped when the last object over the view is gone."""
    if libc is None:
        raise MappingError("memory mappings need Linux here")
    flags = mmap.MAP_PRIVATE | (mmap.MAP_ANONYMOUS if fd < 0 else 0)
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
    if address in (None, ctypes.c_void_p(-1).value):
        raise MappingError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    if huge:
        libc.madvise(address, size, mmap.MADV_HUGEPAGE)
    region = (ctypes.c_char * size).from_address(address)
    weakref.finalize(region, libc.munmap, address, size)
    return memoryview(region).cast("B")
