"""``Pool``, the facade, without rank processes: what it checks before it starts anything, a pool
that never started, refusals while a background run goes on, and its life as a context manager with
a stand-in launcher whose "ranks" are in-process ZeroMQ sockets that say ``ready``."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from jupyter_shard.env import RUNTIME_DIR_VAR, RankEnv
from jupyter_shard.errors import PoolError, SpecError
from jupyter_shard.launchers.base import Launcher, RankHandle, RankLaunch
from jupyter_shard.pool import lifecycle
from jupyter_shard.pool.background import BackgroundRun
from jupyter_shard.pool.cell import Gathering
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.pool.pool import Pool, latest_pool
from jupyter_shard.pool.results import RankResult, RunResult
from jupyter_shard.spec import LaunchSpec
from jupyter_shard.wire.protocol import Wire, rank_identity


def _pool(**kwargs: Any) -> Pool:
    kwargs.setdefault("nproc", 2)
    kwargs.setdefault("device", "cpu")
    return Pool(sink=ConsoleSink(io.StringIO(), io.StringIO()), **kwargs)


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting ranks is a test error."""

    def refuse(*args: object) -> None:
        raise AssertionError("the pool tried to start ranks")

    monkeypatch.setattr(lifecycle.Lifecycle, "start", refuse)


@pytest.mark.parametrize(
    "kwargs",
    [{"nproc": 0}, {"strategy": "no-such-strategy"}, {"device": "tpu"}, {"launcher": "nowhere"}],
    ids=["no-ranks", "strategy", "device", "launcher"],
)
def test_bad_options_are_one_spec_error_before_anything_starts(
    no_start: None, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(SpecError) as info:
        _pool(**kwargs)
    assert "\n" not in str(info.value)


def test_a_pool_that_never_started_reports_nothing_running(no_start: None) -> None:
    pool = _pool(nproc=3)
    assert not pool.started and pool.world_size == 3
    assert pool.launch_path == "not started" and pool.launcher is None
    assert pool.log_dir is None and pool.directory is None and pool.address == "" and pool.curve is None
    assert pool.dropped == 0
    assert pool.status() == [] and pool.activity() == []
    assert pool.last_result is None and pool.last_transfer is None and pool.last_values() == {}
    assert pool.interrupt() == []
    pool.shutdown()  # stopping what never started is harmless
    assert not pool.started


def test_stacks_of_a_pool_that_is_not_running_is_empty_or_a_pool_error(no_start: None) -> None:
    pool = _pool()
    try:
        stacks = pool.stacks()
    except PoolError:
        return
    assert stacks == {}


def test_a_pool_made_from_a_spec_uses_it_as_given(no_start: None) -> None:
    spec = LaunchSpec.create(nproc=4, device="cpu")
    pool = Pool(spec=spec, nproc=1, sink=ConsoleSink(io.StringIO(), io.StringIO()))
    assert pool.spec is spec and pool.world_size == 4


def test_values_that_cannot_be_named_are_refused_before_the_pool_starts(no_start: None) -> None:
    pool = _pool()
    with pytest.raises(TypeError, match="push takes its values by name"):
        pool.push([1, 2])  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="each name must be a Python identifier"):
        pool.push({"not a name": 1})
    assert not pool.started


def _running(pool: Pool, exec_count: int = 3) -> BackgroundRun:
    ranks = {0: RankResult(0), 1: RankResult(1)}
    run = BackgroundRun(Gathering(RunResult("bg", ranks), [0, 1], time.monotonic(), None), exec_count)
    pool.background = run
    return run


@pytest.mark.parametrize(
    ("action", "what"),
    [
        (lambda p: p.run("x = 1"), "run a cell"),
        (lambda p: p.push(x=1), "push values"),
        (lambda p: p.pull("x"), "pull values"),
        (lambda p: p.pull_all("x"), "pull values"),
        (lambda p: p.last_values(), "pull values"),
        (lambda p: p.run_background("x = 1"), "start another background run"),
    ],
    ids=["run", "push", "pull", "pull_all", "last_values", "run_background"],
)
def test_work_is_refused_while_a_background_run_goes_on(no_start: None, action: Any, what: str) -> None:
    pool = _pool()
    _running(pool)
    with pytest.raises(
        PoolError, match=rf"^cannot {what}: the background run of cell \[3\] .*%dist_wait waits"
    ):
        action(pool)
    assert not pool.started


