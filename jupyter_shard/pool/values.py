"""Moving Python values between the kernel and the ranks: ``push`` and ``pull``.

A value travels as an in-band pickle, in the signed message, and out-of-band buffers: views of its
arrays' and tensors' memory (:mod:`jupyter_shard.transfer.pickling`). Between the kernel and ranks on this
machine the kernel copies the buffers straight into or out of the rank's memory
(:mod:`jupyter_shard.transfer.peer_memory`, which says why that is safe); where it may not, through one
shared-memory segment (:mod:`jupyter_shard.transfer.segments`); to ranks elsewhere, where a rank cannot reach
the segment, or with ``JUPYTER_SHARD_SHARED_MEMORY=0``, they follow the pickle as message frames.
Nothing is unpickled before its message was authenticated.

A pushed value is also kept in the pool's transcript for ``%dist_export``: as bytes when small, by
reference when large (pickling a 1 GiB tensor again would double the push's time and memory).
"""

from __future__ import annotations

import io
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jupyter_shard._util.units import format_bytes
from jupyter_shard.env import SHARED_MEMORY_VAR
from jupyter_shard.errors import PoolError
from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.ranks import RankRecord, RankTable
from jupyter_shard.pool.transcript import Held, PushEntry, Transcript
from jupyter_shard.spec import format_ranks
from jupyter_shard.transfer import peer_memory, pickling, segments
from jupyter_shard.transfer.pickling import Packed
from jupyter_shard.wire.messages import PULL, PUSH, PullBody, PushBody
from jupyter_shard.wire.protocol import MAX_FRAME, Message

__all__ = ["SEGMENT_OVER", "Transfer", "Values"]

SEGMENT_OVER = 1 << 20  # out-of-band bytes from which a local transfer goes through shared memory
CHUNK = 16 << 20  # bytes per part of a transfer in parts (to or from ranks on other machines)
_RECORD_UP_TO = 16 << 20  # values up to this size are recorded for %dist_export as bytes
_SECONDS_PER_BYTE = 1 / 50e6  # request timeouts allow this, past their base, for big values
# a rank lets go of what it lent or offered for the last transfer (no reply)
_RELEASE = {"name": "", "gather": False, "release": True, "req_id": "release"}


@dataclass(frozen=True)
class Transfer:
    """The last push or pull: what moved, how, and how long it took (``gather``: the all-gather)."""

    kind: str  # "push" or "pull"
    nbytes: int  # to each rank (push) or from the ranks together (pull)
    ranks: int
    seconds: float
    path: str  # how: "segment", "direct" (read from the rank's memory), "messages", or several joined by +
    gather: float = 0.0

    @property
    def shared(self) -> bool:
        """Whether it all went through shared memory (no message carried the data)."""
        return bool(self.path) and "messages" not in self.path

    @property
    def rate(self) -> float:
        """Bytes per second, counted over every rank (a push to 4 ranks moves 4 copies)."""
        moved = self.nbytes * (self.ranks if self.kind == "push" else 1)
        return moved / self.seconds if self.seconds > 0 else 0.0


