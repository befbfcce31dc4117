"""The local SLURM cluster itself works: srun steps, sbatch jobs and scancel, as the launchers use them."""

from __future__ import annotations

import getpass
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launchers.conftest import SlurmCluster

pytestmark = pytest.mark.timeout(60)


def run(*cmd: str, cwd: Path | None = None, timeout: float = 30) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}: {done.stderr}"
    return done.stdout


def job_state(job_id: str) -> str:
    """The job's state in squeue (which lists pending, running and completing jobs), or "" once it left."""
    out = run("squeue", "--noheader", f"--user={getpass.getuser()}", "--format=%i %T")
    return dict(line.split() for line in out.splitlines()).get(job_id, "")


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


def test_srun_starts_one_task_per_rank_in_one_job(slurm: SlurmCluster) -> None:
    overcommit = ["--overcommit"] if slurm.cpus < 2 else []
    out = run(
        "srun", f"--partition={slurm.partition}", "-N1", "-n2", *overcommit,
        "bash", "-c", "echo $SLURM_PROCID $SLURM_JOB_ID",
    )  # fmt: skip
    rows = [line.split() for line in out.splitlines()]
    assert sorted(procid for procid, _ in rows) == ["0", "1"], out
    assert len({job for _, job in rows}) == 1, out


def test_sbatch_wait_runs_the_job_and_writes_its_output(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = run(
        "sbatch", "--wait", "--parsable", f"--partition={slurm.partition}", "--output=job.out",
        "--wrap=echo hello from job $SLURM_JOB_ID on $SLURMD_NODENAME",
        cwd=tmp_path,
    )  # fmt: skip
    job_id = out.strip().split(";")[0]
    assert (tmp_path / "job.out").read_text().strip() == f"hello from job {job_id} on {slurm.node}"


def test_scancel_of_a_running_job_empties_the_queue(slurm: SlurmCluster, tmp_path: Path) -> None:
    job_id = run(
        "sbatch", "--parsable", f"--partition={slurm.partition}", "--output=/dev/null", "--wrap=sleep 300",
        cwd=tmp_path,
    ).strip().split(";")[0]  # fmt: skip
    wait_for(lambda: job_state(job_id) == "RUNNING", 15, f"job {job_id} to run")
    run("scancel", job_id)
    wait_for(lambda: job_state(job_id) == "", 5, f"cancelled job {job_id} to leave squeue")
