"""The kernel side of a rank pool, as one object: start ranks, run cells, move values, stop.

:class:`Pool` is a facade over parts with one job each: the :class:`~.connection.Connection` (socket,
signing, dispatch), the :class:`~.ranks.RankTable`, the :class:`~.cell.CellGathering` of the cell in
flight (the only writer of results), :class:`~.escalation.Escalation` (interrupt, release, regroup,
kill) and the :class:`~.lifecycle.Lifecycle` (processes, private directory, clean-up). The thread that
calls :meth:`Pool.run` receives until the cell ends; between cells, and for a background run, the
:class:`~.background.Watcher` thread does."""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from jupyter_shard.launchers.base import RankHandle
from jupyter_shard.pool.background import BackgroundRun, Watcher, refuse_while_running
from jupyter_shard.pool.cell import POST_MORTEM, CellGathering, Gathering
from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.debugging import DebugLink
from jupyter_shard.pool.escalation import Escalation
from jupyter_shard.pool.facts import PoolFacts
from jupyter_shard.pool.headstart import Ahead
from jupyter_shard.pool.history import History
from jupyter_shard.pool.lifecycle import Lifecycle
from jupyter_shard.pool.output import RankSink, default_sink
from jupyter_shard.pool.ranks import RankTable
from jupyter_shard.pool.results import DistributedError, RunResult
from jupyter_shard.pool.stdin import CallbackStdin, default_stdin
from jupyter_shard.pool.transcript import CellEntry, Transcript
from jupyter_shard.pool.values import Namespace, Transfer, Values, named_values
from jupyter_shard.spec import DEFAULT_TIMEOUT, LaunchSpec
from jupyter_shard.strategies import registered

__all__ = ["Observer", "Pool", "latest_pool"]

_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()
_latest: Pool | None = None


def latest_pool() -> Pool | None:
    """The pool started most recently in this process (kept after shutdown for its history)."""
    return _latest


class Observer(Protocol):
    """Something that shows the pool's state (a dashboard): called often, limits its own rate."""

    def refresh(self, pool: Pool, final: bool) -> None: ...


