"""A rank's end of ``push`` and ``pull``: values built from, and sent as, in-band pickles and
out-of-band buffers (:mod:`jupyter_shard.buffers`), the buffers through the kernel's shared-memory
segment when it offers one (:mod:`jupyter_shard.segments`) and in the message otherwise.

Every check here answers a message that was already authenticated with the pool key; a malformed or
oversized transfer is refused with a reply that says why, and the rank goes on."""

from __future__ import annotations

from typing import Any

from jupyter_shard import buffers, segments
from jupyter_shard.messages import PullReply
from jupyter_shard.protocol import MAX_FRAME, Message

__all__ = ["pulled_reply", "pushed_values"]

SEGMENT_OVER = 1 << 20  # out-of-band bytes from which a pull goes through the offered segment


def pushed_values(msg: Message) -> dict[str, Any]:
    """The values a ``push`` carries, by name; a ``ValueError`` (or :class:`~.segments.SegmentError`)
    for one that does not hold together."""
    body = msg.body
    names = [str(n) for n in body["names"]]
    counts = [int(c) for c in body["counts"]]
    if len(counts) != len(names) or len(msg.buffers) < len(names) or min(counts, default=0) < 0:
        raise ValueError("malformed push: its names, counts and buffers do not match")
    inbands = msg.buffers[: len(names)]
    if "segment" in body:
        sizes = [int(s) for s in body["sizes"]]
        with segments.opened(body["segment"]) as fd:
            oob: list[Any] = segments.map_buffers(fd, sizes)
    else:
        oob = [bytearray(b) for b in msg.buffers[len(names) :]]  # writable, as the sender's were
    if sum(counts) != len(oob):
        raise ValueError(f"malformed push: {sum(counts)} buffers announced, {len(oob)} came")
    values, start = {}, 0
    for name, inband, count in zip(names, inbands, counts, strict=True):
        values[name] = buffers.loads(inband, oob[start : start + count])
        start += count
    return values


def pulled_reply(msg: Message, rank: int, what: str, value: Any, limit: int) -> tuple[PullReply, list[Any]]:
    """The reply to a ``pull`` of ``value`` and the buffers it carries; the out-of-band buffers go
    into the segment the kernel offered this rank, when it did and they are large."""
    reply: PullReply = {"req_id": str(msg.body["req_id"]), "ok": False, "error": ""}
    try:
        packed = buffers.dumps(value, host=not msg.body.get("device", False))
    except Exception as exc:
        reply["error"] = f"{what} could not be pickled: {type(exc).__name__}: {exc}"
        return reply, []
    reply["sizes"] = packed.sizes
    if packed.nbytes > limit:
        reply["error"] = f"{what} is {packed.nbytes / 2**20:.0f} MiB pickled, over the "
        reply["error"] += f"{limit / 2**20:.0f} MiB limit of this copy"
        return reply, []
    ref = msg.body.get("segments", {}).get(str(rank))
    if ref is not None and sum(packed.sizes) >= SEGMENT_OVER:
        try:
            with segments.opened(ref, writable=True) as fd:
                segments.write_into(fd, packed.buffers)
            reply["ok"], reply["in_segment"] = True, True
            return reply, [packed.inband]
        except segments.SegmentError as exc:
            if not str(exc).startswith(segments.UNAVAILABLE):
                reply["error"] = f"{what} could not be sent: {exc}"
                return reply, []
    if max([len(packed.inband), *packed.sizes]) > MAX_FRAME:
        reply["error"] = (
            f"{what} has a part over the {MAX_FRAME / 2**20:.0f} MiB message limit of a rank on another "
            "machine; save it to a file instead"
        )
        return reply, []
    reply["ok"] = True
    return reply, [packed.inband, *packed.buffers]
