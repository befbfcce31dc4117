"""Background runs and the live per-rank view through the Python API, with real ranks.

``Pool.run_background`` returns at once; the pool's watcher thread follows the run, notices deaths
and escalates an interrupt. ``Pool.activity`` is what the dashboard shows: it must name dead and
stuck ranks from heartbeats alone.
"""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_shard import DistributedError, Pool, PoolError
from jupyter_shard.pool.background import BackgroundRun
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.pool.ranks import RankSnapshot
from jupyter_shard.rank.channel import IDLE_HEARTBEAT_INTERVAL

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with Pool(
        nproc=2, device="cpu", log_dir=tmp_path_factory.mktemp("logs"), sink=ConsoleSink(io.StringIO())
    ) as p:
        yield p


def test_background_run_returns_at_once_and_wait_gives_the_value(pool: Pool) -> None:
    ended: list[BackgroundRun] = []
    started = time.monotonic()
    run = pool.run_background(
        "import time\nfor i in range(20):\n    shard.log(loss=1.0 / (i + 1))\n    time.sleep(0.05)\n'done'",
        on_done=ended.append,
    )
    assert time.monotonic() - started < 0.5
    assert run.running
    with pytest.raises(PoolError, match=r"cannot run a cell: the background run of cell \[0\].*%dist_wait"):
        pool.run("1")
    with pytest.raises(PoolError, match="cannot push values"):
        pool.push(x=1)
    status = pool.status()  # status works while the ranks are busy
    assert [row.state.value for row in status] == ["running", "running"]
    result = run.wait(30)
    assert result.value == {"text/plain": "'done'"}
    assert ended == [run] and run.error is None
    assert len([r for r in pool.history if r["rank"] == 0]) == 20
    assert pool.run("2").value == {"text/plain": "2"}  # the pool is free again


def test_background_error_is_kept_and_raised_by_wait(pool: Pool) -> None:
    run = pool.run_background("if shard.rank == 1:\n    raise ValueError('bad batch')\n")
    with pytest.raises(DistributedError, match="rank 1 failed first: ValueError: bad batch"):
        run.wait(30)
    assert run.error is not None and run.reported


def _started(tmp_path: Path, body: str) -> str:
    """A background cell that first says on disk that it runs on this rank, then ``body``."""
    return f"import pathlib, time\npathlib.Path({str(tmp_path)!r}, f'started-{{shard.rank}}').touch()\n{body}"


def _wait_started(tmp_path: Path, ranks: int) -> None:
    deadline = time.monotonic() + 15.0
    while len(list(tmp_path.glob("started-*"))) < ranks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(list(tmp_path.glob("started-*"))) == ranks


def test_interrupt_stops_a_background_run_within_the_grace_period(pool: Pool, tmp_path: Path) -> None:
    run = pool.run_background(_started(tmp_path, "while True:\n    time.sleep(0.05)\n"))
    _wait_started(tmp_path, 2)
    asked = time.monotonic()
    pool.interrupt()
    with pytest.raises(DistributedError, match="interrupted: KeyboardInterrupt on rank 0-1"):
        run.wait(10)
    assert time.monotonic() - asked < 3.0
    assert pool.run("'alive'").value == {"text/plain": "'alive'"}


def test_shutdown_during_a_background_run_reports_it_lost(pool: Pool, tmp_path: Path) -> None:
    run = pool.run_background(_started(tmp_path, "time.sleep(60)\n"))
    _wait_started(tmp_path, 2)
    pool.shutdown()
    with pytest.raises(DistributedError, match="the pool was shut down"):
        run.wait(5)


def _activity_once_flagged(pool: Pool, rank: int, within: float) -> list[RankSnapshot]:
    """``pool.activity()`` as soon as ``rank`` has a problem, or after ``within`` seconds."""
    deadline = time.monotonic() + within
    rows = pool.activity()
    while not rows[rank].problem and time.monotonic() < deadline:
        time.sleep(0.05)
        rows = pool.activity()
    return rows


def test_activity_names_a_rank_that_died_between_cells(pool: Pool) -> None:
    victim = pool.status()[1].pid
    os.kill(victim, signal.SIGKILL)
    rows = _activity_once_flagged(pool, 1, within=3.0)
    assert rows[1].problem.startswith("dead: was killed by SIGKILL"), rows[1]
    assert rows[0].problem == ""


def test_activity_calls_a_rank_stuck_when_its_heartbeat_stops(pool: Pool) -> None:
    # ctypes.PyDLL keeps the GIL during the call: the rank's I/O thread cannot send heartbeats.
    run = pool.run_background("import ctypes\nif shard.rank == 0:\n    ctypes.PyDLL(None).sleep(8)\n")
    rows = _activity_once_flagged(pool, 0, within=12.0)
    assert rows[0].problem.startswith("stuck: no heartbeat for"), rows[0]
    # rank 1 ended its part at once: idle, it beats every IDLE_HEARTBEAT_INTERVAL and is not stuck
    assert rows[1].problem == "" and rows[1].heartbeat_age is not None
    assert rows[1].heartbeat_age < IDLE_HEARTBEAT_INTERVAL + 1.5, rows[1]
    run.wait(15)
    assert pool.activity()[0].problem == ""


def test_a_rank_holding_the_gil_in_a_long_import_is_busy_importing_not_stuck(
    pool: Pool, tmp_path: Path
) -> None:
    """As torch's or transformers' import does on a busy machine: heartbeats pause, no false alarm."""
    (tmp_path / "js_slow_outer.py").write_text("import js_slow_inner\n")
    (tmp_path / "js_slow_inner.py").write_text(
        "import ctypes, time\ntime.sleep(1.5)\nctypes.PyDLL(None).sleep(8)\n"  # a heartbeat, then none
    )
    path = str(tmp_path)
    code = f"import sys\nif shard.rank == 0:\n    sys.path.insert(0, {path!r})\n    import js_slow_outer\n"
    run = pool.run_background(code)
    deadline = time.monotonic() + 12.0
    rows = pool.activity()
    while time.monotonic() < deadline and not (rows[0].heartbeat_age or 0) > 6.0:
        time.sleep(0.1)
        rows = pool.activity()
    assert (rows[0].heartbeat_age or 0) > 6.0, rows[0]  # the heartbeats did stop
    assert rows[0].problem == "", rows[0]
    assert "· importing js_slow_outer, no heartbeat for " in rows[0].cell, rows[0]
    run.wait(15)
    assert pool.activity()[0].problem == "" and pool.activity()[0].cell == ""


def test_heartbeats_bring_memory_and_step(pool: Pool) -> None:
    pool.run(
        "import torch\nm = torch.nn.Linear(4, 1)\n"
        "model, opt = shard.prepare(m, torch.optim.SGD(m.parameters(), 0.1))\n"
        "for _ in range(3):\n    shard.backward(model(torch.ones(2, 4)).sum()); shard.step()\n"
    )
    deadline = time.monotonic() + 10.0
    rows = pool.activity()
    while (
        not all(row.step == 3 and row.memory.get("rss", 0) > 0 for row in rows)
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)  # until a heartbeat after the cell has brought each rank's step and memory
        rows = pool.activity()
    assert all(row.memory["rss"] > 50 * 2**20 for row in rows)
    assert all(row.step == 3 for row in rows), rows
    times, rss, _ = pool.history.memory(0)
    assert len(times) >= 1 and rss[-1] > 0
