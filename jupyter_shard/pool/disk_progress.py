"""One live line while a suspend writes or a resume reads: bytes so far, the rate, and the spread
over the ranks (``suspending: 2.31 GiB written, 0.61 GiB/s, 4 s; per rank 578–592 MiB; Ctrl-C
stops it``).

A thread in the kernel samples every half second while the ranks work: a suspend counts the bytes in
each rank's files of the temporary directory (``namespace-R.pkl`` and DCP's ``__R_*.distcp``); a
resume counts the bytes each local rank has read since it began (``rchar`` of ``/proc/PID/io``) out
of what it is expected to read: each of DCP's files twice (its digest checked, then loaded) and the
rest once. A resume at another world size may read more (slices of a file by several ranks); past
the expected total, the line shows the bytes alone. Nothing is shown for work that ends within
:data:`QUIET_FOR` seconds, and the line is cleared when the work ends (the summary that follows says
how long it took). ``JUPYTER_SHARD_PROGRESS=0`` turns it off (:func:`jupyter_shard.env.progress_lines`).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TextIO

from jupyter_shard.env import progress_lines

__all__ = ["DiskProgress", "bytes_read", "bytes_written"]

QUIET_FOR = 2.0  # seconds before the line appears
EVERY = 0.5  # seconds between samples
_RANK_FILE = re.compile(r"^(?:namespace-(\d+)\.pkl|__(\d+)_\d+\.distcp)$")


def bytes_written(root: Path) -> dict[int, int]:
    """Bytes in each rank's files under ``root`` (its namespace and its DCP files) so far."""
    sizes: dict[int, int] = {}
    for directory in (root, root / "state"):
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            found = _RANK_FILE.match(entry.name)
            if found is None:
                continue
            rank = int(found.group(1) or found.group(2))
            try:
                sizes[rank] = sizes.get(rank, 0) + entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return sizes


def bytes_read(pids: dict[int, int]) -> Callable[[], dict[int, int]]:
    """A sampler of the bytes each rank (rank -> pid, local ones) has read since now."""
    start = {rank: _rchar(pid) for rank, pid in pids.items()}

    def sample() -> dict[int, int]:
        now = {rank: _rchar(pid) for rank, pid in pids.items()}
        return {rank: max(0, now[rank] - start[rank]) for rank in pids if now[rank] >= 0 <= start[rank]}

    return sample


def _rchar(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io") as fh:
            for line in fh:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


class DiskProgress:
    """The live line, from a thread, while the ``with`` block runs."""

    def __init__(
        self,
        doing: str,
        done: str,
        sample: Callable[[], dict[int, int]],
        total: int | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.doing, self.done, self.sample, self.total = doing, done, sample, total
        self.out = out if out is not None else sys.stderr  # the cell's stream, taken on this thread
        self.shown = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jupyter_shard-disk-progress", daemon=True)
        self._started = 0.0

    def __enter__(self) -> DiskProgress:
        self._started = time.monotonic()
        if progress_lines():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.shown:
            self._write("\r" + " " * self.shown + "\r")
            self.shown = 0

    def _run(self) -> None:
        while not self._stop.wait(EVERY):
            elapsed = time.monotonic() - self._started
            if elapsed < QUIET_FOR:
                continue
            try:
                sizes = self.sample()
            except Exception:  # a sample that fails shows nothing; the work goes on
                continue
            text = line(self.doing, self.done, sizes.values(), elapsed, self.total)
            self._write("\r" + text.ljust(self.shown))
            self.shown = len(text)

    def _write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            pass


def line(doing: str, done: str, sizes: Iterable[int], elapsed: float, total: int | None) -> str:
    """``suspending: 2.31 GiB written, 0.61 GiB/s, 4 s; per rank 578–592 MiB; Ctrl-C stops it``."""
    per_rank = sorted(sizes)
    amount = sum(per_rank)
    of = f" of {_size(total)}" if total and amount <= total else ""  # past it (a resharding resume): none
    rate = f"{_size(amount / elapsed)}/s" if elapsed > 0 else ""
    spread = ""
    if len(per_rank) > 1:
        low, high = _size(per_rank[0]), _size(per_rank[-1])
        if low.split()[1] == high.split()[1]:  # one unit for both
            low = low.split()[0]
        spread = f"; per rank {high}" if low == high.split()[0] else f"; per rank {low}–{high}"
    return f"{doing}: {_size(amount)}{of} {done}, {rate}, {elapsed:.0f} s{spread}; Ctrl-C stops it"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"