class Pool(PoolFacts):
    """A pool of persistent rank processes. Use as a context manager or call :meth:`shutdown`.

    ``keep``: seconds the ranks outlive this process, for another kernel to attach to them
    (``jupyter_shard.attach()``); 0 (the default) ends them with it."""

    def __init__(
        self,
        nproc: int | None = None,
        device: str = "auto",
        strategy: str = "none",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        launcher: str = "local",
        spec: LaunchSpec | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        sink: RankSink | None = None,
        stdin: Callable[[str], str] | None = None,  # answers ranks' input() and pdb (default: the notebook)
        keep: float = 0.0,
    ) -> None:
        self._keep = float(keep)
        self.spec = spec or LaunchSpec.create(
            nproc=nproc, device=device, strategy=strategy, timeout=timeout, launcher=launcher
        )
        self.sink = sink or default_sink()
        self.history = History()
        self.on_notice: Callable[[str], None] | None = None
        self.background: BackgroundRun | None = None
        self.observers: list[Observer] = []
        self.transcript = Transcript()  # cells and pushes since the last start (%dist_export)
        self.ranks = RankTable(self.history)
        conn = self.connection = Connection(self.ranks)
        conn.handle(self.ranks.handlers())
        self.escalation = Escalation(conn, self.ranks, self._notice, partial(self.stacks, 1.0))
        answers = default_stdin if stdin is None else partial(CallbackStdin, stdin)
        self.cells = CellGathering(conn, self.ranks, self.escalation, lambda: self.sink, self._tick, answers)
        self.lifecycle = Lifecycle(conn, self.ranks, Path(log_dir) if log_dir else None)
        self.values = Values(conn, self.ranks, self.transcript)
        self._watcher = Watcher(
            conn.lock, lambda: conn.open, self.cells.idle_step, self._background_step, lambda: self.background
        )
        self.ahead = Ahead(self.cells, self.ranks, self.escalation, self._watcher, self._begin, self._end)

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Pool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        """Spawn every rank and wait until all joined the process group (or one failed)."""
        if self.started:
            return
        if taker := self.lifecycle.taken_by:
            self.lifecycle.taken_by = ""
            self._notice(f"{taker} took the kept pool over: its ranks are that kernel's now")
        self.escalation.reset()
        self.cells.out_of_step = ""
        self.transcript = self.values.transcript = Transcript()
        for record in self.lifecycle.start(self.spec, self.escalation.deliver_signal):
            self.sink.log_paths[record.rank] = str(record.log_path)
        _live_pools.add(self)
        global _latest
        _latest = self
        foreground, self._watcher.foreground = self._watcher.foreground, True
        try:
            self.lifecycle.wait_ready(self._notice, partial(self._tick, starting=True))
            assert self.launcher is not None
            if note := self.launcher.started_note():
                self._notice(note)
            self._share_registered_strategy()
            if self._keep:
                self.keep = self._keep
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._watcher.foreground = foreground
        self._watcher.start()

    def _share_registered_strategy(self) -> None:
        """A strategy registered in the kernel with ``register_strategy`` is registered on the ranks too."""
        if (entry := registered(self.spec.strategy)) is None:
            return
        self.push(_js_strategy=(self.spec.strategy, *entry))
        register = "from jupyter_shard.strategies import register_strategy as _r\n"
        register += "_r(_js_strategy[0], _js_strategy[1], **_js_strategy[2])\ndel _r, _js_strategy"
        self.run_own(register)

    @property
    def keep(self) -> float:
        """Seconds the ranks outlive this process, waiting for a kernel to attach; 0: they end with it."""
        return self._keep

    @keep.setter
    def keep(self, seconds: float) -> None:
        if self.started:
            self.refuse_while_background("change how long the pool is kept")
            record = self.lifecycle.keep(seconds, self.spec, self._let_go)
            lease = f"({float(seconds)!r}, {str(record)!r})"
            self.run_own(f"__import__('jupyter_shard.rank.keep', fromlist=['set_lease']).set_lease{lease}")
        self._keep = float(seconds)

    def adopt(self, directory: Path, record: Mapping[str, Any]) -> list[RankHandle]:
        """Become the kernel of a kept pool's ranks, whose handles this returns (``jupyter_shard.attach``
        adds them, then holds)."""
        handles = self.lifecycle.adopt(directory, record, self.escalation.deliver_signal)
        _live_pools.add(self)
        global _latest
        _latest = self
        self._watcher.start()
        return handles

    def hold(self, seconds: float) -> None:
        """The adopted ranks' lease goes on as set (they hold it): the record now names this kernel."""
        self.lifecycle.keep(seconds, self.spec, self._let_go)
        self._keep = float(seconds)

    def follow(self, cell_id: str, ranks: list[int], head: str) -> BackgroundRun:
        """Follow a cell an adopted pool's ranks still run, as a background run of this kernel."""
        gathering = self.cells.follow(cell_id, [self.ranks[r] for r in ranks], head)
        self.background = BackgroundRun(gathering, 0, None, partial(self.cells.serve_prompts, gathering))
        self._watcher.start()
        return self.background

    def release(self) -> None:
        """Let go of a kept pool's ranks without stopping them (they wait for a kernel to attach)."""
        self._watcher.stop()
        self.lifecycle.release()
        _live_pools.discard(self)

    def _let_go(self, taker: str) -> bool:
        """Another kernel takes this kept pool over: let go, unless a cell runs here now."""
        if self._watcher.foreground or (self.background is not None and self.background.running):
            return False
        self.release()
        self.lifecycle.taken_by = taker
        return True

    def shutdown(self) -> None:
        """Stop every rank (and its children) and release the socket, key and private directory."""
        self._watcher.stop()
        self.lifecycle.stop()
        _live_pools.discard(self)
        run = self.background
        if run is not None and run.running:
            run.abandon("the pool was shut down")

    def restart(self, spec: LaunchSpec | None = None) -> None:
        """New rank processes (rank state is lost), with the same or a new spec."""
        self.shutdown()
        self.escalation.restart_reason = None
        if spec is not None:
            self.spec = spec
        self.start()

    # -- running cells --------------------------------------------------------------------------

    def run(
        self, code: str, ranks: Sequence[int] | None = None, timeout: float | None = None, exec_count: int = 0
    ) -> RunResult:
        """Run ``code`` on ``ranks`` (default: all); raise :class:`DistributedError` if any fails."""
        return self._run_foreground(code, ranks, timeout, exec_count, record=True)

    def _run_foreground(
        self, code: str, ranks: Sequence[int] | None, timeout: float | None, exec_count: int, record: bool
    ) -> RunResult:
        ahead = self.ahead.take(code, ranks, timeout) if record else None
        if ahead is None:  # else it was sent ahead (the notebook's head start), as checked there
            self.refuse_while_background("run a cell")
        foreground, self._watcher.foreground = (ahead.foreground if ahead else self._watcher.foreground), True
        try:
            gathering = ahead.taken() if ahead else self._begin(code, ranks, timeout, exec_count, record)
            try:
                self.cells.gather(gathering)
            finally:
                self._end(gathering)
        finally:
            self._watcher.foreground = foreground
        if not gathering.result.ok:
            raise DistributedError(gathering.result)
        return gathering.result

    def run_own(self, code: str) -> RunResult:
        """Run the pool's own ``code`` on every rank, kept out of ``%dist_export``'s transcript."""
        return self._run_foreground(code, None, None, 0, record=False)

    def post_mortem(self, rank: int) -> RunResult:
        """pdb on ``rank`` at the frame where its last failed cell raised (``%debug``, ``%dist_debug``)."""
        return self._run_foreground(POST_MORTEM, [rank], None, 0, record=False)

    def run_background(
        self,
        code: str,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        exec_count: int = 0,
        on_done: Callable[[BackgroundRun], None] | None = None,
    ) -> BackgroundRun:
        """Start ``code`` on the ranks and return at once; the pool's watcher thread follows it.

        Output and ``on_done`` run in a copy of the caller's context (under ipykernel: the starting
        cell). While it runs, other cells, pushes and pulls are refused; status and stacks work.
        """
        self.refuse_while_background("start another background run")
        gathering = self._begin(code, ranks, timeout, exec_count, record=True)
        prompts = partial(self.cells.serve_prompts, gathering)
        run = self.background = BackgroundRun(gathering, exec_count, on_done, prompts)
        self._watcher.start()
        return run

    def refuse_while_background(self, what: str) -> None:
        """Raise :class:`PoolError` ("cannot <what>: ...") while a background run goes on."""
        refuse_while_running(self.background, what)

    def send_ahead(self, code: str, ranks: Sequence[int] | None, timeout: float | None, count: int) -> bool:
        """Send now the cell the next :meth:`run` of these arguments gathers (head start); whether it went."""
        return self.ahead.send(code, ranks, timeout, count)

    def settle_ahead(self) -> None:
        """End a cell sent ahead that no :meth:`run` took: it is interrupted on the ranks."""
        self.ahead.settle()

    def _prepare(self) -> None:
        """Before a cell or a collective pull: restart or regroup as the last cell left things."""
        reason = self.escalation.restart_reason
        if reason is not None:
            self._notice(f"restarting the pool ({reason}); rank state is lost")
            self.restart()
        self.start()
        if self.escalation.regroup_needed and self.ranks.groupable():  # dead or broken: %dist_restart
            assert self.directory is not None and self.launcher is not None
            if not self.escalation.regroup(
                self.directory, self.launcher.meets_on_agent_store, self.world_size, self.spec.timeout
            ):
                self.restart()

    def _begin(
        self, code: str, ranks: Sequence[int] | None, timeout: float | None, exec_count: int, record: bool
    ) -> Gathering:
        self._prepare()
        targets = self.ranks.targets(ranks, cell=code != POST_MORTEM)  # %debug reads a broken rank too
        return self.cells.send(self.cells.open(code, targets, timeout, exec_count, ranks, record), targets)

    def _end(self, gathering: Gathering) -> None:
        hint = self.launcher.restart_hint if self.launcher is not None else ""
        self.cells.end(gathering, self.ranks.node_failures(hint))
        if gathering.record:
            status = "ok" if gathering.result.ok else "error"
            self.transcript.add(CellEntry(gathering.code, gathering.ranks, status, gathering.exec_count))
        self.lifecycle.note_seen()  # a kept pool's: what a kernel attaching later refuses
        self._tick(final=True)

    def _background_step(self, run: BackgroundRun) -> None:  # in the watcher thread
        run.step(self.cells, self._end)

    def _tick(self, final: bool = False, starting: bool = False) -> None:
        """Let observers (dashboards) redraw, each limiting its own rate; while the ranks start, those
        that follow a start (the side panel: ``starting``) hear of it."""
        for observer in list(self.observers):
            try:
                if not starting:
                    observer.refresh(self, final)
                elif hasattr(observer, "starting"):
                    observer.starting(self)
            except Exception as exc:  # a broken display must not break the run
                self.observers.remove(observer)
                print(f"jupyter_shard: a dashboard stopped updating: {exc!r}", file=sys.__stderr__)

    # -- moving values --------------------------------------------------------------------------

    def push(self, namespace: Namespace = None, *, ranks: Sequence[int] | None = None, **values: Any) -> int:
        """Copy values to every rank (or ``ranks``): ``push(x=x)``, or ``push({"x": x})`` as ipyparallel."""
        named = named_values(namespace, values)
        self.refuse_while_background("push values")
        self.start()
        return self.values.push(ranks, named)

    def pull(self, name: str, rank: int = 0, *, gather: bool = False, device: bool = False) -> Any:
        """A copy of ``name`` on ``rank``: tensors on the CPU (``device=True``: where they were)."""
        if gather:
            return self.pull_all(name, gather=True, device=device)[0]
        return self.pull_all(name, ranks=[rank], device=device)[rank]

    def pull_all(
        self, name: str, ranks: Sequence[int] | None = None, *, gather: bool = False, device: bool = False
    ) -> dict[int, Any]:
        """Copies of ``name`` from every rank (or ``ranks``), by rank (see :meth:`pull`). ``gather=True``:
        ``name`` is the prepared model, gathered by every rank; rank 0 gives a plain ``nn.Module``."""
        self.refuse_while_background("pull values")
        self.start()
        if gather and self.escalation.regroup_needed:  # gathering is a collective: it needs a group
            self._prepare()
        return self.values.pull(name, None if gather else ranks, gather, device)

    def last_values(self) -> dict[int, Any]:
        """Copies of the last cell's value (its last expression) from each rank that gave one."""
        self.refuse_while_background("pull values")
        last = self.cells.last
        return self.values.pull_last(last.valued_ranks()) if last and self.started else {}

    def last_value(self, rank: int, limit: int | None = None) -> Any:
        """A copy of the value ``rank`` gave the last cell; one that pickles to over ``limit`` bytes
        is refused with a :class:`PoolError` (``Out[n]``)."""
        return self.values.pull_last([rank], limit)[rank]

    @property
    def last_result(self) -> RunResult | None:
        """The result of the last cell that ended (its ranks keep a failure's frames until the next)."""
        return self.cells.last

    @property
    def last_transfer(self) -> Transfer | None:
        """How the last push or pull went: bytes, ranks, seconds, the path the bytes took."""
        return self.values.last

    # -- inspecting -----------------------------------------------------------------------------

    @property
    def debugger(self) -> DebugLink:
        """JupyterLab's debugger on the ranks stopped at a breakpoint (the notebook's debug adapter)."""
        return self.cells.debug

    def interrupt(self) -> list[int]:
        """Interrupt what the ranks run outside a foreground :meth:`run` (a background run: the watcher)."""
        run = self.background
        if run is not None and run.running:
            run.interrupt_requested = True
            return list(run.gathering.targets)
        return self.escalation.interrupt()

    # -- plumbing -------------------------------------------------------------------------------

    def _notice(self, text: str) -> None:
        self.on_notice(text) if self.on_notice is not None else self.sink.notice(f"jupyter_shard: {text}")


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_live_pools):
        pool.release() if pool.keep > 0 else pool.shutdown()
