"""``%%distributed --launcher slurm`` through a real kernel: the queue state while the job waits, the
job id once it runs, the ranks as SLURM tasks, and ``%dist_shutdown`` leaving ``squeue`` empty."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from tests.conftest import Kernel
from tests.launchers.conftest import SlurmCluster

pytestmark = pytest.mark.timeout(240)

MAGIC = "%%distributed --launcher slurm --nproc 2 --device cpu --interface lo --partition {partition}"
CELL = "import os\nprint('job', os.environ['SLURM_JOB_ID'], 'task', os.environ['SLURM_PROCID'])"


def _jobs(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", f"--name={name}", "-o", "%i %T"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def test_a_queued_pool_shows_its_state_then_runs_as_slurm_tasks(kernel: Kernel, slurm: SlurmCluster) -> None:
    # Another job holds every CPU of the node, so the pool's job waits in the queue.
    blocker_name = "jupyter_shard-test-blocker"
    submit = ["sbatch", "--parsable", f"--job-name={blocker_name}", f"--cpus-per-task={slurm.cpus}"]
    blocker = subprocess.run(
        [*submit, f"--partition={slurm.partition}", "--output=/dev/null", "--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        deadline = time.monotonic() + 20
        while _jobs(blocker_name) != [f"{blocker} RUNNING"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _jobs(blocker_name) == [f"{blocker} RUNNING"]
        release = threading.Timer(8.0, lambda: subprocess.run(["scancel", blocker], check=True))
        release.start()
        kernel.execute("%load_ext jupyter_shard")
        run = kernel.execute(MAGIC.format(partition=slurm.partition) + "\n" + CELL, timeout=180)
        release.join()
        assert run.ok, run.outputs
        out = run.stream()
        err = "".join(line for line in out.splitlines(keepends=True) if line.startswith("jupyter_shard: "))
        assert "is PENDING (" in err and "interrupt the cell to cancel it" in err, err
        lines = sorted(line for line in out.splitlines() if line.startswith("[rank ") and "job" in line)
        job_id = lines[0].split()[3]
        assert lines == [f"[rank 0] job {job_id} task 0", f"[rank 1] job {job_id} task 0"], out
        assert f"SLURM job {job_id} (" in err and "RUNNING" in err, err
        name = next(word for word in err.split() if word.startswith("(jupyter_shard-")).strip("()")
        assert _jobs(name) == [f"{job_id} RUNNING"]
        status = kernel.execute("%dist_status")
        assert status.ok and "slurm" not in status.stream("stderr")
        kernel.execute("%dist_shutdown")
        deadline = time.monotonic() + 10
        while _jobs(name) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _jobs(name) == []
    finally:
        subprocess.run(["scancel", blocker], capture_output=True)
