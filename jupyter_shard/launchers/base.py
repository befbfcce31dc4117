"""The small interface every launcher implements, and the exit-status vocabulary of a rank."""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from jupyter_shard.spec import LaunchSpec


@dataclass(frozen=True)
class RankLaunch:
    """Everything needed to start one rank: its number, environment and log file."""

    rank: int
    env: dict[str, str]
    log_path: Path
    cwd: Path
    argv: list[str] = field(default_factory=list)


class RankHandle(ABC):
    """A started rank process, shaped like :class:`subprocess.Popen`."""

    rank: int
    pid: int
    host: str

    @abstractmethod
    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""

    @abstractmethod
    def send_signal(self, sig: int) -> None:
        """Signal the rank process itself (never a process found by name)."""

    @abstractmethod
    def kill_tree(self) -> None:
        """SIGKILL the rank and every process in its process group (DataLoader workers too)."""

    @abstractmethod
    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for exit; the exit code, or None if still running."""

    def exit_reason(self, code: int) -> str:
        """How the rank ended, for messages: ``exited with code 3``, ``was killed by SIGKILL``…"""
        return describe_exit(code)

    def bind(self, pid: int, host: str, node: int) -> None:  # noqa: B027 (optional hook)
        """Learn where the rank runs from its ``ready`` (a launcher that did not start it directly)."""

    def heard(self) -> None:  # noqa: B027 (optional hook)
        """The kernel received a message from the rank (its liveness, where it cannot be polled)."""


class Launcher(ABC):
    """Starts the ranks of one pool. Lifetime of the ranks is tied to ``lifeline_fd``.

    A ``remote`` launcher's ranks may run on other machines: they dial back to the kernel over TCP,
    on the address :meth:`bind_address` chooses, through an encrypted CurveZMQ channel.
    """

    name: ClassVar[str]
    remote: ClassVar[bool] = False

    @abstractmethod
    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        """Spawn every rank as a fresh process; must not block on rank start-up."""

    def bind_address(self, spec: LaunchSpec) -> str:
        """The IP address remote ranks dial back to (only asked of ``remote`` launchers)."""
        return "127.0.0.1"

    def waiting(self) -> str | None:
        """While the ranks wait for something outside the pool (a queued job, nodes to join): what."""
        return None

    def started_note(self) -> str:
        """A line for the user once every rank is ready (e.g. the job id), or ""."""
        return ""

    def local_pids(self) -> list[int]:
        """Processes on this machine the launcher started (recorded for stale-pool clean-up)."""
        return []

    def stop(self) -> None:  # noqa: B027 (optional hook)
        """After the ranks were told to stop: end whatever the launcher still runs (cancel jobs)."""


def describe_exit(code: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL (possibly out of memory)``."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = {
        "SIGKILL": " (possibly out of memory: check `dmesg` or the cgroup's memory.events)",
        "SIGSEGV": " (a crash in native code)",
        "SIGABRT": " (aborted, often a failed assertion in native code)",
    }.get(name, "")
    return f"was killed by {name}{hint}"
