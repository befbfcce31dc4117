"""The default launcher: one fresh ``python -m jupyter_shard.rank`` process per rank on this host.

Ranks are spawned with exec (never forked from the kernel, so CUDA state in the kernel cannot leak
into them), each as the leader of its own session so that a whole rank - DataLoader workers
included - can be killed by process group. Output goes straight to the rank's log file, so no pipe
can fill up and stall a rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from typing import ClassVar

from jupyter_shard.launchers.base import Launcher, RankHandle, RankLaunch
from jupyter_shard.spec import LaunchSpec


class LocalRank(RankHandle):
    def __init__(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self.rank = rank
        self.pid = proc.pid
        self.host = socket.gethostname()
        self._proc = proc

    def poll(self) -> int | None:
        return self._proc.poll()

    def send_signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(sig)

    def kill_tree(self) -> None:
        # The rank leads its own process group (start_new_session), so its pid is the group id.
        # Linux does not reuse a pid while a group with that id still has members.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.send_signal(signal.SIGKILL)
        self.wait(5.0)

    def wait(self, timeout: float) -> int | None:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class LocalLauncher(Launcher):
    name: ClassVar[str] = "local"

    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        handles: list[RankHandle] = []
        try:
            for launch in ranks:
                handles.append(self._spawn(launch, lifeline_fd))
        except BaseException:
            for handle in handles:
                handle.kill_tree()
            raise
        return handles

    @staticmethod
    def _spawn(launch: RankLaunch, lifeline_fd: int) -> LocalRank:
        argv = launch.argv or [sys.executable, "-m", "jupyter_shard.rank"]
        with open(launch.log_path, "ab", buffering=0) as log:
            proc = subprocess.Popen(
                argv,
                env=launch.env,
                cwd=launch.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(lifeline_fd,),
            )
        return LocalRank(launch.rank, proc)


def kill_recorded(pid: int) -> None:
    """SIGKILL the process group of a rank recorded by an earlier pool (checked by the caller)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
