"""A background run's handle (its end, its error, waiting for it) and the watcher thread that drives it
between cells, with a stand-in for the cell gathering."""

from __future__ import annotations

import contextvars
import threading
import time
from typing import cast

import pytest

from jupyter_shard.errors import PoolError
from jupyter_shard.pool.background import BackgroundRun, Watcher, refuse_while_running
from jupyter_shard.pool.cell import CellGathering, Gathering
from jupyter_shard.pool.results import DistributedError, RankResult, RunResult

CELL = contextvars.ContextVar("CELL", default="no cell")


def _gathering(*statuses: str) -> Gathering:
    ranks = {rank: RankResult(rank, status) for rank, status in enumerate(statuses)}
    g = Gathering(RunResult("c1", ranks), list(ranks), time.monotonic(), None)
    g.pending = {rank for rank, status in enumerate(statuses) if status == "pending"}
    return g


class _Cells:
    """What a background run asks of the cell gathering: a step, or an interrupt."""

    def __init__(self, ends_after: int) -> None:
        self.steps = 0
        self.ends_after = ends_after
        self.interrupts: list[str] = []

    def step(self, gathering: Gathering, timeout: float) -> bool:
        self.steps += 1
        if self.steps >= self.ends_after:
            for res in gathering.result.ranks.values():
                res.status = "ok"
            return True
        return False

    def interrupted(self, gathering: Gathering, why: str) -> None:
        self.interrupts.append(why)
        for res in gathering.result.ranks.values():
            res.status = "interrupted"


def test_a_run_that_ends_well_finishes_once_and_wait_returns_its_result() -> None:
    done: list[BackgroundRun] = []
    run = BackgroundRun(_gathering("ok", "ok"), 3, on_done=done.append)
    assert run.running and run.unsettled and "running" in repr(run)
    run.finish()
    run.finish()  # a second end is ignored
    assert done == [run]
    assert not run.running and run.error is None and not run.unsettled
    assert run.wait(timeout=1.0) is run.result
    assert run.reported and "finished" in repr(run)


def test_a_failed_run_raises_its_distributed_error_and_is_unsettled_until_seen() -> None:
    run = BackgroundRun(_gathering("ok", "error"), 4)
    run.result.ranks[1].ename, run.result.ranks[1].evalue = "ValueError", "bad"
    run.finish()
    assert isinstance(run.error, DistributedError) and run.error.rank == 1
    assert run.unsettled and "failed" in repr(run)
    with pytest.raises(DistributedError, match="rank 1 failed first: ValueError: bad"):
        run.wait()
    assert run.reported and not run.unsettled


def test_an_error_given_to_finish_wins_over_the_result() -> None:
    run = BackgroundRun(_gathering("ok"), 1)
    run.finish(PoolError("the pool stopped"))
    with pytest.raises(PoolError, match="the pool stopped"):
        run.wait()


def test_wait_with_a_timeout_asks_for_prompts_and_then_gives_up() -> None:
    asked: list[None] = []
    run = BackgroundRun(_gathering("pending"), 7, serve_prompts=lambda: asked.append(None))
    with pytest.raises(TimeoutError, match=r"the background run of cell \[7\] \(running for .* s\) is still"):
        run.wait(timeout=0.12)
    assert asked and not run.reported


def test_a_step_receives_until_the_cell_ends_then_closes_it() -> None:
    ended: list[Gathering] = []
    run = BackgroundRun(_gathering("pending"), 2)
    cells = _Cells(ends_after=2)
    run.step(cast(CellGathering, cells), ended.append)
    assert run.running and ended == []
    run.step(cast(CellGathering, cells), ended.append)
    assert ended == [run.gathering] and not run.running and run.error is None


