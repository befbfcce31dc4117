"""F11, F12, F13: start-up failures are fast and explained; stale state and a kernel torch are fine."""

from __future__ import annotations

import ast
import errno
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_shard import Pool, PoolError
from jupyter_shard._util.atomic import write_private
from jupyter_shard.pool import lifecycle
from jupyter_shard.pool.output import ConsoleSink

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_rank_failing_at_startup_fails_pool_start_fast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int
) -> None:
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    started = time.monotonic()
    pool = Pool(nproc=nproc, device="cpu", log_dir=tmp_path / "logs")
    with pytest.raises(PoolError) as caught:
        pool.start()
    failed_at = time.monotonic()
    took = failed_at - started
    message = str(caught.value)
    assert "failed to start" in message
    assert "ImportError: this torch is broken on purpose" in message
    assert took < 10, f"start-up failure took {took:.1f} s to report"
    assert not pool.started
    # once the environment is mended, the same pool object starts and runs a collective
    monkeypatch.delenv("PYTHONPATH")
    with pool:
        assert pool.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)").ok
        summed = pool.pull("t").item()
    back = time.monotonic() - failed_at
    assert summed == float(nproc)
    assert back < 5.0, f"a pool started and ran {back:.1f} s after the failed start"


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_torch_imported_in_kernel_first(kernel: Any, nproc: int) -> None:
    run = kernel.execute("import torch\nx = torch.ones(3).sum()\n%load_ext jupyter_shard")
    assert run.ok
    run = kernel.execute(
        f"%%distributed --nproc {nproc} --device cpu\nimport torch, torch.distributed as dist\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert run.data("execute_result") == [{"text/plain": f"{float(nproc)}"}]


def test_stale_pool_directory_is_cleaned_by_pid_and_start_time(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    unrelated = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    try:
        dead_kernel = subprocess.Popen([sys.executable, "-c", "pass"])
        dead_kernel.wait()
        stale = Path(tempfile.mkdtemp(prefix="jupyter_shard-", dir=lifecycle.runtime_root()))
        record = {
            "kernel": [dead_kernel.pid, 1.0],
            "ranks": [
                [sleeper.pid, psutil.Process(sleeper.pid).create_time()],
                [unrelated.pid, 12345.0],  # pid recorded with another start time: not ours any more
            ],
        }
        write_private(stale / "pool.json", json.dumps(record))  # 0600, as a pool writes it
        with Pool(nproc=1, device="cpu", log_dir=tmp_path) as pool:
            assert pool.run("1").value == {"text/plain": "1"}
        assert sleeper.wait(timeout=5) == -9
        assert unrelated.poll() is None, "a process whose start time did not match was signalled"
        assert not stale.exists()
    finally:
        for proc in (sleeper, unrelated):
            proc.kill()
            proc.wait()


FIXED_PORT = 29500  # torch's default MASTER_PORT: a pool must never depend on it

RANK_NETWORK = """
import os, torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
store = dist.distributed_c10d._get_default_store()
while isinstance(store, dist.PrefixStore):
    store = store.underlying_store
(t.item(), int(os.environ["MASTER_PORT"]), type(store).__name__, os.environ["JUPYTER_SHARD_STORE"])
"""


def _listening(pid: int) -> set[tuple[str, int]]:
    """The TCP and UDP addresses a process listens on."""
    conns = psutil.Process(pid).net_connections(kind="inet")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status in (psutil.CONN_LISTEN, psutil.CONN_NONE)}


@pytest.fixture
def port_29500_taken() -> Iterator[None]:
    """Someone else holds 127.0.0.1:29500 (an earlier torchrun, another notebook)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past a TIME_WAIT of an earlier run
    try:
        sock.bind(("127.0.0.1", FIXED_PORT))
        sock.listen()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        assert probe.connect_ex(("127.0.0.1", FIXED_PORT)) == 0, "29500 should be taken for this test"
    yield
    sock.close()


@pytest.mark.usefixtures("port_29500_taken")
def test_pool_runs_collectives_with_port_29500_taken_and_never_listens_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "0.0.0.0")  # left over in the kernel's environment
    monkeypatch.setenv("MASTER_PORT", str(FIXED_PORT))
    own_before = _listening(os.getpid())
    with Pool(
        nproc=2, device="cpu", log_dir=tmp_path, sink=ConsoleSink(io.StringIO(), io.StringIO())
    ) as pool:
        assert _listening(os.getpid()) == own_before, "the kernel side opened a TCP listener"
        ran = pool.run(RANK_NETWORK)
        results = [ran.ranks[k].result for k in range(2)]
        assert all(r is not None for r in results), results
        values = [ast.literal_eval(r["text/plain"]) for r in results if r is not None]
        pool_dir = pool.directory
        assert pool_dir is not None
        for value in values:
            total, master_port, store, store_path = value
            assert total == 2.0
            assert master_port != FIXED_PORT, "the ranks were given the fixed port 29500"
            assert store == "FileStore", f"rendezvous through a {store}, not a FileStore"
            assert Path(store_path).parent == pool_dir
        master_ports = {v[1] for v in values}
        for row in pool.status():
            addresses = _listening(row.pid)
            assert all(ip.startswith("127.") for ip, _ in addresses), f"rank {row.rank}: {addresses}"
            assert FIXED_PORT not in {port for _, port in addresses}, f"rank {row.rank} is on 29500"
            assert not master_ports & {port for _, port in addresses}, f"rank {row.rank}: a TCPStore"


def test_every_rank_sees_the_same_master_port(tmp_path: Path) -> None:
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(nproc=2, device="cpu", log_dir=tmp_path, sink=sink) as pool:
        ran = pool.run("import os\nint(os.environ['MASTER_PORT'])")
        ports = {k: r.result["text/plain"] if r.result else None for k, r in ran.ranks.items()}
    assert None not in ports.values() and str(FIXED_PORT) not in ports.values()
    assert len(set(ports.values())) == 1, f"MASTER_PORT by rank: {ports}"


@pytest.fixture
def runtime_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private JUPYTER_SHARD_RUNTIME_DIR (as short as the default: pool.sock paths are limited)."""
    root = Path(tempfile.mkdtemp(prefix="jsrt-"))
    monkeypatch.setenv("JUPYTER_SHARD_RUNTIME_DIR", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _sleeper() -> subprocess.Popen[bytes]:
    """A live process leading its own process group (as a rank does)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)


def _pool_dir(root: Path, record: object | None, *, age: float = 0.0, files: bool = False) -> Path:
    """A pool directory as an earlier kernel left it: record, socket and store files, an age."""
    directory = Path(tempfile.mkdtemp(prefix="jupyter_shard-", dir=root))
    if record is not None:
        write_private(directory / "pool.json", json.dumps(record))  # 0600, as a pool writes it
    if files:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:
            left.bind(str(directory / "pool.sock"))  # a socket file nobody listens on any more
        (directory / "store").write_bytes(b"\x00garbage from a rendezvous that never finished")
    if age:
        then = time.time() - age
        os.utime(directory, (then, then))
    return directory


def _run_collective(tmp_path: Path) -> Path:
    """Start a fresh pool, run an all_reduce, return the private directory it used."""
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(nproc=2, device="cpu", log_dir=tmp_path / "logs", sink=sink) as pool:
        result = pool.run(
            "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
        )
        assert result.value == {"text/plain": "2.0"}
        assert pool.directory is not None and pool.directory.is_dir()
        return pool.directory


def test_stale_files_are_cleaned_by_pid_and_start_time_and_a_live_pool_is_left_alone(
    tmp_path: Path, runtime_root: Path
) -> None:
    root = runtime_root
    procs = {name: _sleeper() for name in ("reused_pid", "orphan_rank", "live_kernel", "live_rank")}
    try:
        started = {name: psutil.Process(p.pid).create_time() for name, p in procs.items()}
        # the kernel died and its pid now belongs to another live process (another start time)
        reused = _pool_dir(
            root,
            {
                "kernel": [procs["reused_pid"].pid, started["reused_pid"] - 1000.0],
                "ranks": [[procs["orphan_rank"].pid, started["orphan_rank"]]],
            },
            files=True,
        )
        # a pool whose kernel is alive: pid and start time match
        live = _pool_dir(
            root,
            {
                "kernel": [procs["live_kernel"].pid, started["live_kernel"]],
                "ranks": [[procs["live_rank"].pid, started["live_rank"]]],
            },
            files=True,
        )
        crashed_before_record = _pool_dir(root, None, age=7200.0, files=True)
        being_started = _pool_dir(root, None, files=True)
        # another program's directory sharing the prefix (a test SLURM's state was once removed so)
        foreign = root / "jupyter_shard-slurm"
        foreign.mkdir()
        then = time.time() - 7200.0
        os.utime(foreign, (then, then))

        fresh = _run_collective(tmp_path)

        assert fresh.parent == root and fresh not in (reused, live, crashed_before_record, being_started)
        assert not fresh.exists(), "the pool's own directory outlived its shutdown"
        assert not reused.exists(), "a directory whose kernel pid was reused by another process was kept"
        assert procs["orphan_rank"].wait(timeout=5) == -9, "the dead kernel's recorded rank was not killed"
        assert procs["reused_pid"].poll() is None, "the process that reused the kernel's pid was signalled"
        assert live.is_dir() and (live / "pool.json").exists(), "a live kernel's pool directory was removed"
        assert procs["live_kernel"].poll() is None and procs["live_rank"].poll() is None
        assert not crashed_before_record.exists(), "an hour-old directory without a record was kept"
        assert being_started.is_dir(), "a young directory without a record (a pool starting) was removed"
        assert foreign.is_dir(), "a directory not named like a pool's was removed"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_stale_record_of_another_shape_does_not_block_a_fresh_start(
    tmp_path: Path, runtime_root: Path
) -> None:
    _pool_dir(runtime_root, {"pids": [1, 2]}, age=7200.0, files=True)
    _run_collective(tmp_path)
