"""F7, F8, F17: no rank or grandchild outlives its kernel; start/stop cycles leak nothing."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest

from tests.faults.conftest import alive, rank_pids, wait_gone

pytestmark = pytest.mark.timeout(180)


def _start_with_grandchildren(kernel: Any, nproc: int) -> list[int]:
    """Ranks, what they started (a process, a DataLoader worker) and the zygote the ranks came from."""
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(f"%%distributed --nproc {nproc} --device cpu\nimport torch").ok
    pids = rank_pids(kernel)
    run = kernel.execute(
        "%%distributed\n"
        "import subprocess, torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "sleeper = subprocess.Popen(['sleep', '1000'])\n"
        "loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=1, "
        "persistent_workers=True)\n"
        "batches = iter(loader); next(batches)\n"
        "print('children', len(__import__('psutil').Process().children(recursive=True)))\n"
    )
    assert run.ok, run.outputs
    family = list(pids)
    for pid in pids:
        family += [c.pid for c in psutil.Process(pid).children(recursive=True)]
    assert len(family) >= 3 * nproc, f"expected ranks + sleep + DataLoader worker each: {family}"
    zygotes = [
        c.pid
        for c in psutil.Process(kernel.pid).children()
        if "jupyter_shard.launchers.zygote" in " ".join(c.cmdline())
    ]
    assert zygotes, "the ranks came from a zygote"
    return family + zygotes


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_kernel_sigkill_takes_ranks_and_grandchildren_within_2s(kernel: Any, nproc: int) -> None:
    family = _start_with_grandchildren(kernel, nproc)
    os.kill(kernel.pid, signal.SIGKILL)
    took = wait_gone(family, within=2.0)
    assert took < 2.0


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_kernel_restart_removes_ranks_before_new_kernel_runs(kernel: Any, nproc: int) -> None:
    family = _start_with_grandchildren(kernel, nproc)
    kernel.km.restart_kernel(now=False)
    kernel.kc.wait_for_ready(timeout=60)
    # the new kernel's first cell looks for them: already gone, not gone by the time the test looks
    run = kernel.execute(
        "import psutil\n"
        f"[p for p in {family!r} if psutil.pid_exists(p) and psutil.Process(p).status() != 'zombie']"
    )
    assert run.ok, run.outputs
    assert run.data("execute_result") == [{"text/plain": "[]"}]
    assert alive(family) == []


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_kernel_shutdown_removes_ranks(kernel: Any, nproc: int) -> None:
    family = _start_with_grandchildren(kernel, nproc)
    kernel.shutdown()
    wait_gone(family, within=2.0)


class Snapshot(NamedTuple):
    children: set[int]
    fds: int
    inet: int
    runtime: set[str]
    tmp: set[str]
    shm: set[str]


def _snapshot(runtime: Path, tmp: Path) -> Snapshot:
    me = psutil.Process()
    return Snapshot(
        children={c.pid for c in me.children(recursive=True)},
        fds=len(os.listdir("/proc/self/fd")),
        inet=len(me.net_connections(kind="inet")),
        runtime={p.name for p in runtime.iterdir()},
        tmp={p.name for p in tmp.iterdir()},
        shm=set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set(),
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_start_stop_cycles_leak_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int) -> None:
    """F17: 50 pools of ``nproc`` ranks started, used for a collective and a push and pull through
    shared memory, and stopped leave no process, fd (a segment is one), socket or port, pool
    directory, temp file (ranks inherit ``TMPDIR``) or /dev/shm entry behind."""
    import torch

    from jupyter_shard import Pool
    from jupyter_shard.transfer import peer_memory

    runtime = Path(tempfile.mkdtemp(prefix="jsrt-"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("JUPYTER_SHARD_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR in this process too
    logs = tmp_path / "logs"

    with Pool(nproc=nproc, device="cpu", log_dir=logs) as pool:
        pool.run("x = 1")
    before = _snapshot(runtime, tmp)
    cycles = int(os.environ.get("JUPYTER_SHARD_CYCLES", "50"))
    cell = "import torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))\ndist.barrier()"
    payload = torch.randn(1 << 20)
    for cycle in range(cycles):
        # 4 MiB: copied straight into and out of the ranks' memory, and in every other cycle (as
        # where the system forbids that) through a shared-memory segment
        direct = cycle % 2 == 0
        path = "direct" if direct else "segment"
        monkeypatch.setattr(peer_memory, "supported", lambda direct=direct: direct)
        with Pool(nproc=nproc, device="cpu", log_dir=logs) as pool:
            assert pool.run(cell).ok
            pool.push(payload=payload)
            assert pool.last_transfer is not None and pool.last_transfer.path == path
            assert torch.equal(pool.pull("payload", rank=nproc - 1), payload)
            assert pool.last_transfer is not None and pool.last_transfer.path == path
    after = _snapshot(runtime, tmp)
    assert after.children == before.children, "leaked child processes"
    assert after.fds <= before.fds, f"leaked fds: {before.fds} -> {after.fds}"
    assert after.inet <= before.inet, f"leaked sockets or ports: {before.inet} -> {after.inet}"
    assert after.runtime == before.runtime == set(), "leaked pool directories"
    assert after.tmp == before.tmp, f"leaked temp files: {sorted(after.tmp - before.tmp)}"
    assert after.shm == before.shm, "leaked /dev/shm entries"
    assert len(list(logs.iterdir())) == cycles + 1, "each pool keeps its own log directory"