class Values:
    """Push and pull through the pool's connection."""

    def __init__(self, conn: Connection, ranks: RankTable, transcript: Transcript) -> None:
        self.conn = conn
        self.ranks = ranks
        self.transcript = transcript
        self.last: Transfer | None = None

    def push(self, ranks: Sequence[int] | None, values: Mapping[str, Any]) -> int:
        """Copy ``values`` to every rank (or ``ranks``) under their names; the bytes sent to each."""
        started = time.perf_counter()
        names = list(values)
        packs = [_packed(n, values[n]) for n in names]
        size = sum(p.nbytes for p in packs)
        targets = self.ranks.targets(ranks)
        bulk = sum(sum(p.sizes) for p in packs)  # the out-of-band bytes, to each rank
        local = _local(targets) if bulk >= SEGMENT_OVER else []
        errors: dict[int, str] = {}
        inline = [r for r in targets if r not in local]
        paths: list[str] = []
        if local:
            # a copy for each rank when they take at most 3/4 of the free memory, else one
            # copy-on-write segment the ranks share (each still owns its value: a page one writes
            # becomes its own)
            room = _check_memory(names, bulk) * 3 // 4
            if peer_memory.supported() and len(local) * bulk <= room:
                written, local = self._push_direct(names, packs, local, errors)
                paths += ["direct"] if written else []
            if local:
                inline += self._push_shared(names, packs, local, errors)
                paths.append("segment")
        if inline:
            self._push_inline(names, packs, inline, errors)
        if errors:
            raise PoolError(
                "push failed on " + "; ".join(f"rank {k}: {e}" for k, e in sorted(errors.items()))
            )
        if not names[0].startswith("_js_"):  # the pool's own pushes are not the user's work
            asked = None if ranks is None else tuple(sorted(set(ranks)))
            recorded = tuple((n, _recorded(values[n], p)) for n, p in zip(names, packs, strict=True))
            self.transcript.add(PushEntry(recorded, asked))
        path = "+".join(sorted(set(paths + (["messages"] if inline else []))))
        self.last = Transfer("push", size, len(targets), time.perf_counter() - started, path)
        return size

    def _push_direct(
        self, names: list[str], packs: list[Packed], targets: list[RankRecord], errors: dict[int, str]
    ) -> tuple[list[RankRecord], list[RankRecord]]:
        """Push by writing into memory each rank offers (:mod:`jupyter_shard.transfer.peer_memory`); the
        ranks written, and those that could not be (to be pushed through a segment)."""
        oob = [b for p in packs for b in p.buffers]
        body: PushBody = {
            "names": names,
            "counts": [len(p.buffers) for p in packs],
            "sizes": [b.nbytes for b in oob],
        }
        offers = self._request(PUSH({**body, "land": True}), targets, [], 0)
        errors.update(_failures(offers, targets, "push"))
        offered = [r for r in targets if r.rank in offers and "addresses" in offers[r.rank].body]
        try:
            failed = peer_memory.write([_target(r, offers[r.rank].body) for r in offered], oob)
        except BaseException:  # an interrupt: the ranks let their half-written landings go
            if self.conn.open:
                self.conn.send(offered, PULL, _RELEASE)
            raise
        written = [r for r in offered if r.handle.pid not in failed]
        if written:
            replies = self._request(PUSH({**body, "landed": True}), written, [p.inband for p in packs], 0)
            errors.update(_failures(replies, written, "push"))
        return written, [r for r in targets if r.rank not in errors and r not in written]

    def _push_shared(
        self, names: list[str], packs: list[Packed], targets: list[RankRecord], errors: dict[int, str]
    ) -> list[RankRecord]:
        """Push through one segment; the ranks that could not reach it (to be sent inline)."""
        oob = [b for p in packs for b in p.buffers]
        with segments.Segment() as segment:
            segment.fill(oob)
            body: PushBody = {
                "names": names,
                "counts": [len(p.buffers) for p in packs],
                "segment": segment.ref,
                "sizes": [b.nbytes for b in oob],
            }
            replies = self._request(
                PUSH(body), targets, [p.inband for p in packs], sum(b.nbytes for b in oob)
            )
        fallback = []
        for r in targets:
            msg = replies.get(r.rank)
            if msg is not None and not msg.body["ok"] and msg.body["error"].startswith(segments.UNAVAILABLE):
                fallback.append(r)
            else:
                errors.update(_failures({r.rank: msg} if msg else {}, [r], "push"))
        return fallback

    def _push_inline(
        self, names: list[str], packs: list[Packed], targets: list[RankRecord], errors: dict[int, str]
    ) -> None:
        """Push in the messages: at once when small, else in parts of :data:`CHUNK` bytes, each
        acknowledged before the next is sent, so neither end holds more than a part in flight."""
        for name, pack in zip(names, packs, strict=True):
            if len(pack.inband) > MAX_FRAME:
                raise PoolError(
                    f"{name!r} pickles to over {MAX_FRAME // 2**20} MiB of plain Python objects; save it "
                    "to a file and load it on the ranks, or push it as arrays or tensors"
                )
        oob = [b for p in packs for b in p.buffers]
        sizes, inbands = [b.nbytes for b in oob], [p.inband for p in packs]
        body: PushBody = {"names": names, "counts": [len(p.buffers) for p in packs], "sizes": sizes}
        if sum(sizes) <= CHUNK:
            replies = self._request(PUSH(body), targets, [*inbands, *oob], sum(p.nbytes for p in packs))
            errors.update(_failures(replies, targets, "push"))
            return
        live, stream = list(targets), uuid.uuid4().hex
        for offset in range(0, sum(sizes), CHUNK):
            part = pickling.pieces(oob, offset, min(CHUNK, sum(sizes) - offset))
            replies = self._request(PUSH({**body, "stream": stream, "offset": offset}), live, part, CHUNK)
            errors.update(_failures(replies, live, "push"))
            live = [r for r in live if r.rank not in errors]
            if not live:
                return
        replies = self._request(PUSH({**body, "stream": stream, "final": True}), live, inbands, CHUNK)
        errors.update(_failures(replies, live, "push"))

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
        started = time.perf_counter()
        targets = self.ranks.targets(ranks)
        owned = {r.rank: segments.Segment() for r in _local(targets)}
        lent: list[RankRecord] = []
        out: dict[int, Any] = {}
        paths: set[str] = set()
        nbytes, gather = 0, 0.0
        try:
            if owned:
                body["segments"] = {str(k): s.ref for k, s in owned.items()}
                body["direct"] = peer_memory.supported()
            body["stream"] = True
            replies = self.conn.request(*PULL(body), targets, timeout=600.0)
            for k, msg in sorted(replies.items()):
                if not msg.body["ok"]:
                    raise PoolError(msg.body["error"])
                if "addresses" in msg.body or msg.body.get("streamed"):
                    lent.append(self.ranks[k])
                try:
                    oob, path = self._buffers_of(self.ranks[k], msg, owned.get(k))
                    out[k] = pickling.loads(msg.buffers[0], oob)
                except PoolError:
                    raise
                except Exception as exc:
                    raise PoolError(
                        f"the value from rank {k} could not be rebuilt ({type(exc).__name__}: {exc}); "
                        "the pool is unchanged, try the pull again"
                    ) from None
                paths.add(path)
                nbytes += len(msg.buffers[0]) + sum(int(n) for n in msg.body.get("sizes", []))
                gather = max(gather, float(msg.body.get("seconds", 0.0)))
        finally:
            if lent and self.conn.open:  # the ranks may let go of what they lent
                self.conn.send(lent, PULL, _RELEASE)
            for segment in owned.values():
                segment.close()
        missing = sorted({r.rank for r in targets} - set(out))
        if missing:
            dead = [r.rank for r in targets if r.dead and r.rank in missing]
            if dead:  # the others were cut short by the death, not silent
                raise PoolError(f"rank {format_ranks(dead)} died before it answered the pull of {what}")
            raise PoolError(f"rank {format_ranks(missing)} did not answer the pull of {what}")
        seconds = time.perf_counter() - started
        path = "+".join(sorted(paths))
        self.last = Transfer("pull", nbytes, len(targets), seconds, path, gather if body["gather"] else 0.0)
        return out

    def _buffers_of(
        self, r: RankRecord, msg: Message, segment: segments.Segment | None
    ) -> tuple[list[Any], str]:
        """The out-of-band buffers of rank ``r``'s pull reply ``msg`` and how they came: read from
        the rank's memory, from ``segment`` or in the message."""
        sizes = [int(s) for s in msg.body.get("sizes", [])]
        if not msg.buffers:
            raise ValueError("the reply carries no pickle")
        if "addresses" in msg.body:
            body = msg.body
            _check_room(sum(sizes))
            try:
                return peer_memory.read(_target(r, body), sizes), "direct"
            except peer_memory.PeerMemoryError:
                if segment is None:
                    raise
            resend = PULL(
                {"name": "", "gather": False, "resend": True, "segments": {str(r.rank): segment.ref}}
            )
            again = self.conn.request(*resend, [r], timeout=600.0).get(r.rank)
            if again is None or not again.body["ok"]:
                raise PoolError(
                    f"rank {r.rank} could not resend its value: "
                    + (str(again.body["error"]) if again else "it did not answer")
                )
            return segment.seal_and_map(sizes), "segment"
        if msg.body.get("in_segment"):
            if segment is None:
                raise segments.SegmentError("it names a segment that was never offered")
            return segment.seal_and_map(sizes), "segment"
        if msg.body.get("streamed"):
            return self._read_in_parts(r, sizes), "messages"
        oob = [bytearray(b) for b in msg.buffers[1:]]
        if [len(b) for b in oob] != sizes:
            raise segments.SegmentError("its buffers are not the sizes it signed")
        return oob, "messages"

    def _read_in_parts(self, r: RankRecord, sizes: list[int]) -> list[Any]:
        """The buffers rank ``r`` lent, read in parts of :data:`CHUNK` bytes (a rank elsewhere)."""
        _check_room(sum(sizes))
        assembly = pickling.Assembly(sizes)
        for offset in range(0, sum(sizes), CHUNK):
            length = min(CHUNK, sum(sizes) - offset)
            part = PULL({"name": "", "gather": False, "chunk": [offset, length]})
            reply = self.conn.request(*part, [r], timeout=60.0 + CHUNK * _SECONDS_PER_BYTE).get(r.rank)
            if reply is None or not reply.body["ok"]:
                why = str(reply.body["error"]) if reply is not None else "it did not answer"
                raise PoolError(f"rank {r.rank} stopped sending its value at byte {offset}: {why}")
            assembly.add(offset, reply.buffers)
        if not assembly.complete:
            raise PoolError(f"rank {r.rank}'s value came short")
        return assembly.buffers

    def _request(
        self, message: tuple[str, dict[str, Any]], targets: list[RankRecord], frames: list[Any], size: int
    ) -> dict[int, Message]:
        return self.conn.request(*message, targets, buffers=frames, timeout=60.0 + size * _SECONDS_PER_BYTE)


