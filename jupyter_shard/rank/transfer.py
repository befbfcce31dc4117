"""A rank's end of ``push`` and ``pull``: values built from, and sent as, in-band pickles and
out-of-band buffers (:mod:`jupyter_shard.transfer.pickling`).

- A pushed value's buffers are written by the kernel into fresh memory the rank offers when asked
  (``land``; :mod:`jupyter_shard.transfer.peer_memory`), else come through the kernel's shared-memory segment
  (:mod:`jupyter_shard.transfer.segments`), else in the message.
- A pulled value's buffers are lent to the kernel to read from this process's memory when it asks for
  that, else written into the segment it offers, else sent in the message.

What is lent or offered is kept until the kernel says it is done, or the next push or pull.

Every check here answers a message that was already authenticated with the pool key; a malformed or
oversized transfer is refused with a reply that says why, and the rank goes on."""

from __future__ import annotations

import sys
from typing import Any

from jupyter_shard.transfer import peer_memory, pickling, segments
from jupyter_shard.wire.messages import PullReply, PushReply
from jupyter_shard.wire.protocol import MAX_FRAME, Message

__all__ = ["chunk_reply", "landing_reply", "pulled_reply", "pushed_values", "release", "resent_reply"]

SEGMENT_OVER = 1 << 20  # out-of-band bytes from which a pull goes through shared memory
CHUNK = 16 << 20  # bytes per part of a transfer in parts (the kernel's pushes use the same)

_lent: peer_memory.Lent | None = None  # what the kernel may be reading out of this process
_landing: peer_memory.Lent | None = None  # fresh memory the kernel may be writing a push into
_incoming: tuple[str, pickling.Assembly] | None = None  # a push in parts: its id and what came


def release() -> None:
    """The kernel is done with what it was lent or offered (or a new transfer began): let it go."""
    global _lent, _landing
    _lent = _landing = None


def landing_reply(msg: Message) -> PushReply:
    """Fresh memory for the push ``msg`` announces, offered for the kernel to write into; a reply
    without addresses where this process cannot offer it (the kernel then uses a segment)."""
    global _landing
    release()
    reply: PushReply = {"req_id": str(msg.body["req_id"]), "ok": True, "error": ""}
    if not peer_memory.supported():
        return reply
    try:
        sizes = [int(s) for s in msg.body["sizes"]]
        if min(sizes, default=0) < 0:
            raise ValueError("malformed push: a buffer size below zero")
        _check_room(sum(sizes))
        _landing = peer_memory.landing(sizes)
    except (ValueError, MemoryError) as exc:
        reply["ok"], reply["error"] = False, f"{type(exc).__name__}: {exc}"
        return reply
    reply["addresses"], reply["token"] = _landing.addresses, _landing.token.hex()
    reply["token_address"] = _landing.token_address
    return reply


def pushed_values(msg: Message) -> dict[str, Any]:
    """The values a ``push`` carries, by name (none for a part of a push in parts); a ``ValueError``
    (or :class:`~.segments.SegmentError`) for one that does not hold together."""
    global _incoming
    landed = _landing
    release()
    body = msg.body
    names = [str(n) for n in body["names"]]
    counts = [int(c) for c in body["counts"]]
    if "stream" in body and not body.get("final"):
        stream, sizes = str(body["stream"]), [int(n) for n in body["sizes"]]
        if _incoming is None or _incoming[0] != stream:
            _check_room(sum(sizes))
            _incoming = (stream, pickling.Assembly(sizes))
        _incoming[1].add(int(body["offset"]), msg.buffers)
        return {}
    if len(counts) != len(names) or len(msg.buffers) < len(names) or min(counts, default=0) < 0:
        raise ValueError("malformed push: its names, counts and buffers do not match")
    inbands = msg.buffers[: len(names)]
    if "stream" in body:
        incoming, _incoming = _incoming, None
        if incoming is None or incoming[0] != body["stream"] or not incoming[1].complete:
            raise ValueError("a push in parts ended before all its parts came")
        oob: list[Any] = incoming[1].buffers
    elif body.get("landed"):
        if landed is None or [b.nbytes for b in landed.buffers] != [int(s) for s in body["sizes"]]:
            raise ValueError("a push names memory this rank did not offer for it")
        oob = landed.buffers
    elif "segment" in body:
        sizes = [int(s) for s in body["sizes"]]
        with segments.opened(body["segment"]) as fd:
            oob = segments.map_buffers(fd, sizes)
    else:
        oob = [bytearray(b) for b in msg.buffers[len(names) :]]  # writable, as the sender's were
    if sum(counts) != len(oob):
        raise ValueError(f"malformed push: {sum(counts)} buffers announced, {len(oob)} came")
    values, start = {}, 0
    for name, inband, count in zip(names, inbands, counts, strict=True):
        values[name] = pickling.loads(inband, oob[start : start + count])
        start += count
    return values


