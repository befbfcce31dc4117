"""jupyter_shard.pool.ranks: which ranks a cell or a copy may go to, and how a rank that lost its
CUDA context shows (records with no process behind them)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jupyter_shard.errors import PoolError
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankRecord, RankState, RankTable
from tests.unit.pool.handles import IdleHandle

LOST = "CUDA error: an illegal memory access was encountered"


def _table(tmp_path: Path, nproc: int = 3, broken: tuple[int, ...] = ()) -> RankTable:
    table = RankTable(History())
    for k in range(nproc):
        record = RankRecord(IdleHandle(k), tmp_path / f"rank-{k}.log")
        record.state, record.heartbeat = RankState.IDLE, time.monotonic()
        if k in broken:
            record.state, record.broken = RankState.BROKEN, LOST
        table.add(record)
    return table


def test_a_cell_on_a_broken_rank_is_refused_in_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    table = _table(tmp_path, broken=(1,))
    started = time.perf_counter()
    with pytest.raises(PoolError) as refused:
        table.targets(None, cell=True)
    assert time.perf_counter() - started < 0.01  # nothing is asked of the ranks
    text = str(refused.value)
    assert "\n" not in text
    assert text == (
        f"rank 1 lost its CUDA context ({LOST}) and can run no cell: run %dist_restart for fresh ranks "
        "(rank state is lost; values on the CPU can be copied out first with %dist_pull NAME --rank 1)"
    )
    with pytest.raises(PoolError, match="rank 1 lost its CUDA context"):
        table.targets([1, 2], cell=True)


def test_a_copy_from_a_broken_rank_and_a_cell_on_the_others_still_go(tmp_path: Path) -> None:
    table = _table(tmp_path, broken=(1,))
    assert [r.rank for r in table.targets([1])] == [1]  # a pull or a push
    assert [r.rank for r in table.targets(None)] == [0, 1, 2]
    assert [r.rank for r in table.targets([0, 2], cell=True)] == [0, 2]


def test_the_group_is_not_rebuilt_around_a_broken_or_a_dead_rank(tmp_path: Path) -> None:
    assert _table(tmp_path).groupable()
    assert not _table(tmp_path, broken=(2,)).groupable()
    table = _table(tmp_path)
    table[0].state = RankState.DEAD
    assert not table.groupable()


def test_several_broken_ranks_are_named_together(tmp_path: Path) -> None:
    table = _table(tmp_path, nproc=4, broken=(1, 2, 3))
    with pytest.raises(PoolError, match=r"^rank 1-3 lost their CUDA context .* --rank K\)$"):
        table.targets(None, cell=True)


def test_a_broken_rank_shows_as_broken_with_the_error(tmp_path: Path) -> None:
    table = _table(tmp_path, nproc=2, broken=(1,))
    for rows in (table.activity(), table.status({})):
        assert [r.state for r in rows] == [RankState.IDLE, RankState.BROKEN]
        assert rows[0].problem == ""
        assert rows[1].problem == f"broken: CUDA context lost ({LOST}); %dist_restart for fresh ranks"


def test_a_rank_sent_a_cell_just_after_a_quiet_idle_spell_is_not_called_stuck(tmp_path: Path) -> None:
    """Between cells a rank beats every 5 s, so its last beat may be 4.9 s old when a cell is sent;
    its quiet time counts from the cell's sending. Silent 6 s into the cell, it is stuck."""
    table = _table(tmp_path, nproc=2)
    now = time.monotonic()
    for r in table:
        r.state, r.cell, r.heartbeat, r.sent = RankState.RUNNING, "train()", now - 4.9, now - 0.5
    table.records[1].sent = now - 6.0  # sent 6 s ago, and not heard from since 4.9 s before now
    table.records[1].heartbeat = now - 6.5
    rows = {row.rank: row for row in table.activity()}
    assert rows[0].problem == ""
    assert rows[1].problem.startswith("stuck: no heartbeat for 6 s"), rows[1]
