"""The default launcher: ranks on this host, each a fresh process leading its own session.

Ranks are forked from a zygote (:mod:`~jupyter_shard.launchers.zygote`: a process the kernel
started with exec, which imported torch once), or, with ``JUPYTER_SHARD_ZYGOTE=0``, spawned as
``python -m jupyter_shard.rank`` each. Neither is ever forked from the kernel, so CUDA state in the
kernel cannot leak into them. Each rank leads its own session so that a whole rank - DataLoader
workers included - can be killed by process group. Output goes straight to the rank's log file, so
no pipe can fill up and stall a rank.

The launcher says which way its ranks came (:meth:`LocalLauncher.launch_path`, the first line of
``%dist_status``): forked by the zygote, or spawned and why the zygote was not used. A CUDA pool's
ranks get ``CUDA_VISIBLE_DEVICES`` naming the chosen devices (``--gpus 0,2``) by their physical
ids, so rank k's ``cuda:k`` is the k-th of them and two notebooks on one node can use disjoint GPUs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from jupyter_shard.env import ZYGOTE_SWITCH
from jupyter_shard.gpus import VISIBLE_VAR
from jupyter_shard.launchers import zygote
from jupyter_shard.launchers.base import KeptRank, Launcher, RankHandle, RankLaunch, started_at
from jupyter_shard.launchers.zygote import ZygoteClient
from jupyter_shard.spec import LaunchSpec, format_ranks

_REASON_CHARS = 240  # a zygote's failure is one line of the status; its whole text is in the rank log


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


class AdoptedRank(_SessionLeader):
    """A rank of a kept pool that this kernel attached to: neither its child nor forked for it, so
    it is known by pid and start time (a pid reused by another process is not taken for it)."""

    def __init__(self, rank: int, pid: int, started: float | None) -> None:
        self.rank = rank
        self.pid = pid
        self.host = socket.gethostname()
        self._started = started

    def poll(self) -> int | None:
        started = started_at(self.pid)
        if started is not None and self._started in (None, started):
            return None
        return -signal.SIGKILL  # not this process's child: its exit status cannot be read

    def exit_reason(self, code: int) -> str:
        return "ended (its exit status is unknown to a kernel that attached to it)"

    def kill_tree(self) -> None:
        """Its process group, only while no other process has its pid: the rank itself, or none (then
        only the rank's own group, whose id Linux does not give out while it has members)."""
        now = started_at(self.pid)
        if now is not None and self._started not in (None, now):
            return  # the pid was given to another process: nothing of the rank's is left to kill
        super().kill_tree()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return code


class LocalLauncher(Launcher):
    name: ClassVar[str] = "local"

    keeps: ClassVar[bool] = True

    def __init__(self) -> None:
        self._path = ""
        self._note = ""
        self._zygote: zygote.ZygoteClient | None = None  # the one that forked the last start's ranks

    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        visible = spec.rank_visible_devices(os.environ.get(VISIBLE_VAR))
        if visible is not None:
            ranks = [replace(launch, env={**launch.env, VISIBLE_VAR: visible}) for launch in ranks]
        handles: list[RankHandle] = []
        forked: list[int] = []
        why = self._why_not_forked(ranks)
        try:
            client = zygote.zygote_for(ranks[0].env) if ranks and not why else None
            why = why or (zygote.failure(ranks[0].env) if ranks and client is None else "")
            zygote_pid = client.pid if client is not None else 0
            for launch in ranks:
                if client is not None:
                    try:
                        pid = client.fork(launch.env, launch.cwd, launch.log_path, lifeline_fd)
                        handles.append(ForkedRank(launch.rank, pid, client))
                        forked.append(launch.rank)
                        continue
                    except zygote.ZygoteUnavailable as exc:
                        # Ranks spawned one by one say for themselves what fails (a broken import).
                        with open(launch.log_path, "a") as log:
                            print(f"jupyter_shard: spawning ranks instead: {exc}", file=log)
                        why = self._note = _one_line(str(exc))
                        zygote.mark_failed(client, why)
                        client = None
                handles.append(self._spawn(launch, lifeline_fd))
        except BaseException:
            for handle in handles:
                handle.kill_tree()
            raise
        self._zygote = client if forked else None
        spawned = [launch.rank for launch in ranks if launch.rank not in forked]
        self._path = _path(forked, spawned, zygote_pid, why) + (
            f" · {VISIBLE_VAR}={visible}" if visible is not None else ""
        )
        return handles

    def keep(self, pids: list[int], on: bool) -> None:
        """Forked ranks: the zygote leaves them alive when it ends with the kernel. Spawned ranks are
        this process's children, which nothing kills when it ends but their own lifeline."""
        if self._zygote is not None:
            self._zygote.keep(pids, on)

    @classmethod
    def adopt(cls, state: Mapping[str, Any], ranks: Sequence[KeptRank]) -> tuple[Launcher, list[RankHandle]]:
        """The ranks are known by pid and start time; nothing else of this launcher is needed to stop them."""
        return cls(), [AdoptedRank(r.rank, r.pid, r.started) for r in ranks]

    def launch_path(self) -> str:
        """``zygote (fork server, pid 4242)`` or ``spawned: <why the zygote was not used>``, and the
        ranks' ``CUDA_VISIBLE_DEVICES`` where the pool chose devices."""
        return self._path

    def started_note(self) -> str:
        """Said once the ranks are ready, when the zygote failed this time (the ranks took longer)."""
        return f"ranks were spawned, not forked from the zygote: {self._note}" if self._note else ""

    @staticmethod
    def _why_not_forked(ranks: list[RankLaunch]) -> str:
        """Why these ranks are spawned without asking a zygote ("" if one may fork them)."""
        if not zygote.enabled():
            return f"{ZYGOTE_SWITCH}={os.environ.get(ZYGOTE_SWITCH)} turns the zygote off"
        if any(launch.argv for launch in ranks):
            return "the ranks run their own command"
        return ""

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


def _one_line(text: str) -> str:
    """A failure as one line: its first line and, for a traceback, its last (the exception)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[0] + (f" … {lines[-1]}" if len(lines) > 1 else "") if lines else "no reason given"
    return line if len(line) <= _REASON_CHARS else line[: _REASON_CHARS - 1] + "…"


def _path(forked: list[int], spawned: list[int], zygote_pid: int, why: str) -> str:
    """How the ranks started, in one line, for ``%dist_status``."""
    server = f"zygote (fork server, pid {zygote_pid})"
    if not spawned:
        return server
    if not forked:
        return f"spawned: {why}"
    return f"{server} for ranks {format_ranks(forked)}; spawned ranks {format_ranks(spawned)}: {why}"


def kill_recorded(pid: int) -> None:
    """SIGKILL the process group of a rank recorded by an earlier pool (checked by the caller)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
