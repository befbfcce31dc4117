"""The kernel's end of the wire: authentication and dispatch by type, sending to a rank's main or I/O
thread, and requests that wait for replies, over an in-process ZeroMQ pair."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from jupyter_shard.errors import PoolError
from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankRecord, RankTable
from jupyter_shard.wire.messages import REPLIES
from jupyter_shard.wire.protocol import KERNEL, Message, Wire, io_identity, new_key, rank_identity
from tests.unit.pool.handles import IdleHandle


def _all_handlers(conn: Connection, seen: list[tuple[int, str]]) -> None:
    """A handler for every type the kernel receives, recording ``(rank, type)``."""
    from jupyter_shard.wire.messages import MESSAGES, receiver_of

    names = [n for n, kind in MESSAGES.items() if receiver_of(kind) == "kernel" and n not in REPLIES]
    conn.handle({n: (lambda r, m: seen.append((r.rank, m.type))) for n in names})


class _Pair:
    """A ``Connection`` on a ROUTER socket and one rank's main and I/O sockets, all in one process."""

    def __init__(self, tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self.key = new_key()
        self.ranks = RankTable(History())
        self.record = RankRecord(IdleHandle(0), tmp_path / "rank-0.log")
        self.ranks.add(self.record)
        self.conn = Connection(self.ranks)
        self.seen: list[tuple[int, str]] = []
        _all_handlers(self.conn, self.seen)
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(address)
        self.conn.attach(router, Wire(self.key, KERNEL))
        self.main, self.io = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock, identity in ((self.main, rank_identity(0)), (self.io, io_identity(0))):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, identity.encode())
            sock.connect(address)
        self.main_wire, self.io_wire = Wire(self.key, rank_identity(0)), Wire(self.key, io_identity(0))
        self.kernel_view = Wire(self.key, "observer")  # reads what the kernel sent

    def say_hello(self) -> None:
        """Make the ROUTER know both peers (a ROUTER routes only to identities it has heard from)."""
        self.main.send_multipart(self.main_wire.to_socket("ready", {}))
        self.io.send_multipart(self.io_wire.to_socket("heartbeat", {}))
        for _ in range(50):
            self.conn.pump(0.05)
            if len(self.seen) == 2:
                return
        raise AssertionError(f"the hello messages did not arrive: {self.seen}")

    def close(self) -> None:
        self.conn.detach()
        self.main.close(linger=0)
        self.io.close(linger=0)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[_Pair]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    p = _Pair(tmp_path, ctx, f"inproc://pool-{id(tmp_path)}")
    yield p
    p.close()
    ctx.term()


def _frames(wire: Wire, identity: str, msg_type: str, body: dict[str, object] | None = None) -> list[bytes]:
    return [identity.encode(), *wire.to_socket(msg_type, body or {})]


def _bare(tmp_path: Path, ranks: int = 1) -> tuple[Connection, RankTable, list[tuple[int, str]]]:
    table = RankTable(History())
    for rank in range(ranks):
        table.add(RankRecord(IdleHandle(rank), tmp_path / f"rank-{rank}.log"))
    conn = Connection(table)
    seen: list[tuple[int, str]] = []
    _all_handlers(conn, seen)
    return conn, table, seen


def test_a_message_goes_to_the_handler_of_its_type_with_the_rank_that_sent_it(tmp_path: Path) -> None:
    conn, table, seen = _bare(tmp_path, ranks=2)
    key = new_key()
    kernel, rank1 = Wire(key, KERNEL), Wire(key, rank_identity(1))
    conn.dispatch(kernel, _frames(rank1, rank_identity(1), "ready"))
    assert seen == [(1, "ready")]
    assert conn.dropped == 0
    assert table[1].io_received == 0  # the main thread's message is not counted as I/O


def test_only_io_messages_are_counted_and_reported_as_io(tmp_path: Path) -> None:
    conn, table, seen = _bare(tmp_path)
    key = new_key()
    kernel, io = Wire(key, KERNEL), Wire(key, io_identity(0))
    io_seen: list[int] = []
    conn.on_io = lambda r: io_seen.append(r.rank)
    conn.dispatch(kernel, _frames(io, io_identity(0), "heartbeat"))
    conn.dispatch(kernel, _frames(io, io_identity(0), "stream", {"cell_id": "c", "name": "stdout"}))
    assert [t for _, t in seen] == ["heartbeat", "stream"]
    assert table[0].io_received == 2 and io_seen == [0, 0]


@pytest.mark.parametrize(
    "case", ["unknown-peer", "not-a-rank", "bad-signature", "other-sender", "replay"], ids=str
)
def test_a_message_that_fails_authentication_is_dropped_and_counted(tmp_path: Path, case: str) -> None:
    conn, table, seen = _bare(tmp_path)
    key = new_key()
    kernel = Wire(key, KERNEL)
    if case == "unknown-peer":  # rank 7 is not in the table
        frames = _frames(Wire(key, rank_identity(7)), rank_identity(7), "ready")
    elif case == "not-a-rank":
        frames = _frames(Wire(key, "intruder"), "intruder", "ready")
    elif case == "bad-signature":
        frames = _frames(Wire(new_key(), rank_identity(0)), rank_identity(0), "ready")
    elif case == "other-sender":  # signed as rank 1 but arriving on rank 0's identity
        frames = _frames(Wire(key, rank_identity(1)), rank_identity(0), "ready")
    else:
        frames = _frames(Wire(key, rank_identity(0)), rank_identity(0), "ready")
        conn.dispatch(kernel, frames)
        seen.clear()
    conn.dispatch(kernel, frames)
    assert seen == []
    assert conn.dropped == 1
    assert table[0].io_received == 0


