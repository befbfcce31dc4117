"""The message registry (``jupyter_shard.wire.messages``): declarations, handler tables, body checks."""

from __future__ import annotations

import json
import signal
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from jupyter_shard.env import CHECK_PROTOCOL_VAR as CHECK_ENV
from jupyter_shard.rank.io_replies import serve_io
from jupyter_shard.rank.runner import CellState, Runner
from jupyter_shard.wire.messages import (
    DONE,
    MESSAGES,
    MSG_TYPES,
    REPLIES,
    STATUS,
    STREAM,
    MsgType,
    check_body,
    handler_table,
    receiver_of,
)
from jupyter_shard.wire.protocol import ProtocolError, Wire, new_key

KERNEL_RECEIVES = {
    "ready",
    "heartbeat",
    "startup_failed",
    "stream",
    "display",
    "result",
    "done",
    "metrics",
    "prompt",
    "debug_response",
    "debug_event",
}
RANK_IO_SERVES = {"stacks", "status", "signal", "abort", "history"}


def _done(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "io_count": 2,
        "cell_id": "c1",
        "status": "ok",
        "ename": "",
        "evalue": "",
        "traceback": [],
        "duration": 0.01,
        "grouped": True,
        "ungrouped": "",
        "lost_context": "",
    }
    return {**body, **changes}


def test_the_registry_declares_every_type_once_with_its_direction() -> None:
    assert set(typing.get_args(MsgType)) == MSG_TYPES == set(MESSAGES)
    to_kernel = {name for name, kind in MESSAGES.items() if kind.direction == "to_kernel"}
    assert to_kernel == KERNEL_RECEIVES | REPLIES
    assert {
        name for name, kind in MESSAGES.items() if kind.io and kind.direction == "to_rank"
    } == RANK_IO_SERVES


def test_every_request_has_a_reply_going_the_other_way_and_every_reply_a_request() -> None:
    requests = [kind for kind in MESSAGES.values() if kind.reply is not None]
    assert {str(k.reply) for k in requests} == REPLIES == {n for n in MSG_TYPES if n.endswith("_reply")}
    for kind in requests:
        assert kind.direction == "to_rank" and kind.reply is not None
        assert kind.reply.direction == "to_kernel" and str(kind.reply) == f"{kind}_reply"
        assert kind.reply.io == kind.io  # a request served by the I/O thread is answered there


def test_a_kind_is_its_name_and_builds_its_message() -> None:
    assert DONE == "done" and {"done": 1}[DONE] == 1 and json.dumps(DONE) == '"done"'
    msg_type, body = DONE(_done())  # type: ignore[arg-type]
    assert (msg_type, body) == ("done", _done()) and type(msg_type) is str


def test_each_side_handles_exactly_the_types_it_receives() -> None:
    def h(*args: Any) -> None:
        return None

    assert receiver_of(STATUS) == "rank.io" and receiver_of(DONE) == "kernel"
    rank = {n for n, k in MESSAGES.items() if receiver_of(k) == "rank"}
    assert rank == {"execute", "push", "pull", "shutdown", "release", "regroup", "answer", "debug_request"}
    assert set(handler_table("rank", dict.fromkeys(rank, h))) == rank
    kernel = handler_table("kernel", dict.fromkeys(KERNEL_RECEIVES, h), replies=h)
    assert set(kernel) == KERNEL_RECEIVES | REPLIES
    with pytest.raises(ValueError, match=r"missing \['shutdown'\]"):
        handler_table("rank", dict.fromkeys(rank - {"shutdown"}, h))
    with pytest.raises(ValueError, match=r"never received there \['stacks'\]"):
        handler_table("rank", dict.fromkeys(rank | {"stacks"}, h))
    with pytest.raises(ValueError, match="missing"):
        handler_table("kernel", dict.fromkeys(KERNEL_RECEIVES, h))  # no reply handler
    with pytest.raises(ValueError, match="replies are handled by"):
        handler_table("kernel", dict.fromkeys(KERNEL_RECEIVES | {"pull_reply"}, h), replies=h)


