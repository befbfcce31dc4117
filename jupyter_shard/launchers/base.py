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


class Launcher(ABC):
    """Starts the ranks of one pool. Lifetime of the ranks is tied to ``lifeline_fd``."""

    name: ClassVar[str]

    @abstractmethod
    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        """Spawn every rank as a fresh process; must not block on rank start-up."""


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