Namespace = Mapping[str, Any] | None  # what ``Pool.push`` may be given besides keywords


def named_values(namespace: Namespace, values: Mapping[str, Any]) -> dict[str, Any]:
    """What ``Pool.push`` was given (a dict as ipyparallel's ``view.push``, keywords), as one dict of
    names; a name that is not one is refused."""
    if namespace is not None and not isinstance(namespace, Mapping):
        raise TypeError(
            "push takes its values by name: pool.push(x=value) or pool.push({'x': value}); "
            "the ranks to push to go in ranks=[...]"
        )
    named = {**(namespace or {}), **values}
    bad = [repr(n) for n in named if not (isinstance(n, str) and n.isidentifier())]
    if bad:
        raise PoolError(f"cannot push under {', '.join(bad)}: each name must be a Python identifier")
    return named


def _local(targets: list[RankRecord]) -> list[RankRecord]:
    """The targets on this machine, which can share memory with the kernel."""
    if not segments.supported() or os.environ.get(SHARED_MEMORY_VAR) == "0":
        return []
    here = socket.gethostname()
    return [r for r in targets if r.handle.host == here]


def _failures(replies: Mapping[int, Message], targets: list[RankRecord], what: str) -> dict[int, str]:
    errors = {k: str(m.body["error"]) for k, m in replies.items() if not m.body["ok"]}
    for r in targets:
        if r.rank not in replies:
            errors[r.rank] = f"did not answer the {what}" + (f" ({r.exit})" if r.exit else "")
    return errors