def test_the_rank_tables_are_built_from_the_registry() -> None:
    previous = signal.getsignal(signal.SIGINT)
    try:
        runner = Runner(0, None, None, CellState(), None, None)  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGINT, previous)
    assert set(runner.handlers) == {n for n, k in MESSAGES.items() if receiver_of(k) == "rank"}
    channel = SimpleNamespace(io_handlers={}, heartbeat=None)
    serve_io(channel, CellState())  # type: ignore[arg-type]
    assert set(channel.io_handlers) == RANK_IO_SERVES
    assert channel.heartbeat is not None and channel.heartbeat()[0] == "heartbeat"
    assert check_body(*channel.heartbeat()) == []


def test_the_kernel_table_agrees_with_the_registry() -> None:
    from jupyter_shard import Pool

    pool = Pool(nproc=2, device="cpu")  # not started: only its parts are built
    conn = pool.connection
    assert set(conn.checked_table()) == KERNEL_RECEIVES | REPLIES


def test_check_body_accepts_a_declared_body_and_names_what_is_wrong() -> None:
    assert check_body("done", _done()) == []
    assert check_body("done", _done(duration=1)) == []  # an int is a float in JSON
    assert check_body("done", {k: v for k, v in _done().items() if k != "io_count"}) == [
        "done: missing 'io_count'"
    ]
    assert check_body("done", _done(extra=1)) == ["done: undeclared 'extra'"]
    assert check_body("done", _done(status="fine")) == ["done.status: 'fine' is not one of ('ok', 'error')"]
    assert check_body("done", _done(io_count=True)) == ["done.io_count: expected int, got bool"]
    assert check_body("done", _done(traceback=["a", 1])) == ["done.traceback[1]: expected str, got int"]
    assert check_body("done", _done(grouped=False, ungrouped="REMOTE_ERROR")) == []
    assert check_body("done", {k: v for k, v in _done().items() if k != "ungrouped"}) == []  # optional
    assert check_body("nonsense", {}) == ["unknown message type 'nonsense'"]


def test_requests_carry_a_req_id_and_optional_keys_may_be_left_out() -> None:
    assert check_body("status", {"req_id": "r"}) == []
    assert check_body("status", {}) == ["status: a request needs a string req_id"]
    assert check_body("regroup", {"req_id": "r", "store": "/tmp/s"}) == []
    assert check_body("regroup", {"req_id": "r", "prefix": 3}) == ["regroup.prefix: expected str, got int"]
    stacks = {"req_id": "r", "stacks": [{"thread": "MainThread"}]}
    assert check_body("stacks_reply", stacks) == ["stacks_reply.stacks[0]: missing 'stack'"]
    memory = {"executing": False, "cell": "", "running_for": 0.0, "step": 0}
    memory |= {"collective": "", "group_ranks": [], "waiting": ""}
    assert check_body("heartbeat", {**memory, "memory": {"rss": "big"}}) == [
        "heartbeat.memory['rss']: expected int, got str"
    ]


def test_every_declared_body_can_be_checked() -> None:
    for name, kind in MESSAGES.items():
        assert isinstance(check_body(name, {}), list), name
        typing.get_type_hints(kind.body)


def test_a_checking_wire_records_each_body_and_refuses_an_undeclared_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "sent.jsonl"
    monkeypatch.setenv(CHECK_ENV, str(record))
    wire = Wire(new_key(), "rank-0.io")
    wire.encode(*STREAM({"cell_id": "c", "name": "stdout"}), [b"text"])
    with pytest.raises(ProtocolError, match="does not declare"):
        wire.encode("done", {"cell_id": "c"})
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(x["type"], x["sender"], bool(x["problems"])) for x in lines] == [
        ("stream", "rank-0.io", False),
        ("done", "rank-0.io", True),
    ]


def test_an_unchecked_wire_signs_any_body_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHECK_ENV, raising=False)
    wire = Wire(new_key(), "kernel")
    assert wire.decode(wire.encode("done", {"anything": 1})).body == {"anything": 1}
