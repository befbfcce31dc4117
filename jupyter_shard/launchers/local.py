"""The default launcher: ranks on this host, each a fresh process leading its own session.

Ranks are forked from a zygote (:mod:`~jupyter_shard.launchers.zygote`: a process the kernel
started with exec, which imported torch once), or, with ``JUPYTER_SHARD_ZYGOTE=0``, spawned as
``python -m jupyter_shard.rank`` each. Neither is ever forked from the kernel, so CUDA state in the
kernel cannot leak into them. Each rank leads its own session so that a whole rank - DataLoader
workers included - can be killed by process group. Output goes straight to the rank's log file, so
no pipe can fill up and stall a rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from typing import ClassVar

from jupyter_shard.launchers import zygote
from jupyter_shard.launchers.base import Launcher, RankHandle, RankLaunch
from jupyter_shard.launchers.zygote import ZygoteClient
from jupyter_shard.spec import LaunchSpec


class _SessionLeader(RankHandle):
    """A rank that leads its own session, so that its pid is its process group's id."""

    def kill_tree(self) -> None:
        # Also after the rank itself exited: its children (DataLoader workers, subprocesses) may
        # still be in its group, and Linux does not reuse a group id while the group has members.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.send_signal(signal.SIGKILL)
        self.wait(5.0)


class LocalRank(_SessionLeader):
    """A rank spawned as ``python -m jupyter_shard.rank``: this process's child."""

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

    def wait(self, timeout: float) -> int | None:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class ForkedRank(_SessionLeader):
    """A rank forked by the zygote: not this process's child, so its exit comes from the zygote."""

    def __init__(self, rank: int, pid: int, zygote: ZygoteClient) -> None:
        self.rank = rank
        self.pid = pid
        self.host = socket.gethostname()
        self._zygote = zygote

    def poll(self) -> int | None:
        code = self._zygote.exit_code(self.pid)
        if code is None and not self._zygote.alive():
            return -signal.SIGKILL  # the zygote killed its children as it ended
        return code

    def exit_reason(self, code: int) -> str:
        if self._zygote.exit_code(self.pid) is None and not self._zygote.alive():
            return f"ended with the process it was forked from (zygote pid {self._zygote.pid}, which ended)"
        return super().exit_reason(code)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        code = self.poll()
        return code if code is not None else self._zygote.wait_exit(self.pid, timeout)


class LocalLauncher(Launcher):
    name: ClassVar[str] = "local"

    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        handles: list[RankHandle] = []
        forking = zygote.enabled() and not any(launch.argv for launch in ranks)
        try:
            client = zygote.zygote_for(ranks[0].env) if forking and ranks else None
            for launch in ranks:
                if client is not None:
                    try:
                        pid = client.fork(launch.env, launch.cwd, launch.log_path, lifeline_fd)
                        handles.append(ForkedRank(launch.rank, pid, client))
                        continue
                    except zygote.ZygoteUnavailable as exc:
                        # Ranks spawned one by one say for themselves what fails (a broken import).
                        with open(launch.log_path, "a") as log:
                            print(f"jupyter_shard: spawning ranks instead: {exc}", file=log)
                        zygote.mark_failed(client)
                        client = None
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
