"""The prompts of a cell's ranks: shown after the rank's earlier output, one at a time in rank order,
answered to that rank only, refused at once where no one can answer, told (not asked) for a
background run."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.pool import prompts as prompts_module
from jupyter_shard.pool.history import History
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.pool.prompts import Prompts, refusal
from jupyter_shard.pool.ranks import RankRecord, RankState, RankTable
from jupyter_shard.pool.stdin import EOF, CallbackStdin, NoStdin, StdinSource, default_stdin
from jupyter_shard.wire.protocol import Message
from tests.unit.pool.handles import IdleHandle


class Scripted(StdinSource):
    """Answers given by the test, one per start(); None until the test releases one."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, bool]] = []
        self.ready: list[Any] = []

    def start(self, prompt: str, password: bool) -> None:
        self.asked.append((prompt, password))

    def poll(self) -> Any:
        return self.ready.pop(0) if self.ready else None


@pytest.fixture
def table(tmp_path: Path) -> RankTable:
    ranks = RankTable(History())
    for k in range(3):
        record = RankRecord(IdleHandle(k, host="here"), tmp_path / f"rank-{k}.log")
        record.state = RankState.RUNNING
        ranks.add(record)
    return ranks


def _request(prompt: str, io_count: int = 0, password: bool = False) -> Message:
    body = {"cell_id": "c", "prompt": prompt, "password": password, "io_count": io_count}
    return Message("prompt", body)


class _Sent:
    def __init__(self) -> None:
        self.messages: list[tuple[int, dict[str, Any]]] = []

    def __call__(self, targets: Any, msg_type: str, body: dict[str, Any]) -> None:
        assert msg_type == "answer"
        self.messages.extend((r.rank, body) for r in targets)


def _settle(p: Prompts, table: RankTable, source: StdinSource | None, sent: _Sent, sink: ConsoleSink) -> None:
    time.sleep(prompts_module.TOGETHER + 0.01)
    p.serve(table, source, sent, sink)


def test_ranks_asking_together_are_asked_in_rank_order_and_answered_each(table: RankTable) -> None:
    p, sent, source = Prompts(), _Sent(), Scripted()
    out = io.StringIO()
    sink = ConsoleSink(out, io.StringIO())
    p.add(table[2], _request("b? "))
    p.add(table[0], _request("a? "))
    assert table[2].waiting == "b?" and table[0].waiting == "a?"
    _settle(p, table, source, sent, sink)
    assert source.asked == [("[rank 0] a? ", False)]  # rank 0 first, though it asked second
    source.ready.append("zero")
    p.serve(table, source, sent, sink)
    assert sent.messages == [(0, {"value": "zero", "error": "", "eof": False})]
    assert table[0].waiting == "" and table[2].waiting == "b?"
    assert source.asked[-1] == ("[rank 2] b? ", False)
    source.ready.append(EOF)
    p.serve(table, source, sent, sink)
    assert sent.messages[-1] == (2, {"value": "", "error": "", "eof": True})
    assert "[rank 0] a? zero" in out.getvalue()  # the exchange, in the rank's own output


def test_a_prompt_waits_for_the_output_its_rank_wrote_before_it(table: RankTable, monkeypatch: Any) -> None:
    p, sent, source = Prompts(), _Sent(), Scripted()
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    p.add(table[1], _request("now? ", io_count=3))
    table[1].io_received = 2
    _settle(p, table, source, sent, sink)
    assert source.asked == []
    table[1].io_received = 3
    p.serve(table, source, sent, sink)
    assert source.asked == [("[rank 1] now? ", False)]
    # Output lost on the way does not keep the prompt back for ever.
    monkeypatch.setattr(prompts_module, "OUTPUT_WAIT", 0.0)
    p.add(table[2], _request("late? ", io_count=99))
    source.ready.append("x")
    p.serve(table, source, sent, sink)  # rank 1 answered
    _settle(p, table, source, sent, sink)
    assert source.asked[-1] == ("[rank 2] late? ", False)


def test_a_password_is_not_written_into_the_ranks_output(table: RankTable) -> None:
    p, sent, source = Prompts(), _Sent(), Scripted()
    out = io.StringIO()
    sink = ConsoleSink(out, io.StringIO())
    p.add(table[0], _request("Password: ", password=True))
    _settle(p, table, source, sent, sink)
    assert source.asked == [("[rank 0] Password: ", True)]
    source.ready.append("hunter2")
    p.serve(table, source, sent, sink)
    assert sent.messages[0][1]["value"] == "hunter2"
    assert "hunter2" not in out.getvalue()


def test_where_no_one_can_answer_every_waiting_rank_is_told_why_at_once(table: RankTable) -> None:
    p, sent = Prompts(), _Sent()
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    p.add(table[0], _request("x? "))
    p.add(table[1], _request("(Pdb) "))
    _settle(p, table, NoStdin("nobody is there"), sent, sink)
    errors = {rank: body["error"] for rank, body in sent.messages}
    assert errors[0] == refusal(0, "x? ", "nobody is there")
    assert "input() on rank 0" in errors[0] and "Pool(stdin=...)" in errors[0]
    assert "pdb on rank 1" in errors[1] and "%dist_stacks" in errors[1]
    assert p.waiting == {} and table[0].waiting == table[1].waiting == ""


def test_a_background_run_says_once_that_a_rank_waits_and_keeps_the_prompt(table: RankTable) -> None:
    p, sent = Prompts(), _Sent()
    err = io.StringIO()
    sink = ConsoleSink(io.StringIO(), err)
    p.add(table[1], _request("bg? "))
    _settle(p, table, None, sent, sink)
    p.serve(table, None, sent, sink)
    assert err.getvalue().count("rank 1 is waiting at a prompt (bg?): %dist_wait shows it") == 1
    assert sent.messages == [] and 1 in p.waiting
    source = CallbackStdin(lambda prompt: prompt.upper())
    p.serve(table, source, sent, sink)  # %dist_wait's thread
    p.serve(table, source, sent, sink)
    assert sent.messages == [(1, {"value": "[RANK 1] BG? ", "error": "", "eof": False})]


def test_a_rank_at_a_prompt_shows_as_such_and_not_as_stuck(table: RankTable) -> None:
    table[1].waiting = "(Pdb)"
    table[0].heartbeat = table[1].heartbeat = time.monotonic() - 60  # "stuck" after a silent minute
    rows = {row.rank: row for row in table.activity()}
    assert rows[1].state is RankState.PROMPT and rows[1].problem == ""
    assert rows[0].state is RankState.RUNNING and rows[0].problem.startswith("stuck")


def test_callback_stdin_turns_eoferror_into_end_of_input() -> None:
    def closed(prompt: str) -> str:
        raise EOFError

    source = CallbackStdin(closed)
    assert source.poll() is None  # nothing asked yet
    source.start("p? ", False)
    assert source.poll() is EOF


def test_a_script_without_a_terminal_cannot_be_asked(monkeypatch: Any) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO())
    source = default_stdin()
    assert isinstance(source, NoStdin) and "no terminal" in source.unavailable()
