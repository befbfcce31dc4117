"""The one way messages cross the kernel/rank boundary: signed, checked, framed for ZeroMQ.

Which messages exist, their directions and bodies are declared in :mod:`jupyter_shard.wire.messages`;
this module carries them.

A message is signed as a list of parts::

    [b"jsh1", signature, header_json, body_json, *buffers]

``signature`` is HMAC-SHA256 over the tag, header, body and every buffer (each length-prefixed),
computed with the pool's random key. On the socket the first four parts travel as one frame,
``tag + signature + len(header) (4 bytes, big-endian) + header + body``, followed by one frame per
buffer (:func:`pack`, :func:`unpack`): each ZeroMQ frame costs a Python-level send and receive on
both ends, and most messages have no buffers. :meth:`Wire.decode` checks size limits and the
signature with a constant-time compare *before* parsing anything, then rejects replays (each
sender's ``seq`` must grow). Bodies are JSON. Buffers carry bulk data as it is: a rank's output
text (UTF-8), metric columns (float64), and the values the user explicitly pushes or pulls
(pickled, and unpickled by the caller only after :meth:`Wire.decode` has authenticated them).

With ``JUPYTER_SHARD_CHECK_PROTOCOL`` naming a file (tests set it; ranks inherit it), every
:class:`Wire` checks each body it signs against the registry, appends it to that file and raises
:class:`ProtocolError` on a body the registry does not declare.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import itertools
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jupyter_shard.env import CHECK_PROTOCOL_VAR, MAX_FRAME_VAR
from jupyter_shard.errors import ProtocolError
from jupyter_shard.wire.messages import MSG_TYPES, MsgType, check_body

__all__ = [
    "MSG_TYPES",
    "TEXT_ERRORS",
    "Message",
    "MsgType",
    "ProtocolError",
    "StreamReader",
    "Wire",
    "new_key",
    "pack",
    "stream_record",
    "unpack",
]

TAG = b"jsh1"
MAX_HEADER = 4 * 1024
MAX_BODY = 64 * 1024 * 1024
MAX_FRAME = int(os.environ.get(MAX_FRAME_VAR, str(1 << 30)))
KERNEL = "kernel"
TEXT_ERRORS = "surrogatepass"  # how stream text is encoded and decoded (``messages.StreamBody``)


def new_key() -> bytes:
    """A fresh 256-bit pool key."""
    return secrets.token_bytes(32)


@dataclass
class Message:
    type: str
    body: dict[str, Any]
    sender: str = ""
    seq: int = 0
    buffers: list[bytes] = field(default_factory=list)


_SIG = 32  # HMAC-SHA256
_HEAD = len(TAG) + _SIG + 4  # tag, signature, header length


def pack(parts: Sequence[bytes]) -> list[bytes]:
    """Signed parts ``[tag, signature, header, body, *buffers]`` as socket frames."""
    tag, signature, header, body, *buffers = parts
    return [b"".join((tag, signature, len(header).to_bytes(4, "big"), header, body)), *buffers]


def unpack(frames: Sequence[bytes | memoryview]) -> list[bytes]:
    """Socket frames back into the parts :meth:`Wire.decode` checks; only the layout is checked here."""
    if not frames:
        raise ProtocolError("not a jupyter_shard message (no frames)")
    first = bytes(frames[0])
    if len(first) < _HEAD or first[: len(TAG)] != TAG:
        raise ProtocolError("not a jupyter_shard message (bad tag or too short)")
    size = int.from_bytes(first[_HEAD - 4 : _HEAD], "big")
    if size > MAX_HEADER or _HEAD + size > len(first):
        raise ProtocolError("message header length is out of range")
    return [
        TAG,
        first[len(TAG) : len(TAG) + _SIG],
        first[_HEAD : _HEAD + size],
        first[_HEAD + size :],
        *(bytes(f) for f in frames[1:]),
    ]


# A stream (a local rank's direct link, :mod:`jupyter_shard.pool.links`) carries the same frames as
# records: a frame count, each frame's length, then the frames.
_COUNT = 4
_LENGTH = 8
MAX_STREAM_FRAMES = 1 << 20
STREAM_BUFFER = 4 << 20  # asked of the system for a stream's send and receive buffers
_IOV_MAX = 512  # pieces per sendmsg


def size_stream(sock: socket.socket) -> None:
    """Ask for large buffers on a stream's socket (the system may give less)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STREAM_BUFFER)


