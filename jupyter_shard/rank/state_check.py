"""A resumed rank's check of DCP's files against the suspend's signed manifest, beside the model's build.

Why it exists: hashing gigabytes of checkpoint is most of a resume's reading, and the model can be
built and prepared meanwhile. :class:`StateCheck` checks DCP's metadata first, on every rank, from
bytes it keeps (the one file of them unpickled before the ranks agree, to allocate the optimizer's
state; it is unpickled from those same bytes, :class:`~jupyter_shard.rank.dcp_reader.DirectReader`),
and all ranks agree on it before any goes on. Then this rank's share of the data files (each file by
one rank) is hashed on a thread of its own; :meth:`StateCheck.agree` waits for it, then all ranks
agree before any loads a file: a file changed since the suspend stops every rank, each naming the
same first file. A file counts as changed until its check has passed, so a check that could not run
to its end (the thread stopped, a read failed, memory ran out) never lets the file through.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from jupyter_shard._util.digests import check_digest, digest_file_until

__all__ = ["METADATA", "StateCheck"]

METADATA = ".metadata"  # DCP's own name for its metadata file


class StateCheck:
    """See the module's docstring. ``directory`` is DCP's, ``prefix`` its name in ``digests``."""

    def __init__(self, rank: int, world_size: int, root: Path, prefix: str, digests: dict[str, str]) -> None:
        names = sorted(n for n in digests if n.startswith(f"{prefix}/"))
        meta = f"{prefix}/{METADATA}"
        self.metadata: bytes | None = None  # as checked; unpickled from these bytes only
        meta_bad = torch.zeros(1, dtype=torch.int32)
        if meta in digests:
            try:
                data = (root / meta).read_bytes()
                check_digest(data, meta, digests)
                self.metadata = data
            except (OSError, RuntimeError):
                meta_bad[0] = 1
        _all_max(meta_bad)  # every rank stops here alike, or none
        if meta_bad[0]:
            raise RuntimeError(_changed(meta))
        self.names = [n for n in names if n != meta]
        mine = [i for i in range(len(self.names)) if i % world_size == rank]
        self.bad = torch.zeros(len(self.names) + 1, dtype=torch.int32)
        self.bad[mine] = 1  # changed until its check passes
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(mine, root, digests), name="jupyter_shard-check", daemon=True
        )
        self.thread.start()

    def _run(self, mine: list[int], root: Path, digests: dict[str, str]) -> None:
        for i in mine:
            try:
                found = _digest(root / self.names[i], self._stop)
            except BaseException:  # (stays changed)
                found = None
            if found is None:
                return  # stopped, or unreadable: it and the rest stay changed
            if found == digests.get(self.names[i]):
                self.bad[i] = 0

    def stop(self) -> None:
        """Stop hashing (a resume that failed before :meth:`agree`): the rest counts as changed."""
        self._stop.set()

    def agree(self) -> None:
        """Wait for this rank's checks, then raise on every rank if any rank found a file changed."""
        self.thread.join()
        _all_max(self.bad)
        first = next((self.names[i] for i in range(len(self.names)) if self.bad[i]), None)
        if first is not None:
            raise RuntimeError(_changed(first))


def _digest(path: Path, stop: threading.Event) -> str | None:
    """SHA-256 of a file, or None if ``stop`` was set or it could not be read."""
    try:
        return digest_file_until(path, stop)
    except OSError:
        return None


def _all_max(flags: torch.Tensor) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)


def _changed(name: str) -> str:
    return (
        f"{name} of this suspend does not match its signed manifest (changed after the suspend, or "
        "missing); nothing was loaded from it"
    )
