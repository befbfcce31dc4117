"""``--launcher slurm``: the pool is one ``srun`` job step running a torchrun agent per node.

``srun --nodes N --ntasks-per-node 1`` asks SLURM for the nodes (a new job, or a step inside the
allocation the kernel already runs in, when ``SLURM_JOB_ID`` is set); each task runs
``torch.distributed.run`` with torch's static rendezvous (the task's ``$SLURM_NODEID`` as its node's
index) hosted by the job's first node, its store bound to that node's address, nothing pickled. The
job carries a unique name, so the launcher can show its id and queue state while it waits and cancel
it (``scancel``) on shutdown, on an interrupt that ends in a kill, and - through the tether - when the
kernel dies.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from jupyter_shard.env import NODE
from jupyter_shard.launchers.base import KeptRank, Launcher, RankHandle, RankLaunch
from jupyter_shard.launchers.commands import agent_args, agent_command
from jupyter_shard.launchers.remote import (
    AgentProcess,
    KeptAgents,
    RemoteRank,
    job_env,
    need_interface,
    resolve_interface,
    spawn_agent,
)
from jupyter_shard.spec import Device, LauncherOptions, LaunchSpec, SpecError

RDZV_PORT = 29400
QUEUE_POLL = 2.0


@dataclass(frozen=True)
class SlurmOptions(LauncherOptions):
    """``--interface`` (where the ranks dial back) and what to ask SLURM for: ``--partition``,
    ``--time`` and ``--account``, as srun and sbatch take them."""

    interface: str | None = field(default=None, metadata={"hint": "remote ranks"})
    partition: str | None = None
    time_limit: str | None = field(default=None, metadata={"option": "--time"})
    account: str | None = None


def options_of(spec: LaunchSpec) -> SlurmOptions:
    """The spec's SLURM options (their defaults for a spec built without them)."""
    options = spec.launcher_options
    return options if isinstance(options, SlurmOptions) else SlurmOptions()


def slurm_resources(spec: LaunchSpec) -> list[str]:
    """What to ask SLURM for, as srun and sbatch both take it: a task per node, a CPU and (on CUDA) a
    GPU per rank, and the user's partition, time limit and account."""
    options = [f"--nodes={spec.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={spec.nproc}"]
    if spec.device is Device.CUDA:
        options.append(f"--gpus-per-node={spec.nproc}")
    own = options_of(spec)
    for flag, value in (("partition", own.partition), ("time", own.time_limit), ("account", own.account)):
        if value:
            options.append(f"--{flag}={value}")
    return options


