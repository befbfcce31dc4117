"""Moving Python values between the kernel and the ranks: ``push`` and ``pull``.

Values travel pickled (cloudpickle) as message buffers, one per value, and are unpickled only after
the message was authenticated. A pushed value is also kept in the pool's transcript, so that
``%dist_export`` can write it out for the script.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from jupyter_shard.errors import PoolError
from jupyter_shard.kernel.connection import Connection
from jupyter_shard.kernel.ranks import RankTable
from jupyter_shard.kernel.transcript import PushEntry, Transcript
from jupyter_shard.messages import PULL, PUSH, PullBody
from jupyter_shard.protocol import MAX_FRAME
from jupyter_shard.spec import format_ranks

__all__ = ["Values"]


class Values:
    """Push and pull through the pool's connection."""

    def __init__(self, conn: Connection, ranks: RankTable, transcript: Transcript) -> None:
        self.conn = conn
        self.ranks = ranks
        self.transcript = transcript

    def push(self, ranks: Sequence[int] | None, values: Mapping[str, Any]) -> int:
        """Copy ``values`` to every rank (or ``ranks``) under their names; the bytes sent to each."""
        names = list(values)
        buffers = [_pickled(n, values[n]) for n in names]
        too_big = [n for n, b in zip(names, buffers, strict=True) if len(b) > MAX_FRAME]
        if too_big:
            raise PoolError(
                f"{too_big[0]!r} is over the {MAX_FRAME // 2**20} MiB message limit; "
                "save it to a file and load it on the ranks"
            )
        targets = self.ranks.targets(ranks)
        replies = self.conn.request(*PUSH({"names": names}), targets, buffers=buffers, timeout=60.0)
        errors = [f"rank {k}: {m.body['error']}" for k, m in sorted(replies.items()) if not m.body["ok"]]
        if errors:
            raise PoolError("push failed on " + "; ".join(errors))
        if not names[0].startswith("_js_"):  # the pool's own pushes are not the user's work
            asked = None if ranks is None else tuple(sorted(set(ranks)))
            self.transcript.add(PushEntry(tuple(zip(names, buffers, strict=True)), asked))
        return sum(len(b) for b in buffers)

    def pull(
        self, name: str, ranks: Sequence[int] | None, gather: bool, device: bool = False
    ) -> dict[int, Any]:
        """Copies of ``name`` from ``ranks`` (default all), by rank; ``gather``: the unsharded model;
        ``device``: tensors stay on the rank's device (else they leave the rank on the CPU, so the
        kernel never creates a CUDA context)."""
        return self._pull({"name": name, "gather": gather, "device": device}, ranks, repr(name))

    def pull_last(self, ranks: Sequence[int], limit: int | None = None) -> dict[int, Any]:
        """Copies of the value each of ``ranks`` gave its last cell (its last expression), tensors on
        the CPU; ``limit``: a value that pickles to more bytes is refused (a :class:`PoolError`)."""
        if not ranks:
            return {}
        body: PullBody = {"name": "", "gather": False, "last": True}
        if limit is not None:
            body["limit"] = limit
        return self._pull(body, ranks, "the last value")

    def _pull(self, body: PullBody, ranks: Sequence[int] | None, what: str) -> dict[int, Any]:
        import cloudpickle

        targets = self.ranks.targets(ranks)
        replies = self.conn.request(*PULL(body), targets, timeout=600.0)
        out: dict[int, Any] = {}
        for k, msg in sorted(replies.items()):
            if not msg.body["ok"]:
                raise PoolError(msg.body["error"])
            out[k] = cloudpickle.loads(msg.buffers[0])
        missing = sorted({r.rank for r in targets} - set(out))
        if missing:
            raise PoolError(f"rank {format_ranks(missing)} did not answer the pull of {what}")
        return out


def _pickled(name: str, value: Any) -> bytes:
    """``value`` pickled for the ranks, or a :class:`PoolError` naming ``name`` and what to do."""
    import cloudpickle

    if isinstance(value, io.IOBase):  # cloudpickle would send a StringIO copy of an open text file
        raise PoolError(
            f"{name!r} is an open file, which cannot be sent to the ranks: push its path and open "
            "it in a %%distributed cell"
        )
    try:
        return bytes(cloudpickle.dumps(value))
    except Exception as exc:
        raise PoolError(
            f"{name!r} could not be pickled ({type(exc).__name__}: {exc}): create it on the ranks in "
            "a %%distributed cell, or push what it is made from"
        ) from None
