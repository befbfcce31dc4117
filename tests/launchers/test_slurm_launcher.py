"""``--launcher slurm`` against the real one-node SLURM cluster (``.ci/slurm.sh``; fixture ``slurm``).

The pool is one ``srun`` job step running a torchrun agent per node; its ranks are SLURM tasks of one
job. Shutdown, an interrupt that ends in a kill, and the kernel's death each leave ``squeue`` empty;
a job cancelled from outside is reported with its id and state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_shard import DistributedError, Pool
from jupyter_shard.launchers import resolve_spec
from jupyter_shard.launchers.slurm import SlurmLauncher
from jupyter_shard.pool.output import ConsoleSink

from .conftest import SlurmCluster

pytestmark = pytest.mark.timeout(180)


def _queued(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", f"--name={name}", "-o", "%i %T"], capture_output=True, text=True)
    return out.stdout.split("\n")[:-1] if out.stdout else []


def _wait_gone(name: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := _queued(name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture
def pool(slurm: SlurmCluster, tmp_path: Path) -> Iterator[Pool]:
    spec = resolve_spec(nproc=2, device="cpu", launcher="slurm", interface="lo", partition=slurm.partition)
    p = Pool(spec=spec, log_dir=tmp_path, sink=ConsoleSink())
    p.notices = []  # type: ignore[attr-defined]
    p.on_notice = p.notices.append  # type: ignore[attr-defined]
    try:
        p.start()
        yield p
    finally:
        p.shutdown()


def _launcher(pool: Pool) -> SlurmLauncher:
    assert isinstance(pool.launcher, SlurmLauncher)
    return pool.launcher


def test_ranks_are_tasks_of_one_job_and_shutdown_cancels_it(pool: Pool, slurm: SlurmCluster) -> None:
    launcher = _launcher(pool)
    name = launcher.job_name
    result = pool.run(
        "import os\nenv = os.environ\nprint(env['SLURM_JOB_ID'], env['SLURM_PROCID'], env['SLURM_JOB_NAME'])"
    )
    seen = {k: r.stdout.split() for k, r in result.ranks.items()}
    job_id = seen[0][0]
    assert seen == {0: [job_id, "0", name], 1: [job_id, "0", name]}  # one task (node 0) runs both ranks
    assert any(f"SLURM job {job_id} ({name}) RUNNING on {slurm.node}" in n for n in pool.notices)  # type: ignore[attr-defined]
    assert _queued(name) == [f"{job_id} RUNNING"]
    assert {r.job for r in pool.ranks} == {job_id}
    pool.shutdown()
    assert _wait_gone(name, 10) == []


def test_an_interrupt_that_ends_in_a_kill_cancels_the_job(pool: Pool) -> None:
    name = _launcher(pool).job_name
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(DistributedError) as err:
        pool.run("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(120)")
    timer.join()
    assert "killed rank 0-1" in "\n".join(err.value.result.notes)
    assert _wait_gone(name, 15) == []


def test_a_job_cancelled_from_outside_is_reported(pool: Pool) -> None:
    launcher = _launcher(pool)
    job_id = launcher.job_id
    assert job_id
    timer = threading.Timer(2.0, lambda: subprocess.run(["scancel", job_id], check=True))
    timer.start()
    started = time.monotonic()
    with pytest.raises(DistributedError) as err:
        pool.run("import time\nfor _ in range(1200):\n    time.sleep(0.05)")
    timer.join()
    assert time.monotonic() - started < 30
    message = str(err.value)
    assert f"SLURM job {job_id} CANCELLED" in message, message
    assert {r.status for r in err.value.result.ranks.values()} == {"dead"}


def test_the_kernels_death_cancels_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from jupyter_shard import Pool
        from jupyter_shard.launchers import resolve_spec
        spec = resolve_spec(
            nproc=2, device="cpu", launcher="slurm", interface="lo", partition={slurm.partition!r}
        )
        pool = Pool(spec=spec, log_dir={str(tmp_path)!r})
        pool.start()
        print(pool.launcher.job_name, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name.startswith("jupyter_shard-") and _queued(name)
        proc.kill()  # the kernel dies without any clean-up of its own
        proc.wait(10)
        assert _wait_gone(name, 30) == []  # the tether saw the lifeline close and ran scancel
    finally:
        if proc.poll() is None:
            proc.kill()
