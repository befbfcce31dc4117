"""A pool's life without rank processes: its private directory and record, stale clean-up that kills
only by pid and start time, and start, wait and stop through a stand-in launcher."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from jupyter_shard._util.atomic import write_private
from jupyter_shard.env import RUNTIME_DIR_VAR, RankEnv
from jupyter_shard.errors import PoolError
from jupyter_shard.launchers import resolve_spec
from jupyter_shard.launchers.base import Launcher, RankHandle, RankLaunch
from jupyter_shard.pool import lifecycle
from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.history import History
from jupyter_shard.pool.lifecycle import Lifecycle, clean_stale_pools, new_log_dir, new_pool_dir, record_pool
from jupyter_shard.pool.ranks import RankState, RankTable
from jupyter_shard.spec import LaunchSpec

ME = [os.getpid(), psutil.Process().create_time()]


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids clean-up would kill (nothing is killed)."""
    pids: list[int] = []
    monkeypatch.setattr(lifecycle, "kill_recorded", pids.append)
    return pids


def _pool_dir(root: Path, name: str, record: object) -> Path:
    directory = root / name
    directory.mkdir(mode=0o700)
    write_private(directory / "pool.json", record if isinstance(record, str) else json.dumps(record))
    return directory


def test_a_pool_whose_kernel_is_gone_is_removed_killing_only_ranks_that_match(
    tmp_path: Path, killed: list[int]
) -> None:
    # the kernel's pid is this process, but its start time is not: that kernel is gone
    ranks = [ME, [os.getpid(), ME[1] + 1000], [os.getpid(), None]]
    gone = _pool_dir(tmp_path, "jupyter_shard-abcd1234", {"kernel": [os.getpid(), 1.0], "ranks": ranks})
    assert clean_stale_pools(tmp_path) == [gone]
    assert not gone.exists()
    assert killed == [os.getpid()]  # only the rank whose pid and start time both still match


def test_a_pool_whose_kernel_lives_is_kept(tmp_path: Path, killed: list[int]) -> None:
    live = _pool_dir(tmp_path, "jupyter_shard-abcd1234", {"kernel": ME, "ranks": [ME]})
    assert clean_stale_pools(tmp_path) == []
    assert live.exists() and killed == []


@pytest.mark.parametrize("name", ["jupyter_shard-mine", "jupyter_shard-ABCD1234", "jupyter_shard-abcd12345"])
def test_a_directory_not_made_by_new_pool_dir_is_never_touched(
    tmp_path: Path, killed: list[int], name: str
) -> None:
    other = _pool_dir(tmp_path, name, {"kernel": [os.getpid(), 1.0], "ranks": [ME]})
    assert clean_stale_pools(tmp_path) == []
    assert other.exists() and killed == []


@pytest.mark.parametrize(
    "record",
    [
        "not json",
        {"ranks": []},
        {"kernel": [True, 1.0], "ranks": []},
        {"kernel": ME, "ranks": [[1, 2, 3]]},
        {"kernel": ME, "ranks": [["1", 2.0]]},
    ],
    ids=["not-json", "no-kernel", "bool-pid", "three-items", "text-pid"],
)
def test_an_unreadable_record_is_removed_only_when_old_and_never_kills(
    tmp_path: Path, killed: list[int], record: object
) -> None:
    directory = _pool_dir(tmp_path, "jupyter_shard-abcd1234", record)
    assert clean_stale_pools(tmp_path) == []
    assert directory.exists()
    old = time.time() - 7200
    os.utime(directory, (old, old))
    assert clean_stale_pools(tmp_path) == [directory]
    assert not directory.exists() and killed == []


def test_record_pool_writes_the_kernel_and_each_rank_with_start_times(tmp_path: Path) -> None:
    record_pool(tmp_path, [os.getpid(), 999_999_999])
    written = json.loads((tmp_path / "pool.json").read_text())
    assert written == {"kernel": ME, "ranks": [ME, [999_999_999, None]]}
    assert not (tmp_path / "pool.json.tmp").exists()


