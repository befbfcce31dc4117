"""Kept pools (``--keep``) whose ranks a node agent started: two torchrun agents on this machine, and a
SLURM job step on the local cluster. The kernel is killed; the agents (and the SLURM job) stay for the
lease; a kernel attaches over the same Curve-encrypted TCP socket and finds the ranks' state and a
working process group; ``python -m jupyter_shard stop`` and a lease that runs out leave no process,
job or directory behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import jupyter_shard
from jupyter_shard.env import RUNTIME_DIR_VAR
from jupyter_shard.pool.keep import kept_pools

from .conftest import SlurmCluster

pytestmark = pytest.mark.timeout(240)

# A kernel that keeps its pool for KEEP seconds, gives its ranks state, says where, and is killed.
DRIVER = """
import json, os, signal, sys
from jupyter_shard import Pool
from jupyter_shard.launchers import resolve_spec
spec = resolve_spec(device="cpu", strategy="ddp", **json.loads(sys.argv[1]))
pool = Pool(spec=spec, keep=float(sys.argv[2]))
pool.start()
pool.run("import os, torch, torch.distributed as dist\\nkept = 41 + dist.get_rank()")
name = getattr(pool.launcher, "job_name", "")
found = {"dir": str(pool.directory), "tethers": pool.launcher.local_pids(), "name": name}
print(json.dumps(found), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
TORCHRUN = {"launcher": "torchrun", "hosts": "localhost,localhost", "nproc": 1}


@pytest.fixture
def runtime(kept_runtime: Path) -> Path:
    return kept_runtime


def _killed_kernel(options: dict[str, object], keep: float) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(options), str(keep)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == -9, done.stderr[-3000:]
    started: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return started


def _family(tethers: list[int]) -> list[psutil.Process]:
    """The tethers, the agents under them and the ranks under those."""
    found = [psutil.Process(pid) for pid in tethers]
    return found + [child for p in found for child in p.children(recursive=True)]


def _queued(name: str) -> bool:
    out = subprocess.run(["squeue", "-h", f"--name={name}", "-o", "%i"], capture_output=True, text=True)
    return bool(out.stdout.strip())


def _attach_and_check(world: int) -> jupyter_shard.Pool:
    started = time.monotonic()
    pool = jupyter_shard.attach()
    took = time.monotonic() - started
    assert took < 1.0, took
    result = pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nprint(kept, int(t.item()))")
    assert {k: r.stdout.split() for k, r in result.ranks.items()} == {
        r: [str(41 + r), str(world)] for r in range(world)
    }
    return pool


def test_a_torchrun_pool_outlives_its_kernel_and_another_attaches(runtime: Path) -> None:
    started = _killed_kernel(TORCHRUN, 120)
    family = _family(started["tethers"])  # type: ignore[arg-type]
    assert len(family) >= 6  # two tethers, two torchrun agents, two ranks
    time.sleep(1.0)
    assert all(p.is_running() for p in family), "a process of the kept pool ended with its kernel"
    (kept,) = kept_pools()
    left = kept.time_left()
    assert kept.record["owner"] is None and left is not None and 100 < left <= 120

    pool = _attach_and_check(2)
    assert kept_pools()[0].owner == os.getpid()
    pool.shutdown()
    _, alive = psutil.wait_procs(family, timeout=20)
    assert alive == [], [p.cmdline()[:4] for p in alive]
    assert not Path(str(started["dir"])).exists()


def test_a_torchrun_pool_whose_lease_runs_out_leaves_nothing(runtime: Path) -> None:
    started = _killed_kernel(TORCHRUN, 3)
    family = _family(started["tethers"])  # type: ignore[arg-type]
    _, alive = psutil.wait_procs(family, timeout=30)
    assert alive == [], [p.cmdline()[:4] for p in alive]
    assert list(runtime.iterdir()) == []  # the record with the pool's key went with it
    with pytest.raises(jupyter_shard.PoolError, match="there is no kept pool"):
        jupyter_shard.attach()


def test_a_kept_torchrun_pool_stops_from_a_terminal(runtime: Path) -> None:
    started = _killed_kernel(TORCHRUN, 120)
    family = _family(started["tethers"])  # type: ignore[arg-type]
    (kept,) = kept_pools()
    env = {**os.environ, RUNTIME_DIR_VAR: str(runtime)}
    command = [sys.executable, "-m", "jupyter_shard", "stop", kept.id]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "stopped kept pool" in done.stdout, done.stderr
    _, alive = psutil.wait_procs(family, timeout=20)
    assert alive == [], [p.cmdline()[:4] for p in alive]
    assert list(runtime.iterdir()) == []


def test_a_kept_slurm_job_outlives_its_kernel_and_its_lease_ends_it(
    runtime: Path, slurm: SlurmCluster
) -> None:
    options = {"launcher": "slurm", "nproc": 2, "interface": "lo", "partition": slurm.partition}
    started = _killed_kernel(options, 120)
    name = str(started["name"])
    time.sleep(1.0)
    assert _queued(name), "the kept pool's SLURM job was cancelled with its kernel"
    pool = _attach_and_check(2)
    pool.keep = 3  # a lease that runs out soon after this kernel lets go
    pool.release()
    deadline = time.monotonic() + 40
    while _queued(name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _queued(name), "the SLURM job outlived the lease"
    deadline = time.monotonic() + 10
    while list(runtime.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(runtime.iterdir()) == []