def test_a_kernel_bound_type_without_a_handler_is_dropped_not_fatal(tmp_path: Path) -> None:
    table = RankTable(History())
    table.add(RankRecord(IdleHandle(0), tmp_path / "rank-0.log"))
    conn = Connection(table)  # no handlers but the replies'
    key = new_key()
    conn.dispatch(Wire(key, KERNEL), _frames(Wire(key, rank_identity(0)), rank_identity(0), "ready"))
    assert conn.dropped == 1


def test_attach_refuses_a_table_that_misses_a_type(tmp_path: Path) -> None:
    conn = Connection(RankTable(History()))
    conn.handle({"ready": lambda r, m: None})
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(ValueError, match="missing"):
            conn.attach(sock, Wire(new_key(), KERNEL))
        assert not conn.open
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_detached_connection_is_closed_and_pump_does_nothing(tmp_path: Path) -> None:
    conn, _, _ = _bare(tmp_path)
    assert not conn.open
    conn.pump(0.0)  # nothing attached: returns at once
    conn.detach()
    assert not conn.open and conn.socket is None and conn.wire is None


def test_main_thread_types_go_to_the_rank_and_io_types_to_its_io_thread(pair: _Pair) -> None:
    pair.say_hello()
    pair.conn.send([pair.record], "execute", {"cell_id": "c", "code": "1"})
    pair.conn.send([pair.record], "stacks", {"req_id": "r"})
    assert pair.main.poll(2000) and pair.io.poll(2000)
    on_main = pair.kernel_view.from_socket(pair.main.recv_multipart())
    on_io = pair.kernel_view.from_socket(pair.io.recv_multipart())
    assert (on_main.type, on_main.body["code"], on_main.sender) == ("execute", "1", KERNEL)
    assert on_io.type == "stacks"
    assert not pair.main.poll(50) and not pair.io.poll(50)  # each went to one place only


def test_sending_to_a_rank_that_never_connected_says_to_restart(pair: _Pair, tmp_path: Path) -> None:
    ghost = RankRecord(IdleHandle(3), tmp_path / "rank-3.log")
    with pytest.raises(PoolError, match=r"rank 3 is not connected .*; run %dist_restart"):
        pair.conn.send([ghost], "execute", {"cell_id": "c", "code": "1"})


def test_a_request_returns_each_targets_reply_and_forgets_the_request(pair: _Pair) -> None:
    pair.say_hello()

    def answer() -> None:
        if pair.io.poll(5000):
            asked = pair.kernel_view.from_socket(pair.io.recv_multipart())
            reply = {"req_id": asked.body["req_id"], "answer": 42}
            pair.io.send_multipart(pair.io_wire.to_socket("status_reply", reply))

    rank = threading.Thread(target=answer)
    rank.start()
    replies = pair.conn.request("status", {}, [pair.record], timeout=5.0)
    rank.join()
    assert list(replies) == [0]
    assert isinstance(replies[0], Message) and replies[0].body["answer"] == 42
    assert pair.conn.waiting_requests == []


def test_a_request_nobody_answers_ends_at_its_timeout_with_no_replies(pair: _Pair) -> None:
    pair.say_hello()
    assert pair.conn.request("status", {}, [pair.record], timeout=0.1) == {}
    assert pair.conn.waiting_requests == []


def test_a_reply_to_another_request_is_not_taken_as_this_ones(pair: _Pair) -> None:
    pair.say_hello()
    pair.io.send_multipart(pair.io_wire.to_socket("status_reply", {"req_id": "stale"}))
    assert pair.conn.request("status", {}, [pair.record], timeout=0.2) == {}


def test_one_pump_takes_a_burst_larger_than_a_drain_in_order(pair: _Pair) -> None:
    """At 1,024 ranks a cell ends with 1,024 messages at once: a pump takes them all, in the order
    sent, a batch of ``DRAIN`` at a time with a poll (the links' turn) between batches."""
    from jupyter_shard.pool.connection import DRAIN

    pair.say_hello()
    pair.seen.clear()
    count = 2 * DRAIN + 37
    steps: list[int] = []
    pair.conn.table["metrics"] = lambda r, m: steps.append(int(m.body["count"]))
    for k in range(count):
        pair.io.send_multipart(pair.io_wire.to_socket("metrics", {"names": [], "count": k}))
    for _ in range(100):
        pair.conn.pump(0.05)
        if len(steps) == count:
            break
    assert steps == list(range(count))
    assert pair.record.io_received == count + 1  # and the hello heartbeat
    assert pair.conn.dropped == 0
