"""The small interface every launcher implements, and the exit-status vocabulary of a rank.

What the kernel calls, and nothing else (no launcher names, no ``hasattr``):

- to build a spec (through :func:`jupyter_shard.launchers.resolve_spec`): ``options_type`` (the
  launcher's own :class:`~jupyter_shard.spec.LauncherOptions`) and ``parse_options(given, nodes)``;
- on a :class:`Launcher`: ``remote`` and ``bind_address(spec)`` (where remote ranks dial back),
  ``set_signal_sender(send)`` before ``start(spec, ranks, lifeline_fd)``, then ``waiting()`` while
  the ranks start, ``started_note()``, ``launch_path()`` (how the ranks came, for
  ``%dist_status``), ``local_pids()``, ``stop()``; and the class attributes
  ``restart_hint`` (how ``%dist_restart`` brings a lost node back) and ``meets_on_agent_store``
  (whether a rebuilt process group meets on the node agents' store rather than a FileStore in the
  pool directory);
- on a :class:`RankHandle`: ``rank``, ``pid``, ``host``, ``poll()``, ``wait(timeout)``,
  ``send_signal(sig)``, ``kill_tree()``, ``exit_reason(code)``, ``bind(pid, host, node)`` and
  ``heard()`` (from the rank's messages), ``node_down`` (it ended with its node) and
  ``startup_tail()`` (why a rank that never wrote its own log failed to start).
"""

from __future__ import annotations

import contextlib
import os
import signal
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import psutil

from jupyter_shard.spec import LauncherOptions, LaunchSpec, SpecError


@dataclass(frozen=True)
class RankLaunch:
    """Everything needed to start one rank: its number, environment and log file."""

    rank: int
    env: dict[str, str]
    log_path: Path
    cwd: Path
    argv: list[str] = field(default_factory=list)
    pool_dir: Path | None = None  # the pool's private directory (a kept pool's record goes there)


KEPT_RECORD = "kept.json"
"""A kept pool's record (0600: it holds the key), in the pool's private directory: while it is there,
the pool's ranks and node agents outlive the kernel (``--keep``)."""


@dataclass(frozen=True)
class KeptRank:
    """One rank as a kept pool's record names it, for the kernel that attaches to it."""

    rank: int
    pid: int
    started: float | None  # the process's start time, where it runs on this machine
    host: str
    node: int | None


class RankHandle(ABC):
    """A started rank process, shaped like :class:`subprocess.Popen`."""

    rank: int
    pid: int
    host: str
    node: int | None = None  # the node it runs on, for launchers with several

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

    @property
    def node_down(self) -> bool:
        """Whether the rank ended because its node (its agent, or the whole job step) did."""
        return False

    def startup_tail(self) -> str | None:
        """For a rank that never got as far as its own log: the end of what explains it, or None."""
        return None


SignalSender = Callable[[int, int], None]
"""``send(rank, signal)``: the kernel asks a rank's I/O thread to signal the rank itself."""


class Launcher(ABC):
    """Starts the ranks of one pool. Lifetime of the ranks is tied to ``lifeline_fd``.

    A ``remote`` launcher's ranks may run on other machines: they dial back to the kernel over TCP,
    on the address :meth:`bind_address` chooses, through an encrypted CurveZMQ channel.
    """

    name: ClassVar[str]
    remote: ClassVar[bool] = False
    restart_hint: ClassVar[str] = "on the same hosts"
    """How ``%dist_restart`` starts the pool again after a node failed: ends "starts the pool again …"."""
    meets_on_agent_store: ClassVar[bool] = False
    """Whether ranks meet on their node agents' store (torchrun's) instead of a FileStore in the pool
    directory, for the first process group and for one rebuilt after a release."""

    options_type: ClassVar[type[LauncherOptions]] = LauncherOptions
    """The options this launcher owns (``--hosts``, ``--partition``...); the base has none."""

    @classmethod
    def parse_options(cls, given: Mapping[str, object], nodes: int) -> tuple[LauncherOptions, int]:
        """Check the user's values of this launcher's own options; them, and the node count they
        imply (``--hosts a,b`` means two nodes). ``given`` holds only names of ``options_type``."""
        return cls.options_type(**given), nodes

    _signal_sender: SignalSender | None = None

    def set_signal_sender(self, send: SignalSender) -> None:
        """How to signal a rank this launcher cannot signal itself (called before :meth:`start`)."""
        self._signal_sender = send

    def signal_rank(self, rank: int, sig: int) -> None:
        """Signal ``rank`` through the pool (its I/O thread signals itself); a no-op before it is set."""
        if self._signal_sender is not None:
            self._signal_sender(rank, sig)

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

    def launch_path(self) -> str:
        """How the ranks of the last :meth:`start` came to be, in one line (the first line of
        ``%dist_status``): the local launcher says whether a zygote forked them or why not."""
        return f"started by the {self.name} launcher"

    def local_pids(self) -> list[int]:
        """Processes on this machine the launcher started (recorded for stale-pool clean-up)."""
        return []

    def stop(self) -> None:  # noqa: B027 (optional hook)
        """After the ranks were told to stop: end whatever the launcher still runs (cancel jobs)."""

    # -- kept pools (--keep) ---------------------------------------------------------------------

    keeps: ClassVar[bool] = False
    """Whether its ranks can outlive the kernel that started them (``--keep``): it implements
    :meth:`adopt`."""

    def keep(self, pids: list[int], on: bool) -> None:  # noqa: B027 (optional hook)
        """Leave these ranks alive when the kernel goes (``on``), or no longer."""

    def kept_state(self) -> dict[str, Any]:
        """What a kept pool's record needs for :meth:`adopt` in another kernel (JSON)."""
        return {}

    @classmethod
    def adopt(cls, state: Mapping[str, Any], ranks: Sequence[KeptRank]) -> tuple[Launcher, list[RankHandle]]:
        """Another kernel attaches to a kept pool: a launcher that can stop it, and the ranks' handles."""
        raise SpecError(f"--launcher {cls.name} cannot keep a pool (--keep)")

    @classmethod
    def end_kept(cls, state: Mapping[str, Any], processes: Sequence[tuple[int, float | None]]) -> None:
        """Stop a kept pool with no kernel to tell its ranks (``python -m jupyter_shard stop``):
        ``processes`` are those on this machine its life hangs on, each with its start time."""
        for pid, started in processes:
            if started_at(pid) == started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


def started_at(pid: int) -> float | None:
    """The start time of process ``pid`` (with its pid, it names one process), or None if none runs."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.Error:
        return None


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