def test_a_requested_interrupt_stops_the_cell_instead_of_receiving() -> None:
    ended: list[Gathering] = []
    run = BackgroundRun(_gathering("pending", "pending"), 2)
    run.interrupt_requested = True
    cells = _Cells(ends_after=99)
    run.step(cast(CellGathering, cells), ended.append)
    assert cells.interrupts == ["interrupted (%dist_interrupt)"] and cells.steps == 0
    assert ended == [run.gathering] and not run.interrupt_requested
    assert isinstance(run.error, DistributedError)
    assert str(run.error).startswith("interrupted: KeyboardInterrupt on rank 0-1")


def test_abandon_reports_only_pending_ranks_lost_and_ends_in_the_starting_cells_context() -> None:
    token = CELL.set("cell 5")
    try:
        seen: list[str] = []
        run = BackgroundRun(_gathering("ok", "pending"), 5, on_done=lambda r: seen.append(CELL.get()))
    finally:
        CELL.reset(token)
    run.abandon("the pool was shut down")
    assert seen == ["cell 5"]  # on_done ran inside the copy of the starting cell's context
    assert run.result.ranks[0].status == "ok"
    lost = run.result.ranks[1]
    assert lost.status == "dead" and lost.evalue == "rank 1: the pool was shut down"
    assert lost.traceback == ["rank 1: the pool was shut down while the background cell ran"]
    assert isinstance(run.error, DistributedError) and run.error.rank == 1


def test_only_a_running_run_refuses_other_work() -> None:
    refuse_while_running(None, "push")
    run = BackgroundRun(_gathering("pending"), 9)
    with pytest.raises(
        PoolError, match=r"cannot push: the background run of cell \[9\].*%dist_wait.*%dist_int"
    ):
        refuse_while_running(run, "push")
    run.finish()
    refuse_while_running(run, "push")


class _WatchedPool:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.alive = True
        self.run: BackgroundRun | None = None
        self.idle = threading.Event()
        self.background_contexts: list[str] = []
        self.background_stepped = threading.Event()
        self.watcher = Watcher(self.lock, lambda: self.alive, self.idle.set, self.step, lambda: self.run)

    def step(self, run: BackgroundRun) -> None:
        self.background_contexts.append(CELL.get())
        self.background_stepped.set()


def test_the_watcher_steps_idle_between_cells_and_stops_on_request() -> None:
    pool = _WatchedPool()
    pool.watcher.start()
    try:
        assert pool.idle.wait(2.0)
    finally:
        pool.watcher.stop()
    pool.idle.clear()
    time.sleep(0.15)
    assert not pool.idle.is_set()


def test_the_watcher_drives_a_background_run_in_its_cells_context() -> None:
    pool = _WatchedPool()
    token = CELL.set("cell 8")
    try:
        pool.run = BackgroundRun(_gathering("pending"), 8)
    finally:
        CELL.reset(token)
    pool.watcher.start()
    try:
        assert pool.background_stepped.wait(2.0)
    finally:
        pool.watcher.stop()
    assert set(pool.background_contexts) == {"cell 8"}
    assert not pool.idle.is_set()


def test_the_watcher_stands_aside_for_a_foreground_cell_and_ends_with_the_pool() -> None:
    pool = _WatchedPool()
    pool.watcher.foreground = True
    pool.watcher.start()
    try:
        time.sleep(0.2)
        assert not pool.idle.is_set()
        pool.alive = False
        pool.watcher.foreground = False
        time.sleep(0.2)
        assert not pool.idle.is_set()
    finally:
        pool.watcher.stop()


def test_settled_means_alive_and_no_unseen_background_run() -> None:
    pool = _WatchedPool()
    assert pool.watcher.settled()
    pool.run = BackgroundRun(_gathering("pending"), 1)
    assert not pool.watcher.settled()
    pool.run.result.ranks[0].status = "error"
    pool.run.finish()
    assert not pool.watcher.settled()  # failed, and nobody has seen it yet
    pool.run.reported = True
    assert pool.watcher.settled()
    pool.alive = False
    assert not pool.watcher.settled()