def _check_memory(names: list[str], need: int) -> int:
    """Refuse a push of ``need`` bytes the machine has no memory for, before anything is written;
    the bytes free."""
    import psutil

    free = int(psutil.virtual_memory().available)
    if need > free:
        raise PoolError(
            f"pushing {', '.join(names)} needs {format_bytes(need)} of shared memory and "
            f"{format_bytes(free)} is free; push smaller pieces, or save it to a file and load it "
            "on the ranks"
        )
    return free


def _target(r: RankRecord, body: Mapping[str, Any]) -> peer_memory.Target:
    """Rank ``r``'s memory as its signed reply ``body`` names it, in the pid recorded at its start."""
    addresses = [int(a) for a in body["addresses"]]
    return peer_memory.Target(r.handle.pid, addresses, str(body["token"]), int(body["token_address"]))


def _check_room(nbytes: int) -> None:
    """Refuse a pulled value this machine has no memory for, before any of it is read."""
    import psutil

    free = psutil.virtual_memory().available
    if nbytes > free:
        raise PoolError(
            f"the value is {format_bytes(nbytes)} and the kernel's machine has {format_bytes(free)} "
            "free; pull a part of it, or save it to a file on the ranks"
        )


def _recorded(value: Any, pack: Packed) -> bytes | Held:
    """What the transcript keeps of a pushed value: its bytes, or the value itself when large."""
    held = Held(value)
    return held if pack.nbytes > _RECORD_UP_TO else held.pickled()


def _packed(name: str, value: Any) -> Packed:
    """``value`` pickled for the ranks, or a :class:`PoolError` naming ``name`` and what to do."""
    if isinstance(value, io.IOBase):  # cloudpickle would send a StringIO copy of an open text file
        raise PoolError(
            f"{name!r} is an open file, which cannot be sent to the ranks: push its path and open "
            "it in a %%distributed cell"
        )
    try:
        return pickling.dumps(value)
    except Exception as exc:
        raise PoolError(
            f"{name!r} could not be pickled ({type(exc).__name__}: {exc}): create it on the ranks in "
            "a %%distributed cell, or push what it is made from"
        ) from None
