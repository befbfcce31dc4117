"""jupyter_shard.pool.links: accepting, naming and binding links; writes that never block the kernel."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_shard.pool.links import Link, Links
from jupyter_shard.wire.protocol import StreamReader, stream_record


@pytest.fixture
def links() -> Iterator[Links]:
    directory = Path(tempfile.mkdtemp(prefix="js-links-"))  # short: a socket path has 108 bytes
    links = Links()
    links.listen(directory / "direct.sock")
    yield links
    links.close()
    directory.rmdir()


def _record(*frames: bytes) -> bytes:
    return b"".join(bytes(p) for p in stream_record(list(frames)))


def _connect(links: Links, name: bytes | None = b"rank-0") -> socket.socket:
    assert links.path is not None
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(str(links.path))
    if name is not None:
        peer.sendall(_record(name))
    return peer


def _serving(links: Links, rank: int = 0) -> tuple[socket.socket, Link]:
    """A peer whose link serves ``rank``, as after its first authenticated message."""
    peer = _connect(links, f"rank-{rank}".encode())
    peer.sendall(_record(b"ready"))
    ((link, _),) = _pump(links)
    links.bind(link, rank)
    return peer, link


def _pump(links: Links, rounds: int = 3) -> list[tuple[Link, list[bytes]]]:
    """What a kernel's pump would do with every ready descriptor, a few times over."""
    got: list[tuple[Link, list[bytes]]] = []
    for _ in range(rounds):
        watched = list(links.watched())
        poller = select.poll()
        for fd, writing in watched:
            poller.register(fd, select.POLLIN | (select.POLLOUT if writing else 0))
        for fd, event in poller.poll(50):
            got.extend(links.ready(fd, bool(event & select.POLLOUT)))
    return got


def test_the_socket_is_private_and_removed_on_close(links: Links) -> None:
    assert links.path is not None
    path = links.path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    links.close()
    assert not path.exists()


def test_a_named_link_hands_out_its_records_with_the_name_and_serves_only_once_bound(links: Links) -> None:
    peer = _connect(links)
    peer.sendall(_record(b"first", b"buffer") + _record(b"second"))
    got = _pump(links)
    assert [(link.identity, frames) for link, frames in got] == [
        (b"rank-0", [b"first", b"buffer"]),
        (b"rank-0", [b"second"]),
    ]
    assert not links.serves(0)
    assert links.send(0, [b"to the socket instead"]) is False
    links.bind(got[0][0], 0)
    assert links.serves(0)
    assert links.send(0, [b"hello", b"rank"]) is True
    assert StreamReader().feed(peer.recv(1024)) == [[b"hello", b"rank"]]
    peer.close()


def test_a_link_that_does_not_name_itself_first_is_dropped(links: Links) -> None:
    peer = _connect(links, name=None)
    peer.sendall(_record(b"rank-0", b"two frames are no name"))
    assert _pump(links) == []
    assert peer.recv(16) == b""  # closed by the kernel
    peer.close()


def test_garbage_on_a_link_drops_it_and_no_other(links: Links) -> None:
    good = _connect(links, b"rank-1")
    bad = _connect(links, b"rank-2")
    bad.sendall(b"\xff" * 64)
    good.sendall(_record(b"still here"))
    got = _pump(links)
    assert [(link.identity, frames) for link, frames in got] == [(b"rank-1", [b"still here"])]
    assert bad.recv(16) == b""
    good.close()
    bad.close()


def test_a_rank_that_does_not_read_never_blocks_the_kernel(links: Links) -> None:
    peer, link = _serving(links)
    big = os.urandom(1 << 20)
    for _ in range(24):  # far more than both sockets' buffers hold
        assert links.send(0, [big])
    assert link.waiting
    reader = StreamReader()
    records: list[list[bytes]] = []
    peer.setblocking(False)
    while len(records) < 24:
        _pump(links, 1)  # writes what waits when the link is writable
        with contextlib.suppress(BlockingIOError):
            records.extend(reader.feed(peer.recv(1 << 20)))
    assert all(r == [big] for r in records)
    assert not link.waiting
    peer.close()


def test_a_second_link_for_the_same_rank_replaces_the_first(links: Links) -> None:
    old, _ = _serving(links)
    new, _ = _serving(links)
    assert old.recv(16) == b""
    assert links.send(0, [b"to the new one"])
    assert StreamReader().feed(new.recv(1024)) == [[b"to the new one"]]
    old.close()
    new.close()


def test_a_closed_rank_end_lets_the_kernel_fall_back(links: Links) -> None:
    peer, _ = _serving(links)
    peer.close()
    _pump(links, 1)
    assert not links.serves(0)
    assert links.send(0, [b"x"]) is False
