"""jupyter_shard.rank.channel: the main thread's ShellSocket, over ZeroMQ and over the direct link.

The kernel's end is played in this process: a ROUTER on an ``inproc://`` address and, for the direct
link, a Unix stream socket in the test's directory. (The I/O thread's Channel, and its loop going on
through failures, are tested in ``tests/unit/rank/test_io.py``.)
"""

from __future__ import annotations

import collections
import io
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from jupyter_shard.rank.channel import ShellSocket
from jupyter_shard.wire.protocol import (
    KERNEL,
    Message,
    StreamReader,
    Wire,
    new_key,
    rank_identity,
    stream_record,
    write_stream,
)

pytestmark = pytest.mark.timeout(30)

RANK = rank_identity(0)
READY = {"rank": 0, "pid": 1, "host": "h", "device": "cpu", "log_path": "", "node": 0, "job": ""}


@dataclass
class Kernel:
    router: zmq.Socket[bytes]
    wire: Wire  # signs what the kernel sends
    reader_wire: Wire  # checks what the rank sends
    listener: socket.socket
    path: str
    link: socket.socket | None = None

    def send(self, msg_type: str, body: dict[str, object]) -> None:
        self.router.send_multipart([RANK.encode(), *self.wire.to_socket(msg_type, body)])

    def send_on_link(self, msg_type: str, body: dict[str, object]) -> None:
        assert self.link is not None
        write_stream(self.link, collections.deque(stream_record(self.wire.to_socket(msg_type, body))))

    def receive(self) -> Message:
        assert self.router.poll(5000)
        identity, *frames = self.router.recv_multipart()
        assert identity == RANK.encode()
        return self.reader_wire.from_socket(frames, expect_sender=RANK)

    def accept(self) -> list[bytes]:
        """Take the rank's link; the first record names the rank."""
        self.link, _ = self.listener.accept()
        return self.read_records(1)[0]

    def read_records(self, n: int) -> list[list[bytes]]:
        assert self.link is not None
        reader, records = StreamReader(), []
        while len(records) < n:
            records += reader.feed(self.link.recv(1 << 16))
        return records


@pytest.fixture
def wired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Kernel, ShellSocket]]:
    monkeypatch.setattr(sys, "__stderr__", io.StringIO())
    key = new_key()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://kernel")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "direct.sock")
    listener.bind(path)
    listener.listen(1)
    shell = ShellSocket(ctx, "inproc://kernel", key, RANK)
    kernel = Kernel(router, Wire(key, KERNEL), Wire(key, KERNEL), listener, path)
    yield kernel, shell
    for s in (kernel.link, listener):
        if s is not None:
            s.close()
    ctx.destroy(linger=0)


def _log() -> str:
    log = sys.__stderr__
    assert isinstance(log, io.StringIO)
    return log.getvalue()


def test_over_the_socket_messages_go_both_ways_signed(wired: tuple[Kernel, ShellSocket]) -> None:
    kernel, shell = wired
    shell.send("ready", READY)  # the ROUTER learns the rank's identity from its first message
    msg = kernel.receive()
    assert (msg.type, msg.body, msg.sender) == ("ready", READY, RANK)
    assert shell.poll_recv(0) is None
    kernel.send("execute", {"cell_id": "c", "code": "1"})
    got = shell.recv()
    assert (got.type, got.body["code"], got.sender) == ("execute", "1", KERNEL)


def test_a_message_that_fails_its_checks_is_dropped_and_the_next_one_read(
    wired: tuple[Kernel, ShellSocket],
) -> None:
    kernel, shell = wired
    shell.send("ready", READY)
    kernel.receive()
    forged = Wire(new_key(), KERNEL)
    kernel.router.send_multipart([RANK.encode(), *forged.to_socket("shutdown", {})])
    assert shell.poll_recv(2000) is None
    assert "jupyter_shard: dropped a message from the kernel: bad signature" in _log()
    kernel.send("shutdown", {})
    assert shell.recv().type == "shutdown"


def test_over_the_direct_link_messages_go_both_ways(wired: tuple[Kernel, ShellSocket]) -> None:
    kernel, shell = wired
    shell.connect_direct(kernel.path)
    assert kernel.accept() == [RANK.encode()]
    shell.send("ready", READY)
    (record,) = kernel.read_records(1)
    assert kernel.reader_wire.from_socket(record, expect_sender=RANK).body == READY
    assert not kernel.router.poll(50), "nothing went over the socket"
    kernel.send_on_link("execute", {"cell_id": "c", "code": "2"})
    assert shell.recv().body["code"] == "2"


def test_a_message_waiting_on_the_socket_is_read_before_the_links(wired: tuple[Kernel, ShellSocket]) -> None:
    kernel, shell = wired
    shell.send("ready", READY)
    kernel.receive()
    shell.connect_direct(kernel.path)
    kernel.accept()
    kernel.send("execute", {"cell_id": "a", "code": "older"})  # sent before the link was up
    time.sleep(0.05)
    kernel.send_on_link("execute", {"cell_id": "b", "code": "newer"})
    kernel.send_on_link("execute", {"cell_id": "c", "code": "newest"})
    time.sleep(0.05)
    got = [shell.poll_recv(2000) for _ in range(3)]
    assert [m.body["code"] if m else None for m in got] == ["older", "newer", "newest"]
    assert "dropped" not in _log()


def test_without_a_link_the_rank_stays_on_the_socket(
    wired: tuple[Kernel, ShellSocket], tmp_path: Path
) -> None:
    kernel, shell = wired
    shell.connect_direct(str(tmp_path / "missing.sock"))
    assert "jupyter_shard: no direct link to the kernel (" in _log()
    assert "); using the socket" in _log()
    shell.send("ready", READY)
    assert kernel.receive().type == "ready"


def test_a_link_the_kernel_closes_falls_back_to_the_socket(wired: tuple[Kernel, ShellSocket]) -> None:
    kernel, shell = wired
    shell.send("ready", READY)
    kernel.receive()
    shell.connect_direct(kernel.path)
    kernel.accept()
    assert kernel.link is not None
    kernel.link.close()
    kernel.link = None
    assert shell.poll_recv(2000) is None
    assert "the direct link to the kernel closed (the kernel closed it); using the socket" in _log()
    shell.send("ready", READY)
    assert kernel.receive().type == "ready"
    kernel.send("shutdown", {})
    assert shell.recv().type == "shutdown"
