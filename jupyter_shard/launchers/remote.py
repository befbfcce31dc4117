"""What the torchrun and SLURM launchers share: node agents started here, and ranks known by message.

A remote launcher starts *agents* (a torchrun per node, run here or over ssh, or one ``srun`` for all
nodes), each under :mod:`~jupyter_shard.launchers.tether` so that it ends with the kernel. The agents
start the ranks, which dial back to the kernel; until a rank says ``ready`` the kernel knows only its
number. A :class:`RemoteRank` is therefore shaped from messages: it learns its pid, host and node from
``ready``, is signalled through its I/O thread (a ``signal`` message), and counts as dead when its
node's agent has exited or it has sent nothing for ``SILENT_AFTER`` seconds.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import psutil

from jupyter_shard.env import without_per_rank
from jupyter_shard.launchers.base import (
    KEPT_RECORD,
    KeptRank,
    Launcher,
    RankHandle,
    SignalSender,
    describe_exit,
    started_at,
)
from jupyter_shard.spec import SpecError

SILENT_AFTER = 20.0  # a rank that sent nothing (not even a heartbeat) for this long is lost
KILL_WAIT = 3.0


class AgentProcess:
    """A process started here for one node (``node``) or for all of them (``node`` None): the tether
    that runs the node's agent."""

    def __init__(self, node: int | None, host: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.node = node
        self.host = host
        self.proc = proc
        self.log_path = log_path
        self.end_note: Callable[[], str] | None = None  # e.g. the SLURM job's final state

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float = 6.0) -> None:
        """SIGTERM the tether (it stops the agent and cancels its job), SIGKILL after ``grace``."""
        if self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        if self._wait(grace) is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self._wait(2.0)

    def _wait(self, timeout: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout)
        return None

    def entry(self) -> dict[str, Any]:
        """How a kept pool's record names it, for :meth:`AdoptedAgent.of`."""
        return {
            "node": self.node,
            "host": self.host,
            "pid": self.pid,
            "started": started_at(self.pid),
            "log": str(self.log_path),
        }

    def failure(self) -> str:
        """What the agent's log says about the first rank that failed, from torchrun's summary."""
        try:
            text = self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""
        # torchrun's summary lists other failures first and the first observed one under "Root Cause"
        root = text.rfind("Root Cause")
        entry = r"rank\s*:\s*(\d+)\s*\(local_rank.*?\n.*?exitcode\s*:\s*(-?\d+)"
        match = re.search(entry, text[root:] if root >= 0 else text, re.S)
        if not match:
            return ""
        rank, code = int(match.group(1)), int(match.group(2))
        return f"rank {rank} {describe_exit(code)}"

    def tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode(errors="replace").strip()
        except OSError:
            return ""


class AdoptedAgent(AgentProcess):
    """The tether of a kept pool's node agent, seen from a kernel that attached to the pool: not its
    child, so known by pid and start time."""

    def __init__(self, node: int | None, host: str, pid: int, started: float | None, log_path: Path) -> None:
        self.node, self.host, self.log_path = node, host, log_path
        self.end_note = None
        self._pid, self._started = pid, started

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> AdoptedAgent:
        return cls(entry["node"], str(entry["host"]), int(entry["pid"]), entry["started"], Path(entry["log"]))

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        started = started_at(self._pid)
        return None if started is not None and self._started in (None, started) else -signal.SIGKILL

    def _wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return code


class RemoteRank(RankHandle):
    """One rank started by an agent, seen only through its messages and its agent's process."""

    def __init__(self, rank: int, agents: Sequence[AgentProcess], deliver: SignalSender) -> None:
        self.rank = rank
        self.pid = 0
        self.host = ""
        self.node: int | None = None
        self._agents = list(agents)
        self._deliver = deliver
        self._code: int | None = None
        self._reason = ""
        self._seen = 0.0
        self._node_down = False  # it ended because its node's agent (or the whole job step) did
        self._killing = False  # the pool is stopping its agent to kill it: not a node failure

    def bind(self, pid: int, host: str, node: int) -> None:
        self.pid, self.host, self.node = pid, host, node
        self._seen = time.monotonic()

    def heard(self) -> None:
        self._seen = time.monotonic()

    @property
    def node_down(self) -> bool:
        return self._node_down

    def startup_tail(self) -> str | None:
        """The end of its agent's log: torchrun or srun says why the rank never started."""
        agent = self.agent()
        return agent.tail() if agent is not None else None

    def agent(self) -> AgentProcess | None:
        """The agent this rank's life depends on (its node's, or the one for all nodes)."""
        if len(self._agents) == 1:
            return self._agents[0]
        for agent in self._agents:
            if agent.node == self.node:
                return agent
        return None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        mine = self.agent() if self.node is not None else None
        for agent in [mine] if mine is not None else self._agents:
            code = agent.poll()
            if code is not None:
                self._code = code
                if self._killing:
                    self._reason = f"was killed (its node agent was stopped; agent log: {agent.log_path})"
                else:
                    self._reason = self._agent_ended(agent, code)
                    self._node_down = True
                return self._code
        if self.pid and time.monotonic() - self._seen > SILENT_AFTER:
            self._code = -signal.SIGKILL
            where = f"node {self.node} ({self.host})" if self.host else "its node"
            self._reason = (
                f"sent nothing for {SILENT_AFTER:g} s (not even a heartbeat): {where} or the network "
                "to it may have failed"
            )
        return self._code

    def _agent_ended(self, agent: AgentProcess, code: int) -> str:
        what = "its SLURM job step" if agent.node is None and len(self._agents) == 1 else "its node agent"
        where = f"node {self.node} ({self.host})" if self.node is not None else f"host {agent.host}"
        first = agent.failure()
        cause = f" after {first}" if first else ""
        note = agent.end_note() if agent.end_note is not None else ""
        note = f" ({note})" if note else ""
        return (
            f"went down with {where}: {what} exited with status {code}{cause}{note}; "
            f"agent log: {agent.log_path}"
        )

    def exit_reason(self, code: int) -> str:
        return self._reason or describe_exit(code)

    def send_signal(self, sig: int) -> None:
        if self.pid and self.poll() is None:
            with contextlib.suppress(Exception):
                self._deliver(self.rank, sig)

    def kill_tree(self) -> None:
        """Ask the rank to SIGKILL its own process group; if it cannot, stop its node's agent."""
        if self.poll() is not None:
            return
        self.send_signal(signal.SIGKILL)
        if self.wait(KILL_WAIT) is None:
            agent = self.agent()
            if agent is not None:
                self._killing = True
                agent.stop()
            self.wait(KILL_WAIT)
        if self._code is None:
            self._code, self._reason = -signal.SIGKILL, "was killed (its node agent was stopped)"

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None or time.monotonic() >= deadline:
                return code
            time.sleep(0.05)


