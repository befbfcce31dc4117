"""The kernel's end of the wire: one ROUTER socket, the local ranks' direct links, the pool key, and
dispatch by message type.

:class:`Connection` signs and sends to ranks, waits for replies to requests, and receives: every frame
is authenticated by :class:`~jupyter_shard.wire.protocol.Wire` and handed to the handler registered for its
type; the table is checked against the registry (:mod:`jupyter_shard.wire.messages`) when the pool starts.
A message from an unknown peer, with a bad signature or replayed is dropped and counted, never fatal.
What a message *means* is decided elsewhere: the rank table (:mod:`.ranks`) and the running cell
(:mod:`.cell`) register their handlers; replies to requests are kept here. A rank on this machine has a
direct link too (:mod:`.links`): once it serves the rank, it carries every message to and from the
rank's main thread, and the socket only the I/O thread's.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from jupyter_shard.errors import PoolError, ProtocolError
from jupyter_shard.pool.links import Link, Links
from jupyter_shard.pool.ranks import RankRecord, RankTable
from jupyter_shard.spec import format_ranks
from jupyter_shard.wire.messages import MESSAGES, REPLIES, handler_table
from jupyter_shard.wire.protocol import Message, Wire, parse_identity

__all__ = ["Connection", "Handler"]

Handler = Callable[[RankRecord, Message], None]

PEERS_KEPT = 1 << 17  # parsed socket identities kept (two per rank: its own and its I/O thread's)
DRAIN = 256  # messages taken from the socket in a row before the links get their turn
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)  # pyzmq's enum flags cost a microsecond each use


class Connection:
    """Sending to ranks and dispatching what they send; the socket is shared by every thread."""

    def __init__(self, ranks: RankTable) -> None:
        self.ranks = ranks
        self.socket: zmq.Socket[bytes] | None = None
        self.wire: Wire | None = None
        self.dropped = 0  # frames rejected on the pool socket (unknown peer, bad signature, replay)
        self.lock = threading.RLock()  # run() and e.g. stacks() from another thread share the socket
        self.on_io: Callable[[RankRecord], None] = lambda r: None  # after each message on a rank's I/O
        self.table: dict[str, Handler] = dict.fromkeys(REPLIES, self._on_reply)  # by message type
        self._replies: dict[str, dict[int, Message]] = {}
        self.links = Links()
        self._poller: zmq.Poller | None = None  # the socket and the links, rebuilt when they change
        self._peers: dict[bytes, tuple[int, bool, str]] = {}  # socket identity: rank, I/O thread, sender

    @property
    def open(self) -> bool:
        return self.socket is not None

    def attach(self, sock: zmq.Socket[bytes], wire: Wire) -> None:
        """Start receiving on ``sock``: every type the kernel receives must have its handler by now."""
        self.checked_table()
        self.socket, self.wire = sock, wire

    def detach(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket, self.wire = None, None
        self.links.close()
        self._poller = None

    def handle(self, handlers: Mapping[str, Handler]) -> None:
        """Register what to do with each type of message the ranks send."""
        self.table.update(handlers)

    def checked_table(self) -> dict[str, Handler]:
        """The dispatch table: one handler per type the kernel receives, or a ``ValueError``."""
        registered = {name: h for name, h in self.table.items() if name not in REPLIES}
        return handler_table("kernel", registered, replies=self._on_reply)

    @property
    def waiting_requests(self) -> list[str]:
        """The ids of requests still waiting for replies."""
        return list(self._replies)

    def send(
        self,
        targets: Sequence[RankRecord],
        msg_type: str,
        body: Mapping[str, Any],
        buffers: Sequence[bytes] = (),
    ) -> None:
        """Sign once, send to every target: each rank checks ``seq`` against its own history."""
        assert self.socket is not None and self.wire is not None
        frames = self.wire.to_socket(msg_type, body, buffers, format_ranks([r.rank for r in targets]))
        io = MESSAGES[msg_type].io
        sock, last = self.socket, len(frames) - 1
        with self.lock:
            for r in targets:
                if not io and self.links.send(r.rank, frames):
                    continue
                try:  # frame by frame: send_multipart's checks cost as much as the send, per rank
                    sock.send(r.io_identity if io else r.identity, _SNDMORE)
                    for i, frame in enumerate(frames):
                        sock.send(frame, _SNDMORE if i < last else 0)
                except zmq.ZMQError as exc:
                    raise PoolError(f"rank {r.rank} is not connected ({exc}); run %dist_restart") from None

    def request(
        self,
        msg_type: str,
        body: Mapping[str, Any],
        targets: list[RankRecord],
        *,
        buffers: Sequence[bytes] = (),
        timeout: float,
    ) -> dict[int, Message]:
        """Send to ``targets`` and wait up to ``timeout`` for their replies (fewer if a target dies)."""
        req_id = uuid.uuid4().hex
        self._replies[req_id] = {}
        try:
            self.send(targets, msg_type, {**body, "req_id": req_id}, buffers)
            deadline = time.monotonic() + timeout
            while len(self._replies[req_id]) < len(targets) and time.monotonic() < deadline:
                self.pump(0.02)
                if any(self.poll_exit(r) or r.dead for r in targets):
                    break
            return self._replies[req_id]
        finally:
            del self._replies[req_id]

    def poll_exit(self, r: RankRecord) -> bool:
        """Whether ``r`` has just been found gone; what it sent before it went is received first."""
        if r.dead or r.handle.poll() is None:
            return False
        self.pump(0.05)
        return r.poll_exit()

    def pump(self, timeout: float) -> None:
        """Receive and dispatch every waiting message; wait up to ``timeout`` for the first."""
        sock, wire = self.socket, self.wire
        if sock is None or wire is None:
            return
        wait_ms = int(timeout * 1000)
        with self.lock:
            while events := self._poll(sock, wait_ms):
                wait_ms = 0
                for item, event in events:
                    if item is sock:
                        self._drain(sock, wire)
                        continue
                    assert isinstance(item, int)
                    for link, frames in self.links.ready(item, bool(event & zmq.POLLOUT)):
                        self.dispatch(wire, [link.identity or b"", *frames], link)

    def _drain(self, sock: zmq.Socket[bytes], wire: Wire) -> None:
        """Dispatch what the socket holds, up to ``DRAIN`` messages, without a poll between them (at
        1,024 ranks a cell ends with 1,024 messages: one poll each was a tenth of the kernel's time)."""
        for _ in range(DRAIN):
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.dispatch(wire, frames)

    def _poll(self, sock: zmq.Socket[bytes], wait_ms: int) -> list[tuple[Any, int]]:
        """What is ready among the socket and the links (the poller follows the links as they change)."""
        if self._poller is None or self.links.changed:
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            for fd, writing in self.links.watched():
                self._poller.register(fd, zmq.POLLIN | (zmq.POLLOUT if writing else 0))
        return self._poller.poll(wait_ms)

    def dispatch(self, wire: Wire, frames: list[bytes], link: Link | None = None) -> None:
        """Authenticate one message as received on the socket (or on ``link``) and hand it to its handler."""
        peer = self._peers.get(frames[0])
        if peer is None:
            rank, is_io = parse_identity(frames[0])
            peer = (rank, is_io, frames[0].decode("ascii", errors="replace"))
            if rank >= 0 and len(self._peers) < PEERS_KEPT:
                self._peers[frames[0]] = peer
        rank, is_io, sender = peer
        r = self.ranks.get(rank)
        try:
            if r is None:
                raise ProtocolError(f"message from an unknown peer {frames[0][:40]!r}")
            if link is not None and is_io:
                raise ProtocolError(f"a direct link named itself {frames[0][:40]!r}, an I/O thread's")
            msg = wire.from_socket(frames[1:], expect_sender=sender)
        except ProtocolError as exc:
            self.dropped += 1
            print(f"jupyter_shard: dropped a message on the pool socket: {exc}", file=sys.__stderr__)
            if link is not None:
                self.links.refuse(link, str(exc))
            return
        if link is not None:  # before its handler runs, so that any answer takes the link too
            self.links.bind(link, r.rank)
        r.handle.heard()
        handler = self.table.get(msg.type)
        if handler is None:  # a kernel-bound type (the wire checked that it is one) sent by a rank
            self.dropped += 1
            print(f"jupyter_shard: dropped a {msg.type!r} message from rank {r.rank}", file=sys.__stderr__)
        else:
            handler(r, msg)
        if is_io:
            r.io_received += 1
            self.on_io(r)

    def _on_reply(self, r: RankRecord, msg: Message) -> None:
        if r.recount and "io_count" in msg.body:  # attached to a kept pool: count on from the rank's count
            r.io_received, r.recount = int(msg.body["io_count"]) - 1, False  # dispatch adds this reply
        bucket = self._replies.get(str(msg.body.get("req_id")))
        if bucket is not None:
            bucket[r.rank] = msg
