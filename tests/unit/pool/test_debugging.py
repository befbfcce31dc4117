"""The kernel's link to ranks stopped at a breakpoint: requests answered from another thread, time-outs,
ranks that are gone, and the ranks' events, with a stand-in connection."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from jupyter_shard.pool.connection import Connection, Handler
from jupyter_shard.pool.debugging import DebugLink, set_notebook_debugger
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankRecord, RankState, RankTable
from jupyter_shard.wire.messages import DebugSetup
from jupyter_shard.wire.protocol import Message
from tests.unit.pool.handles import IdleHandle


class _Conn:
    """Keeps the handlers; ``respond`` answers each ``debug_request`` from another thread."""

    def __init__(self) -> None:
        self.table: dict[str, Handler] = {}
        self.sent: list[tuple[list[int], str, dict[str, Any]]] = []
        self.respond: Callable[[RankRecord, dict[str, Any]], Message | None] = lambda r, body: None

    def handle(self, handlers: Mapping[str, Handler]) -> None:
        self.table.update(handlers)

    def send(self, targets: Sequence[RankRecord], msg_type: str, body: Mapping[str, Any]) -> None:
        self.sent.append(([r.rank for r in targets], msg_type, dict(body)))
        for r in targets:
            reply = self.respond(r, dict(body))
            if reply is not None:
                threading.Timer(0.02, self.table["debug_response"], (r, reply)).start()


@pytest.fixture
def link(tmp_path: Path) -> tuple[DebugLink, _Conn, RankTable]:
    ranks = RankTable(History())
    for rank in range(2):
        ranks.add(RankRecord(IdleHandle(rank), tmp_path / f"rank-{rank}.log"))
    conn = _Conn()
    return DebugLink(cast(Connection, conn), ranks), conn, ranks


class _Notebook:
    def __init__(self) -> None:
        self.events: list[tuple[int, dict[str, Any]]] = []

    def setup(self) -> DebugSetup | None:
        return {"filename": "/tmp/cell.py", "breakpoints": {"/tmp/cell.py": [3]}}

    def on_event(self, rank: int, event: dict[str, Any]) -> None:
        self.events.append((rank, event))


@pytest.fixture
def notebook() -> Iterator[_Notebook]:
    nb = _Notebook()
    set_notebook_debugger(nb)
    yield nb
    set_notebook_debugger(None)


def _response(seq: int, success: bool = True, message: str = "", **body: Any) -> Message:
    return Message("debug_response", {"seq": seq, "success": success, "message": message, "body": body})


def test_the_link_handles_the_ranks_debug_messages(link: tuple[DebugLink, _Conn, RankTable]) -> None:
    assert set(link[1].table) == {"debug_response", "debug_event"}


def test_a_request_returns_the_ranks_answer_received_on_another_thread(
    link: tuple[DebugLink, _Conn, RankTable],
) -> None:
    debug, conn, _ = link
    conn.respond = lambda r, body: _response(body["seq"], variables=[{"name": "x"}])
    answer = debug.request(1, "variables", {"variablesReference": 4})
    assert answer == {"success": True, "message": "", "body": {"variables": [{"name": "x"}]}}
    [(targets, msg_type, body)] = conn.sent
    assert targets == [1] and msg_type == "debug_request"
    assert body["command"] == "variables" and body["arguments"] == {"variablesReference": 4}


def test_each_request_gets_its_own_answer_not_a_stale_one(link: tuple[DebugLink, _Conn, RankTable]) -> None:
    debug, conn, ranks = link
    conn.respond = lambda r, body: _response(body["seq"], step=body["seq"])
    first = debug.request(0, "next", {})
    conn.table["debug_response"](ranks[0], _response(999, step="stale"))  # for nobody: ignored
    second = debug.request(0, "next", {})
    assert first["body"]["step"] != second["body"]["step"]
    assert {first["body"]["step"], second["body"]["step"]} == {s["seq"] for _, _, s in conn.sent}


def test_an_answer_from_another_rank_with_the_same_seq_is_not_taken(
    link: tuple[DebugLink, _Conn, RankTable],
) -> None:
    debug, conn, ranks = link
    conn.respond = lambda r, body: None
    timer = threading.Timer(0.02, lambda: conn.table["debug_response"](ranks[1], _response(1)))
    timer.start()
    answer = debug.request(0, "scopes", {"frameId": 1}, timeout=0.3)
    timer.join()
    assert answer == {"success": False, "message": "rank 0 did not answer scopes", "body": {}}


def test_a_failed_command_keeps_the_ranks_message(link: tuple[DebugLink, _Conn, RankTable]) -> None:
    debug, conn, _ = link
    conn.respond = lambda r, body: _response(body["seq"], False, "no frame 9")
    assert debug.request(0, "scopes", {"frameId": 9}) == {
        "success": False,
        "message": "no frame 9",
        "body": {},
    }


@pytest.mark.parametrize("rank", [1, 5], ids=["dead", "missing"])
def test_a_rank_that_is_not_running_is_not_asked(link: tuple[DebugLink, _Conn, RankTable], rank: int) -> None:
    debug, conn, ranks = link
    ranks[1].state = RankState.DEAD
    assert debug.request(rank, "next", {}) == {
        "success": False,
        "message": f"rank {rank} is not running",
        "body": {},
    }
    assert conn.sent == []


def test_stopped_and_continued_events_track_the_stopped_ranks_and_reach_the_notebook(
    link: tuple[DebugLink, _Conn, RankTable], notebook: _Notebook
) -> None:
    debug, conn, ranks = link
    on_event = conn.table["debug_event"]
    on_event(ranks[1], Message("debug_event", {"event": "stopped", "body": {"threadId": 1}}))
    on_event(ranks[0], Message("debug_event", {"event": "stopped", "body": {"threadId": 1}}))
    assert debug.stopped == {0, 1}
    on_event(ranks[1], Message("debug_event", {"event": "continued", "body": {"threadId": 1}}))
    on_event(ranks[0], Message("debug_event", {"event": "output", "body": {"output": "x"}}))
    assert debug.stopped == {0}
    assert notebook.events == [
        (1, {"event": "stopped", "body": {"threadId": 1}}),
        (0, {"event": "stopped", "body": {"threadId": 1}}),
        (1, {"event": "continued", "body": {"threadId": 1}}),
        (0, {"event": "output", "body": {"output": "x"}}),
    ]


def test_events_without_a_notebook_debugger_still_track_stopped_ranks(
    link: tuple[DebugLink, _Conn, RankTable],
) -> None:
    debug, conn, ranks = link
    set_notebook_debugger(None)
    conn.table["debug_event"](ranks[0], Message("debug_event", {"event": "stopped", "body": {}}))
    assert debug.stopped == {0}


def test_setup_is_the_notebooks_while_one_is_plugged_in(notebook: _Notebook) -> None:
    assert DebugLink.setup() == {"filename": "/tmp/cell.py", "breakpoints": {"/tmp/cell.py": [3]}}
    set_notebook_debugger(None)
    assert DebugLink.setup() is None
