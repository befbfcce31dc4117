"""A cell that runs on the ranks while the notebook stays usable (``%%distributed --bg``).

:class:`BackgroundRun` is the handle :meth:`Pool.run_background` returns. The pool's watcher thread
drives it (receiving output, noticing deaths, escalating an interrupt) inside a copy of the
starting cell's context, so under ipykernel its output and its end report land in that cell.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jupyter_shard.kernel.results import DistributedError, PoolError, RankResult, RunResult


@dataclass
class Gathering:
    """One cell in flight: its result so far, the ranks it waits on and its limits."""

    result: RunResult
    targets: list[int]
    started: float
    timeout: float | None
    pending: set[int] = field(default_factory=set)
    first_done: float = 0.0  # when the first rank finished the cell (monotonic), 0 before
    code: str = ""
    ranks: tuple[int, ...] | None = None  # as asked for (None: all ranks)
    exec_count: int = 0
    record: bool = True  # kept in the pool's transcript (what %dist_export writes out)

    def __post_init__(self) -> None:
        self.pending = set(self.targets)


class BackgroundRun:
    """A running or finished background cell; :meth:`wait` returns its result or raises its error."""

    def __init__(
        self,
        gathering: Gathering,
        exec_count: int,
        on_done: Callable[[BackgroundRun], None] | None = None,
    ) -> None:
        self.gathering = gathering
        self.exec_count = exec_count
        self.on_done = on_done
        self.context = contextvars.copy_context()
        self.started = time.monotonic()
        self.ended: float | None = None
        self.error: DistributedError | PoolError | None = None
        self.reported = False  # whether anyone has seen how it ended (wait() or its cell's report)
        self.interrupt_requested = False
        self._done = threading.Event()

    def __repr__(self) -> str:
        state = "running" if self.running else ("failed" if self.error else "finished")
        return f"<BackgroundRun of cell [{self.exec_count}]: {state} after {self.elapsed:.1f} s>"

    @property
    def result(self) -> RunResult:
        return self.gathering.result

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def describe(self) -> str:
        return f"the background run of cell [{self.exec_count}] ({self.elapsed:.0f} s)"

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until it ends; raise its :class:`DistributedError` if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.describe()} is still running")
        self.reported = True
        if self.error is not None:
            raise self.error
        return self.result

    def finish(self, error: DistributedError | PoolError | None = None) -> None:
        """Record the end (called once, by the pool, inside :attr:`context`) and call ``on_done``."""
        if not self.running:
            return
        self.ended = time.monotonic()
        if error is None and not self.result.ok:
            error = DistributedError(self.result)
        self.error = error
        self._done.set()
        if self.on_done is not None:
            self.on_done(self)

    def abandon(self, why: str) -> None:
        """The pool went away under the run: every rank still pending is reported lost."""
        for rank in sorted(self.gathering.pending):
            res = self.result.ranks.setdefault(rank, RankResult(rank))
            if res.status == "pending":
                res.status, res.evalue, res.failed_at = "dead", f"rank {rank}: {why}", time.monotonic()
                res.traceback = [f"rank {rank}: {why} while the background cell ran"]
        self.context.run(self.finish)
