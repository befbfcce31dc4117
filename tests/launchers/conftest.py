"""The real one-node SLURM cluster that the launcher tests submit to.

``.ci/slurm.sh start`` brings it up (``make test`` and ``.ci/run`` do so); the clients find it
through ``/etc/slurm/slurm.conf``. Without it the tests that use ``slurm`` are skipped, except under
``CI=true``, where they fail.

Every job submitted during the session carries a session wckey (set through ``SLURM_WCKEY``,
``SBATCH_WCKEY`` and ``SALLOC_WCKEY``), so the leak check below sees only this session's jobs: a job
that a test leaves in ``squeue`` is cancelled and that test fails in its teardown. A job submitted
with its own ``--wckey``, or by a client started without these variables, escapes the check.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

import pytest

USABLE_STATES = {"idle", "mixed", "allocated"}
WCKEY_VARS = ("SLURM_WCKEY", "SBATCH_WCKEY", "SALLOC_WCKEY")
LEAK_GRACE_S = 5.0
START_HINT = "run .ci/slurm.sh start"


@dataclass(frozen=True)
class SlurmCluster:
    partition: str
    node: str
    cpus: int


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI starts it: see .ci/run and .ci/slurm.sh)", pytrace=False)
    pytest.skip(f"{reason}; {START_HINT}")


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:  # the client is not installed
        return subprocess.CompletedProcess(cmd, 127, "", str(exc))


def _find_cluster() -> SlurmCluster:
    missing = [tool for tool in ("srun", "sinfo", "squeue", "scancel") if shutil.which(tool) is None]
    if missing:
        _unavailable(f"SLURM clients not installed ({', '.join(missing)} missing)")
    info = _run("sinfo", "--noheader", "--Node", "--format=%N|%P|%c|%T")
    if info.returncode != 0:
        _unavailable(f"sinfo failed: {info.stderr.strip() or info.stdout.strip()}")
    rows = [line.split("|") for line in info.stdout.splitlines() if line.count("|") == 3]
    # The default partition is the one sinfo marks with '*'.
    rows.sort(key=lambda row: not row[1].endswith("*"))
    for node, partition, cpus, state in rows:
        if state in USABLE_STATES:
            return SlurmCluster(partition=partition.rstrip("*"), node=node, cpus=int(cpus))
    states = ", ".join(f"{node} {state}" for node, _, _, state in rows) or "no nodes"
    _unavailable(f"no usable SLURM node (sinfo: {states})")


def _session_jobs(wckey: str) -> dict[str, str]:
    """This session's jobs still in squeue: job id -> name."""
    out = _run("squeue", "--noheader", f"--user={getpass.getuser()}", "--Format=JobID:30,WCKey:80,Name:200")
    jobs: dict[str, str] = {}
    for line in out.stdout.splitlines():
        fields = line.split(None, 2)
        if len(fields) >= 2 and fields[1].lstrip("*") == wckey:
            jobs[fields[0]] = fields[2].strip() if len(fields) == 3 else ""
    return jobs


@pytest.fixture(scope="session")
def _slurm_wckey() -> Iterator[str]:
    wckey = f"jupyter_shard-tests-{os.getpid()}"
    saved = {var: os.environ.get(var) for var in WCKEY_VARS}
    os.environ.update(dict.fromkeys(WCKEY_VARS, wckey))
    yield wckey
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    leftover = _session_jobs(wckey)
    if leftover:
        _run("scancel", *leftover)


@pytest.fixture(scope="session")
def slurm(_slurm_wckey: str) -> SlurmCluster:
    """The local cluster: its default partition, its node and the node's CPUs."""
    return _find_cluster()


@pytest.fixture(autouse=True)
def _no_leaked_jobs(request: pytest.FixtureRequest) -> Iterator[None]:
    if "slurm" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("slurm")  # skips (or fails under CI) before any squeue call
    wckey: str = request.getfixturevalue("_slurm_wckey")
    before = set(_session_jobs(wckey))
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = {job: name for job, name in _session_jobs(wckey).items() if job not in before}
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = {job: name for job, name in _session_jobs(wckey).items() if job not in before}
    if leaked:
        _run("scancel", *leaked)
        listing = ", ".join(f"{job} ({name})" for job, name in sorted(leaked.items()))
        pytest.fail(f"the test left SLURM jobs in squeue (now cancelled): {listing}", pytrace=False)