class SlurmLauncher(KeptAgents):
    name: ClassVar[str] = "slurm"
    remote: ClassVar[bool] = True
    restart_hint: ClassVar[str] = "in a new SLURM allocation"
    meets_on_agent_store: ClassVar[bool] = True
    options_type: ClassVar[type[LauncherOptions]] = SlurmOptions

    @classmethod
    def parse_options(cls, given: Mapping[str, object], nodes: int) -> tuple[LauncherOptions, int]:
        values = {name: None if value is None else str(value) for name, value in given.items()}
        return SlurmOptions(**values), nodes

    def __init__(self) -> None:
        self.agents: list[AgentProcess] = []
        self.job_name = f"jupyter_shard-{uuid.uuid4().hex[:10]}"
        self._queue: tuple[float, str | None] = (0.0, None)
        self.job_id = ""

    def bind_address(self, spec: LaunchSpec) -> str:
        interface = options_of(spec).interface
        if interface is None:
            raise need_interface("SLURM may place the ranks on other machines")
        return resolve_interface(interface)

    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        if shutil.which("srun") is None:
            raise SpecError("--launcher slurm needs SLURM's srun on PATH, and it is not there")
        env = job_env(ranks[0].env)
        env.pop("GLOO_SOCKET_IFNAME", None)
        env.pop("NCCL_SOCKET_IFNAME", None)
        nodes, node, job = '"$SLURM_JOB_NUM_NODES"', '"$SLURM_NODEID"', '"$SLURM_JOB_ID"'
        options = agent_args(nodes, spec.nproc, node, '"$head"', str(RDZV_PORT), job)
        python, *rest = agent_command(options)
        torchrun = " ".join([shlex.quote(python), *rest])
        script = (
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) && '
            f'export {NODE}="$SLURM_NODEID" && exec ' + torchrun
        )
        srun = ["srun", f"--job-name={self.job_name}", *slurm_resources(spec), "--kill-on-bad-exit=1"]
        srun.append("--unbuffered")
        log = ranks[0].log_path.parent / "srun.log"
        cancel = ["scancel", f"--name={self.job_name}"]
        agent = spawn_agent(
            None,
            "slurm",
            [*srun, "bash", "-c", script],
            env,
            log,
            ranks[0].cwd,
            lifeline_fd,
            cancel,
            pool_dir=ranks[0].pool_dir,
        )
        agent.end_note = self._end_note
        self.agents.append(agent)
        return [RemoteRank(launch.rank, self.agents, self.signal_rank) for launch in ranks]

    def job(self) -> tuple[str, str, str] | None:
        """``(job id, state, reason or nodes)`` from squeue, or None once the job left the queue."""
        try:
            out = subprocess.run(
                ["squeue", "-h", f"--name={self.job_name}", "-o", "%i|%T|%R"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        if not out:
            return None
        job_id, state, reason = [*out.splitlines()[0].split("|"), "", ""][:3]
        self.job_id = job_id
        return job_id, state, reason

    def waiting(self) -> str | None:
        now = time.monotonic()
        if now - self._queue[0] >= QUEUE_POLL:
            job = self.job()
            message = None
            if job is not None and job[1] not in ("RUNNING", "COMPLETING"):
                message = f"SLURM job {job[0]} is {job[1]} ({job[2]}); interrupt the cell to cancel it"
            self._queue = (now, message)
        return self._queue[1]

    def started_note(self) -> str:
        job = self.job()
        if job is None:
            return f"SLURM job {self.job_name}"
        return f"SLURM job {job[0]} ({self.job_name}) {job[1]} on {job[2]}"

    def _end_note(self) -> str:
        """``SLURM job 11 CANCELLED``: from slurmstepd's line in srun's output, else from scontrol."""
        if not self.job_id:
            return ""
        state = ""
        for agent in self.agents:
            found = re.search(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ ([A-Z_]+)", agent.tail(20000))
            state = state or (found.group(1) if found else "")
        deadline = time.monotonic() + 3.0
        while not state or state == "COMPLETING":  # still ending: its final state follows shortly
            state = self.final_state(self.job_id)
            if state != "COMPLETING" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return f"SLURM job {self.job_id} {state}" if state else f"SLURM job {self.job_id}"

    def final_state(self, job_id: str) -> str:
        """``CANCELLED``, ``FAILED``, ``NODE_FAIL``… for a job that left the queue, or ""."""
        try:
            out = subprocess.run(
                ["scontrol", "-o", "show", "job", job_id],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
        for entry in out.split():
            if entry.startswith("JobState="):
                return entry.split("=", 1)[1]
        return ""

    def local_pids(self) -> list[int]:
        return [a.pid for a in self.agents]

    def kept_state(self) -> dict[str, Any]:
        return {**super().kept_state(), "job_name": self.job_name}

    @classmethod
    def adopt(cls, state: Mapping[str, Any], ranks: Sequence[KeptRank]) -> tuple[Launcher, list[RankHandle]]:
        launcher, handles = super().adopt(state, ranks)
        assert isinstance(launcher, SlurmLauncher)
        launcher.job_name = str(state["job_name"])
        return launcher, handles

    def stop(self) -> None:
        if self.agents and shutil.which("scancel") is not None:  # nothing was submitted otherwise
            subprocess.run(
                ["scancel", f"--name={self.job_name}"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=30,
                check=False,
            )
        for agent in self.agents:
            agent.stop()
