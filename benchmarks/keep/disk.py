"""The disk's own rate, measured in the same run as the suspend and resume it is compared with.

Writing: ``writers`` processes (as many as the suspending ranks) each write their share of ``total``
bytes to a file in the suspend's directory's file system, in 16 MiB pieces, and fsync it; the rate is
all the bytes over the wall time from the first start to the last fsync. Reading: the same files,
evicted from the page cache first (``posix_fadvise(DONTNEED)`` after the fsync), read back by as many
processes, each into one 16 MiB buffer it reuses; and again into fresh memory, a buffer of the file's
size allocated first and never written before, as a load must place what it reads (a process's
memory is mapped on its first write, page by page; on a virtual machine that can cost more than the
disk). :func:`evict` does the same to a suspend's files before a resume is timed, so that both
read from the disk.

Each read also says how much CPU it took (all its processes together, per GB), and :func:`check_cost`
what the other two things a resume's load must do to each byte cost in CPU: its SHA-256, against the
signed manifest, and the first write of the fresh memory it lands in. Together they bound a load: no
loader that reads, checks and places every byte on this machine's cores can be faster than
:func:`ceiling`.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["ceiling", "check_cost", "evict", "read_cost", "write_rate"]

PIECE = 16 << 20

_WRITE = """
import os, sys
path, size, piece = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = os.urandom(piece)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
left = size
while left > 0:
    left -= os.write(fd, memoryview(data)[: min(piece, left)])
os.fsync(fd)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)
"""
_READ = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
while os.read(fd, int(sys.argv[2])):
    pass
os.close(fd)
"""


def _run_all(argvs: list[list[str]]) -> float:
    began = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", *argv]) for argv in argvs]
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"a disk measurement process failed ({proc.returncode})")
    return time.perf_counter() - began


def write_rate(directory: Path, total: int, writers: int) -> tuple[float, list[Path]]:
    """(bytes per second, the files written) for ``writers`` processes writing ``total`` bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    share = total // writers
    paths = [directory / f"disk-rate-{i}.bin" for i in range(writers)]
    seconds = _run_all([[_WRITE, str(p), str(share), str(PIECE)] for p in paths])
    return share * writers / seconds, paths


_READ_FRESH = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
out = memoryview(mmap.mmap(-1, max(size, 1)))  # anonymous memory, not yet written
got = 0
while got < size:
    got += os.readv(fd, [out[got : min(size, got + int(sys.argv[2]))]])
os.close(fd)
"""


def read_cost(paths: list[Path], fresh: bool = False) -> tuple[float, float]:
    """(bytes per second, CPU seconds per GB, user and system, of all the readers) reading ``paths`` back
    from the disk, one process each; with ``fresh``, into memory not written before (see above). The CPU
    the readers' interpreters take to start and end (as many doing nothing) is left out."""
    evict(paths)
    total = sum(p.stat().st_size for p in paths)
    idle, _ = _children_cpu(lambda: _run_all([["pass"] for _ in paths]))
    used, seconds = _children_cpu(
        lambda: _run_all([[_READ_FRESH if fresh else _READ, str(p), str(PIECE)] for p in paths])
    )
    return total / seconds, max(0.0, used - idle) / (total / 1e9)


def _children_cpu(run: Callable[[], float]) -> tuple[float, float]:
    """(CPU seconds of the child processes ``run`` waited for, what ``run`` returned)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = run()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), result


def check_cost(size: int = 512 << 20, repeats: int = 3) -> tuple[float, float]:
    """CPU seconds per GB, least over ``repeats``, of the project's own SHA-256 of a suspend's bytes
    (:func:`jupyter_shard._util.digests.digest_bytes`) and of its first write of fresh memory
    (:func:`jupyter_shard.rank.dcp_reader.touch` of a tensor just allocated), on this thread, with torch
    on one thread too (as a rank is where there are as many ranks as cores), so that no CPU is left out."""
    import torch

    from jupyter_shard._util.digests import digest_bytes
    from jupyter_shard.rank.dcp_reader import touch

    data = os.urandom(1 << 20) * (size >> 20)
    hashing: list[float] = []
    placing: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            began = time.thread_time()
            digest_bytes(data)
            hashing.append(time.thread_time() - began)
            began = time.thread_time()
            fresh = torch.empty(size, dtype=torch.uint8)
            touch(fresh)
            placing.append(time.thread_time() - began)  # (before the memory is let go)
            del fresh
    finally:
        torch.set_num_threads(threads)
    return min(hashing) / (size / 1e9), min(placing) / (size / 1e9)


def ceiling(read_cpu: float, hash_cpu: float, place_cpu: float, cores: int) -> float:
    """Bytes per second that a load paying these CPU seconds per GB (read from the disk with ``read``,
    hashed with SHA-256, written into fresh 4 KiB pages) cannot pass on ``cores`` cores, even with every
    core busy all the time and the three costs overlapping perfectly."""
    return cores / (read_cpu + hash_cpu + place_cpu) * 1e9


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (they are on the disk: written and synced)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