class KeptAgents(Launcher):
    """What the torchrun and SLURM launchers share for ``--keep``: the record names each node agent's
    tether (which leaves its agent alive when the kernel goes while the record is there), and a
    kernel that attaches stops them the way the one that started them would."""

    keeps: ClassVar[bool] = True
    agents: list[AgentProcess]

    def kept_state(self) -> dict[str, Any]:
        return {"agents": [agent.entry() for agent in self.agents]}

    @classmethod
    def adopt(cls, state: Mapping[str, Any], ranks: Sequence[KeptRank]) -> tuple[Launcher, list[RankHandle]]:
        launcher = cls()
        launcher.agents = [AdoptedAgent.of(entry) for entry in state["agents"]]
        handles: list[RankHandle] = []
        for r in ranks:
            handle = RemoteRank(r.rank, launcher.agents, launcher.signal_rank)
            handle.bind(r.pid, r.host, r.node if r.node is not None else 0)
            handles.append(handle)
        return launcher, handles

    @classmethod
    def end_kept(cls, state: Mapping[str, Any], processes: Sequence[tuple[int, float | None]]) -> None:
        """SIGTERM every agent's tether: each stops its agent (and its ranks), as on a kernel's stop."""
        for entry in state["agents"]:
            AdoptedAgent.of(entry).stop()


def tether_argv(
    lifeline_fd: int, command: Sequence[str], cancel: Sequence[str] = (), pool_dir: Path | None = None
) -> list[str]:
    kept = ["--kept", str(pool_dir / KEPT_RECORD)] if pool_dir is not None else []
    return [
        sys.executable,
        "-m",
        "jupyter_shard.launchers.tether",
        "--lifeline",
        str(lifeline_fd),
        "--cancel",
        json.dumps(list(cancel)),
        *kept,
        "--",
        *command,
    ]


def spawn_agent(
    node: int | None,
    host: str,
    command: Sequence[str],
    env: dict[str, str],
    log_path: Path,
    cwd: Path,
    lifeline_fd: int,
    cancel: Sequence[str] = (),
    stdin: bytes | None = None,
    pool_dir: Path | None = None,
) -> AgentProcess:
    """Start ``command`` under a tether; its output goes to ``log_path``; ``stdin`` is written once.
    The tether leaves it running when the kernel goes while ``pool_dir`` holds a kept pool's record."""
    with open(log_path, "ab", buffering=0) as log:
        proc = subprocess.Popen(
            tether_argv(lifeline_fd, command, cancel, pool_dir),
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(lifeline_fd,),
        )
    if stdin is not None and proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(stdin)
        proc.stdin.close()
    return AgentProcess(node, host, proc, log_path)


def job_env(env: dict[str, str]) -> dict[str, str]:
    """A rank's environment with the per-rank variables removed (the agent sets its own)."""
    return without_per_rank(env)


def is_this_machine(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address in _local_addresses().values() or address.startswith("127.")


def _local_addresses() -> dict[str, str]:
    """Interface name -> its first IPv4 address, for every interface that has one."""
    out: dict[str, str] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and name not in out:
                out[name] = a.address
    return out


def resolve_interface(choice: str) -> str:
    """The IPv4 address for ``--interface`` given as an interface name or one of this machine's IPs."""
    addresses = _local_addresses()
    if choice in addresses:
        return addresses[choice]
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(choice)
        if choice in addresses.values():
            return choice
    raise SpecError(
        f"--interface {choice!r} is not an interface or address of this machine; it has: {interfaces_here()}"
    )


def interfaces_here() -> str:
    """``eth0 10.0.0.2, lo 127.0.0.1``: this machine's interfaces with their IPv4 addresses."""
    return ", ".join(f"{name} {addr}" for name, addr in sorted(_local_addresses().items()))


def need_interface(why: str) -> SpecError:
    shown = interfaces_here()
    return SpecError(
        f"{why}, so they dial back to this kernel over TCP: give --interface with the interface they "
        f"can reach it on (this machine has: {shown}); nothing listens beyond loopback until you do"
    )
