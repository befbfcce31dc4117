"""``--launcher simulated``: ranks that speak the wire protocol without torch, many per process.

For tests and benchmarks of the kernel's side at 128 to 1,024 ranks (:mod:`jupyter_shard.rank.simulated`
says what such a rank does and does not do). It is not among the launchers a user is offered:
:func:`register` adds it to this process's registry.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import ClassVar

from jupyter_shard._util.atomic import write_private
from jupyter_shard.launchers.base import Launcher, RankHandle, RankLaunch
from jupyter_shard.launchers.local import LocalRank
from jupyter_shard.spec import RUNTIME_LAUNCHERS, LaunchSpec

__all__ = ["PER_PROCESS", "SimulatedLauncher", "register"]

PER_PROCESS = 128  # ranks one process serves (each has two ZeroMQ sockets; a context holds 1,023)


class SimulatedLauncher(Launcher):
    name: ClassVar[str] = "simulated"

    def __init__(self) -> None:
        self._processes = 0
        self._pids: list[int] = []

    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        handles: list[RankHandle] = []
        self._pids = []
        for first in range(0, len(ranks), PER_PROCESS):
            chunk = ranks[first : first + PER_PROCESS]
            plan = (chunk[0].pool_dir or chunk[0].log_path.parent) / f"simulated-{first}.json"
            write_private(plan, json.dumps([{"rank": r.rank, "log": str(r.log_path)} for r in chunk]))
            with open(chunk[0].log_path, "ab", buffering=0) as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "jupyter_shard.rank.simulated", str(plan)],
                    env=chunk[0].env,
                    cwd=chunk[0].cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(lifeline_fd,),
                )
            self._pids.append(proc.pid)
            handles += [LocalRank(r.rank, proc) for r in chunk]
        self._processes = len(self._pids)
        return handles

    def launch_path(self) -> str:
        return f"simulated: {self._processes} processes of up to {PER_PROCESS} ranks each (no torch)"

    def local_pids(self) -> list[int]:
        return list(self._pids)


def register() -> None:
    """Offer ``--launcher simulated`` in this process (tests and benchmarks)."""
    from jupyter_shard.launchers import _launchers

    if "simulated" not in _launchers.available():
        _launchers.register("simulated", SimulatedLauncher)
    RUNTIME_LAUNCHERS.add("simulated")
