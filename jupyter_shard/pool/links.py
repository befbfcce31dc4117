"""Direct links: a Unix stream between the kernel and each rank on this machine, for its main thread.

A cell's ``execute`` and its ``done`` are the hot path of every ``%%distributed`` cell. Over the pool's
ZeroMQ socket each of them passes through two more threads (the sender's and the receiver's libzmq I/O
threads), and after the idle gap that always comes before a notebook cell each hand-off is a cold
wake-up: a ROUTER/DEALER echo over ``ipc://`` took 0.47 ms to two peers after a 5 ms pause, where the
same echo over Unix stream sockets took 0.23 ms (``docs/performance-notes.md``).

The kernel listens at ``direct.sock`` in the pool's private (0700) directory. A rank started on this
machine connects before it sends anything, names itself in a first record (its socket identity), then
sends every message of its main thread as a record (:func:`~jupyter_shard.wire.protocol.stream_record`) and
receives the kernel's messages to its main thread the same way. Nothing on a link is trusted until
:class:`~jupyter_shard.wire.protocol.Wire` has authenticated it with the pool key as that rank's, and only
then does the link carry the kernel's messages to that rank: before, and for the rank's I/O thread
always, the ZeroMQ socket does. All the messages to one rank's main thread take one path, so its replay
check sees them in order. A link that closes or fails is dropped; a rank whose link is gone is not
written to again (a live one keeps its link for its life).

The kernel never blocks on a rank that does not read: what a link cannot take at once waits in its
outbox and is written when the link is writable again (:meth:`Links.flush`, from every pump).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from jupyter_shard.errors import ProtocolError
from jupyter_shard.wire.protocol import StreamReader, size_stream, stream_record, write_stream

__all__ = ["Link", "Links"]

READ_SIZE = 1 << 20  # one read from a link at most
MAX_UNNAMED = 256  # connections that have not yet named themselves; past this the newest is refused


class Link:
    """One accepted connection: its reader, the identity it claims, and what waits to be written."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        size_stream(sock)
        self.sock = sock
        self.identity: bytes | None = None  # claimed by the first record; proved by the first message
        self.rank = -1  # the rank it serves, once a message on it was authenticated
        self._reader = StreamReader()
        self._buffer = bytearray(READ_SIZE)
        self._outbox: deque[memoryview] = deque()

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    @property
    def waiting(self) -> bool:
        """Whether bytes wait in the outbox for the link to be writable."""
        return bool(self._outbox)

    def queue(self, frames: Sequence[bytes | memoryview]) -> None:
        """Write ``frames`` as one record, now as far as the link takes it; the rest waits."""
        self._outbox.extend(stream_record(frames))
        self.flush()

    def flush(self) -> None:
        """Write what waits until the link would block; a broken link raises ``OSError``."""
        write_stream(self.sock, self._outbox)

    def read(self) -> list[list[bytes]] | None:
        """The records that have arrived, or ``None`` when the peer closed the link."""
        records: list[list[bytes]] = []
        view = memoryview(self._buffer)
        while True:
            try:
                n = self.sock.recv_into(view)
            except BlockingIOError:
                return records
            except ConnectionError:
                return None
            if n == 0:
                return None
            records.extend(self._reader.feed(view[:n]))
            if n < len(view):
                return records

    def close(self) -> None:
        self._outbox.clear()
        self.sock.close()


class Links:
    """The listening socket and every link accepted on it, by the rank each one serves."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self._listener: socket.socket | None = None
        self._unnamed: list[Link] = []  # accepted, not yet serving a rank
        self._by_rank: dict[int, Link] = {}
        self.changed = True  # the set of file descriptors to watch changed since :meth:`watched`

    def listen(self, path: Path) -> str:
        """Accept links at ``path`` (inside the pool's private directory); returns the path."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o600)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listener, self.path, self.changed = sock, path, True
        return str(path)

    def watched(self) -> Iterator[tuple[int, bool]]:
        """Each file descriptor to watch, and whether to watch it for writing too."""
        self.changed = False
        if self._listener is not None:
            yield self._listener.fileno(), False
        for link in self._links():
            yield link.fileno(), link.waiting

    def _links(self) -> list[Link]:
        return [*self._unnamed, *self._by_rank.values()]

    def send(self, rank: int, frames: Sequence[bytes | memoryview]) -> bool:
        """Write to ``rank``'s link; ``False`` if it has none (the caller uses the ZeroMQ socket)."""
        link = self._by_rank.get(rank)
        if link is None:
            return False
        waiting = link.waiting
        try:
            link.queue(frames)
        except OSError:  # the rank closed it or is gone: the caller's socket says which
            self._drop(link)
            return False
        if link.waiting != waiting:
            self.changed = True
        return True

    def serves(self, rank: int) -> bool:
        return rank in self._by_rank

    def ready(self, fd: int, writable: bool) -> Iterator[tuple[Link, list[bytes]]]:
        """Handle one ready file descriptor: accept, write what waits, or yield the records read."""
        if self._listener is not None and fd == self._listener.fileno():
            self._accept()
            return
        link = next((k for k in self._links() if k.fileno() == fd), None)
        if link is None:
            return
        try:
            if writable:
                link.flush()
                self.changed = True
            records = link.read()
        except (OSError, ProtocolError) as exc:
            self._drop(link, f"{type(exc).__name__}: {exc}")
            return
        if records is None:
            self._drop(link)
            return
        for record in records:
            if link.closed:  # refused by the caller while it handled an earlier record
                return
            if link.identity is None:  # the first record names the rank
                if len(record) != 1 or len(record[0]) > 64:
                    self._drop(link, "its first record is not a rank's identity")
                    return
                link.identity = record[0]
                continue
            yield link, record

    def bind(self, link: Link, rank: int) -> None:
        """``link`` serves ``rank`` from now on: a message on it was authenticated as that rank's."""
        if link.rank == rank:
            return
        old = self._by_rank.get(rank)
        if old is not None and old is not link:  # a rank started again under the same number
            self._drop(old)
        if link in self._unnamed:
            self._unnamed.remove(link)
        link.rank = rank
        self._by_rank[rank] = link
        self.changed = True

    def refuse(self, link: Link, why: str) -> None:
        """Close a link whose message failed authentication before it served a rank."""
        if link.rank < 0:
            self._drop(link, why)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                print(f"jupyter_shard: a rank's direct link was not accepted: {exc}", file=sys.__stderr__)
                return
            if not _same_user(sock) or len(self._unnamed) >= MAX_UNNAMED:
                sock.close()
                continue
            self._unnamed.append(Link(sock))
            self.changed = True

    def _drop(self, link: Link, why: str = "") -> None:
        if why:
            print(f"jupyter_shard: dropped a direct link ({why})", file=sys.__stderr__)
        if link in self._unnamed:
            self._unnamed.remove(link)
        if self._by_rank.get(link.rank) is link:
            del self._by_rank[link.rank]
        link.close()
        self.changed = True

    def close(self) -> None:
        for link in self._links():
            link.close()
        self._unnamed.clear()
        self._by_rank.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None
        self.changed = True


def _same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end runs as this user (the pool directory is 0700 anyway)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())