def write_stream(sock: socket.socket, pieces: collections.deque[memoryview]) -> None:
    """Write ``pieces`` from the left until they are all written or a non-blocking ``sock`` would
    block; what is written leaves ``pieces``. A broken stream raises ``OSError``."""
    while pieces:
        batch = [pieces[i] for i in range(min(len(pieces), _IOV_MAX))]
        try:
            sent = sock.sendmsg(batch, [], socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return
        while sent:
            head = pieces[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                pieces.popleft()
            else:
                pieces[0] = head[sent:]
                sent = 0


def stream_record(frames: Sequence[bytes | memoryview]) -> list[memoryview]:
    """``frames`` as one record of a stream: its head (count, lengths), then the frames themselves."""
    head = [len(frames).to_bytes(_COUNT, "big")]
    head.extend(memoryview(f).nbytes.to_bytes(_LENGTH, "big") for f in frames)
    return [memoryview(b"".join(head)), *(memoryview(f).cast("B") for f in frames)]


class StreamReader:
    """Cuts the bytes read from a stream back into records; only the layout is checked here.

    A record's frames are handed out as they were sent; a peer's message is authenticated by
    :meth:`Wire.from_socket` afterwards, as one from a ZeroMQ socket is.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._data = bytearray()
        self._max_frame = max_frame + _HEAD + MAX_HEADER + MAX_BODY

    def feed(self, data: bytes | memoryview) -> list[list[bytes]]:
        """Add ``data``; the records it completed, oldest first. Raises :class:`ProtocolError`."""
        self._data += data
        records: list[list[bytes]] = []
        while (record := self._next()) is not None:
            records.append(record)
        return records

    def _next(self) -> list[bytes] | None:
        data = self._data
        if len(data) < _COUNT:
            return None
        count = int.from_bytes(data[:_COUNT], "big")
        if not 0 < count <= MAX_STREAM_FRAMES:
            raise ProtocolError(f"a stream record of {count} frames")
        start = _COUNT + count * _LENGTH
        if len(data) < start:
            return None
        lengths = [int.from_bytes(data[at : at + _LENGTH], "big") for at in range(_COUNT, start, _LENGTH)]
        if any(n > self._max_frame for n in lengths):
            raise ProtocolError("a stream record's frame is over the size limit")
        if len(data) < start + sum(lengths):
            return None
        frames = []
        with memoryview(data) as view:
            for n in lengths:
                frames.append(bytes(view[start : start + n]))
                start += n
        del data[:start]
        return frames


_ONE_SHOT_MAC = 64 << 10  # frames up to this size in all are signed in one call, joined
_COMPACT = json.JSONEncoder(separators=(",", ":"))  # json.dumps(..., separators=...) makes one per call


_DECODER = json.JSONDecoder()


def _json(raw: bytes) -> Any:
    """``json.loads`` of UTF-8 ``raw``, without its checks of the argument's type and its decoder
    lookup: the kernel takes two per rank and cell."""
    return _DECODER.decode(raw.decode())


def _mac(key: bytes, frames: Sequence[bytes]) -> bytes:
    """HMAC-SHA256 over each frame's length (8 bytes, big-endian) followed by the frame."""
    if sum(len(frame) for frame in frames) <= _ONE_SHOT_MAC:  # a cell, a reply: no copy worth avoiding
        return hmac.digest(key, b"".join(_length_prefixed(frames)), "sha256")
    digest = hmac.new(key, digestmod=hashlib.sha256)  # large buffers are hashed where they are
    for part in _length_prefixed(frames):
        digest.update(part)
    return digest.digest()


def _length_prefixed(frames: Sequence[bytes]) -> Iterator[bytes]:
    for frame in frames:
        yield len(frame).to_bytes(8, "big")
        yield frame


class Wire:
    """Builds, signs, checks and parses messages for one endpoint (the kernel or one rank)."""

    def __init__(self, key: bytes, sender: str) -> None:
        if len(key) < 32:
            raise ValueError("pool keys must be at least 256 bits")
        self._key = key
        self.sender = sender
        self._rank = parse_identity(sender.encode())[0]  # -1: not a rank (the kernel, a tool)
        # Start from the clock so that a restarted endpoint with the same key still moves forward.
        self._seq = itertools.count(time.time_ns())
        self._last_seen: dict[str, int] = {}
        self.rejected = 0
        self._record = os.environ.get(CHECK_PROTOCOL_VAR) or None

    def encode(
        self, msg_type: str, body: Mapping[str, Any], buffers: Sequence[bytes] = (), to: str | None = None
    ) -> list[bytes]:
        """Sign a message for ``to``: ranks as ``"0-3,5"`` (the kernel's default ``"*"``: every rank),
        or ``"kernel"`` (a rank's default). A rank refuses a message not meant for it."""
        if self._record is not None:
            _check_and_record(self._record, self.sender, msg_type, body)
        header = {
            "v": 1,
            "type": msg_type,
            "seq": next(self._seq),
            "sender": self.sender,
            "to": _recipients(to, self.sender),
            "ts": time.time(),
        }
        parts = [
            _COMPACT.encode(header).encode(),
            _COMPACT.encode(body).encode(),
            *buffers,
        ]
        return [TAG, _mac(self._key, [TAG, *parts]), *parts]

    def seen(self) -> dict[str, int]:
        """The last ``seq`` taken from each sender: what a kernel attaching after this one refuses."""
        return dict(self._last_seen)

    def refuse_up_to(self, seen: Mapping[str, object]) -> None:
        """Refuse from each sender every message up to the ``seq`` given for it (another endpoint's
        :meth:`seen`): those were taken there, and arrive here only as replays."""
        for sender, seq in seen.items():
            if type(seq) is int:
                self._last_seen[sender] = max(self._last_seen.get(sender, -1), seq)

    def decode(self, frames: Sequence[bytes], expect_sender: str | None = None) -> Message:
        """Authenticate, then parse. Raises :class:`ProtocolError` for anything not well-formed."""
        try:
            return self._decode(frames, expect_sender)
        except ProtocolError:
            self.rejected += 1
            raise

    def to_socket(
        self, msg_type: str, body: Mapping[str, Any], buffers: Sequence[bytes] = (), to: str | None = None
    ) -> list[bytes]:
        """:meth:`encode`, as the frames a socket sends (:func:`pack`)."""
        return pack(self.encode(msg_type, body, buffers, to))

    def from_socket(self, frames: Sequence[bytes | memoryview], expect_sender: str | None = None) -> Message:
        """:meth:`decode` of frames received from a socket (:func:`unpack`)."""
        try:
            parts = unpack(frames)
        except ProtocolError:
            self.rejected += 1
            raise
        return self.decode(parts, expect_sender)

    def _decode(self, frames: Sequence[bytes], expect_sender: str | None) -> Message:
        if len(frames) < 4 or bytes(frames[0]) != TAG:
            raise ProtocolError("not a jupyter_shard message (bad tag or too few frames)")
        signature, header_raw, body_raw, *buffers = (f if type(f) is bytes else bytes(f) for f in frames[1:])
        if len(header_raw) > MAX_HEADER or len(body_raw) > MAX_BODY:
            raise ProtocolError("message header or body over the size limit")
        if any(len(b) > MAX_FRAME for b in buffers):
            raise ProtocolError("message buffer over the size limit")
        expected = _mac(self._key, [TAG, header_raw, body_raw, *buffers])
        if not hmac.compare_digest(expected, signature):
            raise ProtocolError("bad signature")
        try:
            # what was signed is this module's UTF-8 JSON: decoded as such (json.loads of bytes
            # first guesses among UTF-8, -16 and -32); bad UTF-8 is a ValueError, as bad JSON
            header = _json(header_raw)
            body = _json(body_raw)
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, huge ints, deep nesting
            raise ProtocolError(
                f"signed message is not JSON, or not JSON we accept: {type(exc).__name__}"
            ) from None
        if not isinstance(header, dict) or not isinstance(body, dict):
            raise ProtocolError("signed message header and body must be JSON objects")
        msg_type, sender, seq = header.get("type"), header.get("sender"), header.get("seq")
        if (
            not isinstance(msg_type, str)
            or msg_type not in MSG_TYPES
            or not isinstance(sender, str)
            or type(seq) is not int
        ):
            raise ProtocolError(f"signed message has an unknown type or bad header: {msg_type!r}")
        if expect_sender is not None and sender != expect_sender:
            raise ProtocolError(f"message claims sender {sender!r} on the socket of {expect_sender!r}")
        if self._rank >= 0 and not _meant_for(self._rank, header.get("to")):
            raise ProtocolError(
                f"a message from {sender!r} meant for {header.get('to')!r}, not {self.sender!r}"
            )
        if seq <= self._last_seen.get(sender, -1):
            raise ProtocolError(f"replayed or reordered message from {sender!r}")
        self._last_seen[sender] = seq
        return Message(type=msg_type, body=body, sender=sender, seq=seq, buffers=list(buffers))


def _check_and_record(path: str, sender: str, msg_type: str, body: Mapping[str, Any]) -> None:
    """Append what is signed to ``path`` (one JSON line, so processes can share the file); raise
    :class:`ProtocolError` if ``body`` is not what the registry declares for ``msg_type``."""
    problems = check_body(msg_type, body)
    line = json.dumps({"sender": sender, "type": msg_type, "body": body, "problems": problems}, default=repr)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    if problems:
        raise ProtocolError(f"{sender} sent a {msg_type!r} body the registry does not declare: {problems}")


def _recipients(to: str | None, sender: str) -> str:
    """The header's ``to``: as given (ranks as ``spec.format_ranks`` writes them), the default for
    the sender, or every rank where a very scattered list would not fit the header."""
    if to is None:
        return "*" if sender == KERNEL else KERNEL
    return to if len(to) <= MAX_HEADER // 2 else "*"


def _meant_for(rank: int, to: object) -> bool:
    """Whether rank ``rank`` may accept a message whose header says ``to`` (the kernel, a tool or a
    test checks each sender against its socket instead)."""
    if to == "*":
        return True
    if not isinstance(to, str) or to == KERNEL:
        return False
    for part in to.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (high or low).isdigit() and int(low) <= rank <= int(high or low):
            return True
    return False


def rank_identity(rank: int) -> str:
    """The socket identity of a rank's main thread."""
    return f"rank-{rank}"


def io_identity(rank: int) -> str:
    """The socket identity of a rank's I/O thread."""
    return f"rank-{rank}.io"


def parse_identity(identity: bytes) -> tuple[int, bool]:
    """``(rank, is_io)`` for a socket identity, or ``(-1, False)`` if it is not a rank's."""
    text = identity.decode("ascii", errors="replace")
    base, io = (text[:-3], True) if text.endswith(".io") else (text, False)
    prefix, _, number = base.partition("-")
    if prefix != "rank" or not number.isdigit() or len(number) > 6:
        return -1, False
    return int(number), io


def cell_head(code: str) -> str:
    """How a cell is named in status and heartbeats: its first line of code (not the magic comment)."""
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.startswith("# %%")]
    return lines[0].strip()[:80] if lines else ""