def test_a_new_pool_dir_is_private_in_the_runtime_dir_and_found_by_clean_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, killed: list[int]
) -> None:
    monkeypatch.setenv(RUNTIME_DIR_VAR, str(tmp_path))
    directory = new_pool_dir()
    assert directory.parent == tmp_path
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    write_private(directory / "pool.json", json.dumps({"kernel": [os.getpid(), 1.0], "ranks": []}))
    assert clean_stale_pools() == [directory]


def test_each_log_dir_is_new_and_private(tmp_path: Path) -> None:
    first, second = new_log_dir(tmp_path), new_log_dir(tmp_path)
    assert first != second and first.parent == second.parent == tmp_path
    assert stat.S_IMODE(first.stat().st_mode) == 0o700


class _Handle(RankHandle):
    def __init__(self, rank: int, code: int | None = None) -> None:
        self.rank, self.pid, self.host = rank, 0, "elsewhere"
        self.code = code
        self.waited: list[float] = []
        self.killed = 0

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        raise AssertionError("not used")

    def kill_tree(self) -> None:
        self.killed += 1

    def wait(self, timeout: float) -> int | None:
        self.waited.append(timeout)
        return self.code

    def startup_tail(self) -> str | None:
        return "ModuleNotFoundError: No module named 'torch'"


