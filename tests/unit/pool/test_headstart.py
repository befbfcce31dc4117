"""A cell sent before its run: when it may go ahead, which run takes it, and how one nobody takes is
ended, with stand-ins for the pool's parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from jupyter_shard.pool.background import Watcher
from jupyter_shard.pool.cell import CellGathering, Gathering
from jupyter_shard.pool.escalation import Escalation
from jupyter_shard.pool.headstart import Ahead
from jupyter_shard.pool.ranks import RankState, RankTable
from jupyter_shard.pool.results import RunResult


@dataclass
class _Rank:
    state: RankState = RankState.IDLE
    dead: bool = False


@dataclass
class _Cells:
    current: Any = None
    out_of_step: str = ""
    ends_by_itself: bool = False
    step_error: Exception | None = None
    interrupted_with: list[str] = field(default_factory=list)

    def step(self, gathering: Gathering, timeout: float) -> bool:
        if self.step_error is not None:
            raise self.step_error
        return self.ends_by_itself

    def interrupted(self, gathering: Gathering, why: str) -> None:
        self.interrupted_with.append(why)


@dataclass
class _Escalation:
    restart_reason: str | None = None
    regroup_needed: bool = False


@dataclass
class _Watcher:
    is_settled: bool = True
    foreground: bool = False

    def settled(self) -> bool:
        return self.is_settled


class _Parts:
    def __init__(self) -> None:
        self.cells, self.escalation, self.watcher = _Cells(), _Escalation(), _Watcher()
        self.ranks = [_Rank(), _Rank()]
        self.begun: list[tuple[Any, ...]] = []
        self.ended: list[Gathering] = []
        self.fail: Exception | None = None
        self.ahead = Ahead(
            cast(CellGathering, self.cells),
            cast(RankTable, self.ranks),
            cast(Escalation, self.escalation),
            cast(Watcher, self.watcher),
            self.begin,
            self.ended.append,
        )

    def begin(self, code: str, ranks: Any, timeout: float | None, exec_count: int, record: bool) -> Gathering:
        self.begun.append((code, ranks, timeout, exec_count, record))
        if self.fail is not None:
            raise self.fail
        return Gathering(RunResult("c", {}), [0, 1], 0.0, timeout, code=code)


@pytest.fixture
def parts() -> _Parts:
    return _Parts()


def test_a_cell_goes_ahead_when_its_run_would_send_it_at_once(parts: _Parts) -> None:
    assert parts.ahead.send("step()", [0, 1], 5.0, 7)
    assert parts.begun == [("step()", [0, 1], 5.0, 7, True)]  # recorded, as a run's cell
    assert parts.watcher.foreground  # the run that takes it receives it
    assert not parts.ahead.send("step()", [0, 1], 5.0, 8)  # one at a time
    assert len(parts.begun) == 1


@pytest.mark.parametrize(
    "blocker",
    [
        "background-run",
        "a-cell-in-flight",
        "restart-due",
        "regroup-due",
        "out-of-step",
        "a-rank-running",
        "a-rank-starting",
        "a-dead-rank",
    ],
)
def test_a_cell_does_not_go_ahead_when_its_run_would_first_do_or_say_something(
    parts: _Parts, blocker: str
) -> None:
    if blocker == "background-run":
        parts.watcher.is_settled = False
    elif blocker == "a-cell-in-flight":
        parts.cells.current = object()
    elif blocker == "restart-due":
        parts.escalation.restart_reason = "the spec changed"
    elif blocker == "regroup-due":
        parts.escalation.regroup_needed = True
    elif blocker == "out-of-step":
        parts.cells.out_of_step = "rank 1 ran a different cell"
    elif blocker == "a-rank-running":
        parts.ranks[1].state = RankState.RUNNING
    elif blocker == "a-rank-starting":
        parts.ranks[0].state = RankState.STARTING
    else:
        parts.ranks[1].dead = True
    assert not parts.ahead.send("step()", None, None, 1)
    assert parts.begun == [] and not parts.watcher.foreground
    assert parts.ahead.take("step()", None, None) is None


@pytest.mark.parametrize("state", [RankState.FAILED, RankState.INTERRUPTED])
def test_ranks_whose_last_cell_failed_or_was_interrupted_may_take_one(
    parts: _Parts, state: RankState
) -> None:
    parts.ranks[0].state = state
    assert parts.ahead.send("x", None, None, 1)


def test_the_run_with_the_same_arguments_takes_the_cell(parts: _Parts) -> None:
    parts.ahead.send("step()", [1], None, 3)
    taken = parts.ahead.take("step()", [1], None)
    assert taken is not None and taken.taken().code == "step()"
    assert taken.foreground is False  # the watcher's flag before the send, for the run to restore
    assert parts.ahead.take("step()", [1], None) is None  # taken once
    assert parts.ended == []


@pytest.mark.parametrize(
    ("code", "ranks", "timeout"), [("other()", [1], None), ("step()", [0], None), ("step()", [1], 9.0)]
)
def test_a_run_with_other_arguments_ends_the_cell_sent_ahead_first(
    parts: _Parts, code: str, ranks: list[int], timeout: float | None
) -> None:
    parts.ahead.send("step()", [1], None, 3)
    assert parts.ahead.take(code, ranks, timeout) is None
    assert [g.code for g in parts.ended] == ["step()"]
    assert parts.cells.interrupted_with == ["interrupted"]
    assert not parts.watcher.foreground  # restored


def test_a_send_that_failed_fails_the_run_that_takes_it(parts: _Parts) -> None:
    parts.fail = RuntimeError("rank 1 is not connected")
    assert parts.ahead.send("step()", None, None, 1)  # it went, as far as the caller can tell
    taken = parts.ahead.take("step()", None, None)
    assert taken is not None
    with pytest.raises(RuntimeError, match="rank 1 is not connected"):
        taken.taken()


def test_settling_a_failed_send_only_restores_the_watcher(parts: _Parts) -> None:
    parts.fail = RuntimeError("boom")
    parts.ahead.send("step()", None, None, 1)
    parts.ahead.settle()
    assert parts.ended == [] and parts.cells.interrupted_with == [] and not parts.watcher.foreground


def test_a_cell_that_ended_by_itself_is_closed_without_an_interrupt(parts: _Parts) -> None:
    parts.ahead.send("step()", None, None, 1)
    parts.cells.ends_by_itself = True
    parts.ahead.settle()
    assert len(parts.ended) == 1 and parts.cells.interrupted_with == []
    parts.ahead.settle()  # nothing left
    assert len(parts.ended) == 1


def test_a_cell_is_closed_and_the_watcher_restored_even_when_receiving_fails(parts: _Parts) -> None:
    parts.ahead.send("step()", None, None, 1)
    assert parts.watcher.foreground
    parts.cells.step_error = ConnectionError("socket closed")
    with pytest.raises(ConnectionError):
        parts.ahead.settle()
    assert len(parts.ended) == 1 and parts.watcher.foreground is False
    assert parts.ahead.send("again()", None, None, 2)  # free for the next one
