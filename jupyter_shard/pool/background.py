"""A cell that runs on the ranks while the notebook stays usable (``%%distributed --bg``), and the
thread that watches the ranks between cells.

:class:`BackgroundRun` is the handle :meth:`Pool.run_background` returns. The pool's :class:`Watcher`
thread drives it (receiving output, noticing deaths, escalating an interrupt) inside a copy of the
starting cell's context, so under ipykernel its output and its end report land in that cell.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable

from jupyter_shard.errors import PoolError
from jupyter_shard.pool.cell import CellGathering, Gathering
from jupyter_shard.pool.results import DistributedError, RankResult, RunResult

WATCH_INTERVAL = 0.05


class BackgroundRun:
    """A running or finished background cell; :meth:`wait` returns its result or raises its error."""

    def __init__(
        self,
        gathering: Gathering,
        exec_count: int,
        on_done: Callable[[BackgroundRun], None] | None = None,
        serve_prompts: Callable[[], None] = lambda: None,  # in wait(): ask for the ranks' prompts
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
        self.serve_prompts = serve_prompts
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
    def unsettled(self) -> bool:
        """Running, or failed where nobody has seen it yet (the next cell first says so)."""
        return self.running or (self.error is not None and not self.reported)

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def describe(self) -> str:
        elapsed = f"{self.elapsed:.1f}" if self.elapsed < 10 else f"{self.elapsed:.0f}"
        return f"the background run of cell [{self.exec_count}] (running for {elapsed} s)"

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until it ends, asking for the prompts its ranks wait at; raise its
        :class:`DistributedError` if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(WATCH_INTERVAL):
            self.serve_prompts()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.describe()} is still running")
        self.reported = True
        if self.error is not None:
            raise self.error
        return self.result

    def step(self, cells: CellGathering, end: Callable[[Gathering], None]) -> None:
        """One step of the watcher thread: receive, or stop the run as asked; at its end, ``end``
        closes the cell (as the pool closes every cell) and the run finishes."""
        if self.interrupt_requested:
            self.interrupt_requested = False
            cells.interrupted(self.gathering, "interrupted (%dist_interrupt)")
            ended = True
        else:
            ended = cells.step(self.gathering, 0.0)
        if ended:
            end(self.gathering)
            self.finish()

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


def refuse_while_running(run: BackgroundRun | None, what: str) -> None:
    """Raise a :class:`PoolError` saying why ``what`` cannot be done while ``run`` goes on."""
    if run is not None and run.running:
        raise PoolError(
            f"cannot {what}: {run.describe()} is still running on the ranks; "
            "%dist_wait waits for it, %dist_interrupt stops it"
        )


class Watcher:
    """A daemon thread: drives a background run, else notices heartbeats and deaths between cells.

    It stands aside while a foreground cell runs (that thread receives); every step holds the
    connection's lock, so the two never receive at once.
    """

    def __init__(
        self,
        lock: threading.RLock,
        alive: Callable[[], bool],
        idle_step: Callable[[], None],
        background_step: Callable[[BackgroundRun], None],
        background: Callable[[], BackgroundRun | None],
    ) -> None:
        self._lock = lock
        self._alive = alive  # False once the pool's socket is gone: the thread ends
        self._idle_step = idle_step
        self._background_step = background_step
        self._background = background
        self.foreground = False  # a foreground cell is receiving: stand aside
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def settled(self) -> bool:
        """Whether the pool runs and no background run goes on or failed unseen (a cell may go ahead)."""
        run = self._background()
        return self._alive() and not (run is not None and run.unsettled)

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="jupyter_shard-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            with self._lock:
                if not self._alive() or self._stop.is_set():
                    return
                if self.foreground:
                    continue
                run = self._background()
                if run is None or not run.running:
                    self._idle_step()
                    continue
            run.context.run(self._background_step, run)