def test_an_interrupt_of_a_background_run_is_left_to_the_watcher(no_start: None) -> None:
    pool = _pool()
    run = _running(pool)
    assert pool.interrupt() == [0, 1]
    assert run.interrupt_requested and run.running


def test_shutdown_reports_a_running_background_run_lost(no_start: None) -> None:
    pool = _pool()
    run = _running(pool)
    pool.shutdown()
    assert not run.running
    assert run.result.ranks[0].evalue == "rank 0: the pool was shut down"


class _DialBack(RankHandle):
    def __init__(self, rank: int) -> None:
        self.rank, self.pid, self.host = rank, 0, "elsewhere"
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        raise AssertionError("not used")

    def kill_tree(self) -> None:
        self.code = -9

    def wait(self, timeout: float) -> int | None:
        return self.code


class _Launcher(Launcher):
    """Each "rank" is a DEALER socket that dials the pool with the key it was given and says ready."""

    name = "fake"

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []
        self.handles: list[_DialBack] = []
        self.starts = 0
        self.stops = 0

    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        self.starts += 1
        for launch in ranks:
            orders = RankEnv.from_env(launch.env)
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, rank_identity(orders.rank).encode())
            sock.connect(orders.address)
            body = {"rank": orders.rank, "pid": 0, "host": "elsewhere", "device": "cpu"}
            body |= {"log_path": str(launch.log_path), "node": 0, "job": ""}
            wire = Wire(bytes.fromhex(orders.key), rank_identity(orders.rank))
            sock.send_multipart(wire.to_socket("ready", body))
            self.sockets.append(sock)
        self.handles = [_DialBack(launch.rank) for launch in ranks]
        return list(self.handles)

    def launch_path(self) -> str:
        return "dialled back in-process"

    def stop(self) -> None:
        self.stops += 1

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Launcher]:
    root = Path(tempfile.mkdtemp(prefix="jsp", dir="/tmp"))  # short: socket paths have a length limit
    monkeypatch.setenv(RUNTIME_DIR_VAR, str(root))
    fake = _Launcher()
    monkeypatch.setattr(lifecycle, "get_launcher", lambda name: fake)
    yield fake
    fake.close()
    shutil.rmtree(root, ignore_errors=True)


def test_as_a_context_manager_the_pool_starts_and_always_shuts_down(
    launcher: _Launcher, tmp_path: Path
) -> None:
    pool = _pool(log_dir=tmp_path / "logs")
    with pytest.raises(KeyError, match="in the cell"), pool as entered:
        assert entered is pool and pool.started
        assert latest_pool() is pool
        assert pool.launch_path == "dialled back in-process"
        directory = pool.directory
        assert directory is not None and directory.is_dir()
        assert pool.log_dir is not None and pool.log_dir.parent == tmp_path / "logs"
        assert pool.sink.log_paths == {k: str(pool.log_dir / f"rank-{k}.log") for k in (0, 1)}
        assert [r.rank for r in pool.activity()] == [0, 1]
        pool.start()  # already running: nothing new
        assert launcher.starts == 1
        raise KeyError("in the cell")
    assert not pool.started and not directory.exists()
    assert [h.code for h in launcher.handles] == [-9, -9] and launcher.stops == 1
    assert latest_pool() is pool  # kept for its history


def test_a_restart_starts_new_ranks(launcher: _Launcher) -> None:
    with _pool() as pool:
        first = pool.directory
        pool.restart()
        assert pool.started and pool.directory != first and launcher.starts == 2
        assert first is not None and not first.exists()


def test_a_start_that_fails_leaves_the_pool_stopped(
    launcher: _Launcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(self: Any, notice: Any, progress: Any) -> None:
        raise PoolError("rank 1 failed to start")

    monkeypatch.setattr(lifecycle.Lifecycle, "wait_ready", fail)
    pool = _pool()
    with pytest.raises(PoolError, match="rank 1 failed to start"):
        pool.start()
    assert not pool.started and pool.directory is None
    assert [h.code for h in launcher.handles] == [-9, -9]
    assert os.environ.get("JUPYTER_SHARD_KEY") is None  # the key never entered this process's environment