def pulled_reply(msg: Message, rank: int, what: str, value: Any, limit: int) -> tuple[PullReply, list[Any]]:
    """The reply to a ``pull`` of ``value`` and the buffers it carries; the out-of-band buffers go
    into the segment the kernel offered this rank, when it did and they are large.

    A pull is this rank's alone, so a DTensor in ``value`` (an FSDP parameter, its gradient or
    optimizer state) arrives as this rank's local shard, a plain tensor
    (:mod:`~jupyter_shard.transfer.pickling`):
    never a DTensor, which the kernel could not use without the ranks' process group. The whole
    tensor takes all ranks: ``--gather`` of the prepared model, or the shards of ``--all`` put
    together along the sharded dimension."""
    global _lent
    release()
    reply: PullReply = {"req_id": str(msg.body["req_id"]), "ok": False, "error": ""}
    try:
        packed = pickling.dumps(value, host=not msg.body.get("device", False))
    except Exception as exc:
        reply["error"] = f"{what} could not be pickled: {type(exc).__name__}: {exc}" + _module_hint(value)
        return reply, []
    reply["sizes"] = packed.sizes
    if packed.nbytes > limit:
        reply["error"] = f"{what} is {packed.nbytes / 2**20:.0f} MiB pickled, over the "
        reply["error"] += f"{limit / 2**20:.0f} MiB limit of this copy"
        return reply, []
    ref = msg.body.get("segments", {}).get(str(rank))
    if msg.body.get("stream") and ref is None and sum(packed.sizes) > CHUNK:
        _lent = peer_memory.Lent(packed.buffers)
        reply["ok"], reply["streamed"] = True, True
        return reply, [packed.inband]
    if ref is not None and sum(packed.sizes) >= SEGMENT_OVER:
        if msg.body.get("direct") and peer_memory.supported():
            _lent = peer_memory.Lent(packed.buffers)
            reply["ok"], reply["addresses"] = True, _lent.addresses
            reply["token"], reply["token_address"] = _lent.token.hex(), _lent.token_address
            return reply, [packed.inband]
        error = _into_segment(ref, packed.buffers)
        if not error:
            reply["ok"], reply["in_segment"] = True, True
            return reply, [packed.inband]
        if not error.startswith(segments.UNAVAILABLE):
            reply["error"] = f"{what} could not be sent: {error}"
            return reply, []
    if max([len(packed.inband), *packed.sizes]) > MAX_FRAME:
        reply["error"] = (
            f"{what} has a part over the {MAX_FRAME / 2**20:.0f} MiB message limit of a rank on another "
            "machine; save it to a file instead"
        )
        return reply, []
    reply["ok"] = True
    return reply, [packed.inband, *packed.buffers]


def _module_hint(value: Any) -> str:
    """What to pull instead of a module that cannot be pickled whole: a prepared model holds its
    process group (and DeepSpeed's engine its optimizer and config)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.nn.Module):
        return ""
    return (
        ". A prepared model holds its process group: `%dist_pull NAME --gather` brings its full "
        "weights as a plain model; `sd = NAME.state_dict()` in a cell, then `%dist_pull sd`, this "
        "rank's part"
    )


def resent_reply(msg: Message, rank: int) -> PullReply:
    """The buffers lent for the last pull, written into the segment the kernel now offers (it could
    not read them from here)."""
    reply: PullReply = {"req_id": str(msg.body["req_id"]), "ok": False, "error": ""}
    lent, ref = _lent, msg.body.get("segments", {}).get(str(rank))
    release()
    if lent is None or ref is None:
        reply["error"] = f"rank {rank} has nothing lent to resend, or no segment to write it into"
        return reply
    error = _into_segment(ref, lent.buffers)
    reply["ok"], reply["error"], reply["in_segment"] = not error, error, not error
    reply["sizes"] = [b.nbytes for b in lent.buffers]
    return reply


def _into_segment(ref: Any, views: list[memoryview]) -> str:
    """Write ``views`` into the segment ``ref`` names; '' or why not."""
    try:
        with segments.opened(ref, writable=True) as fd:
            segments.write_into(fd, views)
    except segments.SegmentError as exc:
        return str(exc)
    return ""


def chunk_reply(msg: Message) -> tuple[PullReply, list[Any]]:
    """A part of the buffers lent for the last pull: ``chunk`` is [offset, length] of them end to end."""
    reply: PullReply = {"req_id": str(msg.body["req_id"]), "ok": False, "error": ""}
    offset, length = (int(n) for n in msg.body["chunk"])
    if _lent is None:
        reply["error"] = "nothing is lent for a part to be read from"
        return reply, []
    if length > 4 * CHUNK:
        reply["error"] = f"a part of {length} bytes is over the {4 * CHUNK} allowed"
        return reply, []
    try:
        parts = pickling.pieces(_lent.buffers, offset, length)
    except ValueError as exc:
        reply["error"] = str(exc)
        return reply, []
    reply["ok"] = True
    return reply, parts


def _check_room(nbytes: int) -> None:
    import psutil

    free = psutil.virtual_memory().available
    if nbytes > free:
        raise MemoryError(
            f"the value needs {nbytes / 2**30:.1f} GiB and this machine has {free / 2**30:.1f} GiB free"
        )