class _Launcher(Launcher):
    name = "fake"

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.launches: list[RankLaunch] = []
        self.lifeline = -1
        self.handles: list[_Handle] = []
        self.stopped = 0
        self.waits: list[str | None] = []

    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        if self.fail is not None:
            raise self.fail
        self.launches, self.lifeline = ranks, lifeline_fd
        self.handles = [_Handle(launch.rank) for launch in ranks]
        return list(self.handles)

    def waiting(self) -> str | None:
        return self.waits.pop(0) if self.waits else None

    def stop(self) -> None:
        self.stopped += 1


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short runtime directory (socket paths have a length limit)."""
    root = Path(tempfile.mkdtemp(prefix="jsu", dir="/tmp"))
    monkeypatch.setenv(RUNTIME_DIR_VAR, str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _started(
    runtime: Path, monkeypatch: pytest.MonkeyPatch, launcher: _Launcher, nproc: int = 2
) -> tuple[Lifecycle, RankTable]:
    monkeypatch.setattr(lifecycle, "get_launcher", lambda name: launcher)
    ranks = RankTable(History())
    life = Lifecycle(Connection(ranks), ranks, runtime / "logs")
    life.conn.handle({})  # no handlers: attach must still accept the table below
    return life, ranks


def _spec(nproc: int = 2) -> LaunchSpec:
    return resolve_spec(nproc=nproc, gpu_count=0)


def _accepting(life: Lifecycle) -> None:
    from jupyter_shard.wire.messages import MESSAGES, REPLIES, receiver_of

    names = [n for n, kind in MESSAGES.items() if receiver_of(kind) == "kernel" and n not in REPLIES]
    life.conn.handle(dict.fromkeys(names, lambda r, m: None))


def test_start_opens_a_private_pool_and_tells_each_rank_where_it_is(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _Launcher()
    life, ranks = _started(runtime, monkeypatch, launcher)
    _accepting(life)
    signals: list[tuple[int, int]] = []
    records = life.start(_spec(), lambda rank, sig: signals.append((rank, sig)))
    try:
        assert [r.rank for r in records] == [0, 1] and list(ranks) == records
        assert life.directory is not None and life.directory.parent == runtime
        assert stat.S_IMODE(life.directory.stat().st_mode) == 0o700
        assert life.address == f"ipc://{life.directory / 'pool.sock'}"
        assert life.conn.open
        envs = [RankEnv.from_env(launch.env) for launch in launcher.launches]
        assert [(e.rank, e.world_size) for e in envs] == [(0, 2), (1, 2)]
        assert {e.address for e in envs} == {life.address}
        assert len({e.key for e in envs}) == 1 and len({e.master_port for e in envs}) == 1
        assert life.log_dir is not None and records[1].log_path == life.log_dir / "rank-1.log"
        assert json.loads((life.directory / "pool.json").read_text())["kernel"] == ME
        with pytest.raises(OSError):  # the read end went to the launcher; the kernel keeps none
            os.fstat(launcher.lifeline)
        launcher.signal_rank(1, 2)
        assert signals == [(1, 2)]
    finally:
        life.stop()


def test_a_launcher_that_fails_leaves_nothing_open(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _Launcher(fail=PoolError("no such partition"))
    life, ranks = _started(runtime, monkeypatch, launcher)
    _accepting(life)
    with pytest.raises(PoolError, match="no such partition"):
        life.start(_spec(), lambda rank, sig: None)
    assert not life.conn.open and life.directory is None
    assert [p for p in runtime.iterdir() if p.name.startswith("jupyter_shard-")] == []
    assert list(ranks) == []


def test_a_rank_that_ends_while_starting_fails_the_start_with_why(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _Launcher()
    life, _ = _started(runtime, monkeypatch, launcher)
    _accepting(life)
    records = life.start(_spec(), lambda rank, sig: None)
    try:
        records[0].state = RankState.IDLE
        launcher.handles[1].code = 3
        with pytest.raises(PoolError) as info:
            life.wait_ready(lambda line: None)
        message = str(info.value)
        assert message.startswith(
            f"rank 1 failed to start (exited with code 3); its log {records[1].log_path}"
        )
        assert message.endswith("ends with:\nModuleNotFoundError: No module named 'torch'")
        records[1].log_path.write_text("Traceback ...\nRuntimeError: gloo failed\n")
        with pytest.raises(PoolError, match=r"ends with:\nTraceback ...\nRuntimeError: gloo failed$"):
            life.wait_ready(lambda line: None)
    finally:
        life.stop()


def test_ranks_that_never_say_ready_time_out_naming_them_but_a_queue_holds_the_clock(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "START_TIMEOUT", 0.3)
    launcher = _Launcher()
    life, _ = _started(runtime, monkeypatch, launcher)
    _accepting(life)
    records = life.start(_spec(3), lambda rank, sig: None)
    try:
        records[1].state = RankState.IDLE
        launcher.waits = ["job 7 is queued", "job 7 is queued", "waiting for node 1"]
        notices: list[str] = []
        with pytest.raises(PoolError, match=r"rank 0,2 did not start within 0 s; see the logs in"):
            life.wait_ready(notices.append)
        assert notices == ["job 7 is queued", "waiting for node 1"]  # each change said once
        assert launcher.waits == []
    finally:
        life.stop()


def test_wait_ready_returns_once_every_rank_is_ready(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _Launcher()
    life, _ = _started(runtime, monkeypatch, launcher)
    _accepting(life)
    ranks = life.start(_spec(), lambda rank, sig: None)
    ranks[0].state = RankState.IDLE  # rank 1 still starting
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (life.wait_ready(lambda line: None), done.set()))
    try:
        waiter.start()
        assert not done.wait(0.5), "wait_ready returned while rank 1 was still starting"
        ranks[1].state = RankState.IDLE
        assert done.wait(2.0), "wait_ready did not return once every rank was ready"
    finally:
        waiter.join(5)
        life.stop()


def test_stop_ends_every_rank_and_releases_everything_once(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _Launcher()
    life, ranks = _started(runtime, monkeypatch, launcher)
    _accepting(life)
    life.start(_spec(), lambda rank, sig: None)
    directory = life.directory
    assert directory is not None
    life.stop()  # the ranks never connected: telling them to stop fails quietly, killing does not
    assert [h.killed for h in launcher.handles] == [1, 1]
    assert all(h.waited and h.waited[0] <= 1.0 for h in launcher.handles)
    assert list(ranks) == [] and launcher.stopped == 1
    assert not directory.exists() and not life.conn.open and life.launcher is None
    life.stop()  # again: nothing left to do
    assert launcher.stopped == 1


class _ByHand(_Launcher):
    """Nodes that joined by hand: the ranks dial back, and nothing of the pool runs from here."""

    name = "by-hand"
    remote = True
    keeps = True


def test_a_pool_with_nothing_running_from_here_is_not_kept(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    life, _ = _started(runtime, monkeypatch, _ByHand())
    _accepting(life)
    life.start(_spec(), lambda rank, sig: None)
    try:
        with pytest.raises(PoolError, match=r"^--keep: no process of this pool runs from this machine"):
            life.keep(60, _spec())
        assert not (life.directory / "kept.json").exists()  # type: ignore[operator]
    finally:
        life.stop()
