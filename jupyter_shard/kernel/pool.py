"""The kernel side of a rank pool: start ranks, fan cells out, gather output and results, stop.

A :class:`Pool` owns one ROUTER socket on ``ipc://`` inside a private 0700 directory, the pool key,
and a lifeline pipe whose write end only this process holds: when the kernel dies, every rank sees
the pipe close and kills its own process group. The thread that calls :meth:`Pool.run` pumps
messages (through :class:`~jupyter_shard.kernel.connection.Receiver`) until every target rank reports
``done``, a rank dies, or the user interrupts; ranks that do not stop are escalated here.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import zmq

from jupyter_shard._curve import CurveKeys, CurveServer
from jupyter_shard._net import free_port
from jupyter_shard.kernel import lifecycle as _lifecycle
from jupyter_shard.kernel.background import BackgroundRun, Gathering
from jupyter_shard.kernel.connection import RankRecord, Receiver
from jupyter_shard.kernel.launches import rank_launch
from jupyter_shard.kernel.output import RankSink, default_sink
from jupyter_shard.kernel.results import (
    DistributedError,
    PoolError,
    RankActivity,
    RankResult,
    RankState,
    RankStatus,
    RunResult,
)
from jupyter_shard.kernel.transcript import CellEntry, PushEntry, Transcript
from jupyter_shard.launchers import get_launcher
from jupyter_shard.launchers.base import Launcher
from jupyter_shard.protocol import (
    KERNEL,
    MAX_FRAME,
    Wire,
    cell_head,
    new_key,
)
from jupyter_shard.spec import DEFAULT_TIMEOUT, LaunchSpec, format_ranks

__all__ = ["Pool"]

START_TIMEOUT = float(os.environ.get("JUPYTER_SHARD_START_TIMEOUT", "180"))
INTERRUPT_GRACE = 2.0
DESYNC_GRACE = 3.0
OUTPUT_WAIT = 2.0
WATCH_INTERVAL = 0.05
STUCK_AFTER = 5.0

_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


_latest: Pool | None = None


def latest_pool() -> Pool | None:
    """The pool started most recently in this process (kept after shutdown for its history)."""
    return _latest


class Observer(Protocol):
    """Something that shows the pool's state (a dashboard): called often, limits its own rate."""

    def refresh(self, pool: Pool, final: bool) -> None: ...


class Pool(Receiver):
    """A pool of persistent rank processes. Use as a context manager or call :meth:`shutdown`."""

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
    ) -> None:
        self.spec = spec or LaunchSpec.create(
            nproc=nproc, device=device, strategy=strategy, timeout=timeout, launcher=launcher
        )
        super().__init__(sink or default_sink())
        self._log_root = Path(log_dir) if log_dir else None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._dir: Path | None = None
        self._lifeline_w: int | None = None
        self.log_dir: Path | None = None
        self._restart_reason: str | None = None
        self._regroup_needed = False  # ranks closed their process group to release a blocked rank
        self._out_of_step = ""  # the ranks the last cell failed on, when it failed on only some
        self._groups = 0  # process groups built after the first, each on its own store file
        self.background: BackgroundRun | None = None
        self.observers: list[Observer] = []
        self._foreground = False
        self._watcher: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._launcher: Launcher | None = None
        self._curve: CurveServer | None = None
        self.address = ""  # where ranks connect: ipc:// here, tcp:// for a multi-node pool
        self.transcript = Transcript()  # cells and pushes since the last start (%dist_export)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._sock is not None

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def __enter__(self) -> Pool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        """Spawn every rank and wait until all joined the process group (or one failed)."""
        if self.started:
            return
        _lifecycle.clean_stale_pools()
        self._regroup_needed, self._out_of_step = False, ""
        self.transcript = Transcript()
        launcher = self._launcher = get_launcher(self.spec.launcher)
        bind_host = launcher.bind_address(self.spec) if launcher.remote else ""
        key = new_key()
        self._wire = Wire(key, KERNEL)
        self._dir = _lifecycle.new_pool_dir()
        self.log_dir = _lifecycle.new_log_dir(self._log_root)
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        curve: CurveKeys | None = None
        if launcher.remote:
            # Ranks elsewhere dial back over TCP, on the address the user chose, and only through an
            # encrypted channel that admits the pool's own client key.
            curve = CurveKeys.new()
            self._curve = CurveServer(self._ctx, curve)
            self._curve.secure(sock)
            sock.bind(f"tcp://{bind_host}:0")
            address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            address = f"ipc://{self._dir / 'pool.sock'}"
            sock.bind(address)
        self._sock = sock
        self.address = address
        if hasattr(launcher, "deliver"):
            launcher.deliver = self._deliver_signal
        lifeline_r, self._lifeline_w = os.pipe()
        # One MASTER_PORT for the whole pool, as torchrun gives: code that meets on it finds one place.
        port = free_port()
        launches = [
            rank_launch(
                self.spec,
                rank,
                address=address,
                key=key,
                lifeline_fd=lifeline_r,
                master_port=port,
                curve=curve,
                pool_dir=self._dir,
                log_dir=self.log_dir,
            )
            for rank in range(self.world_size)
        ]
        try:
            handles = launcher.start(self.spec, launches, lifeline_r)
        except BaseException:
            os.close(lifeline_r)
            self._teardown()
            raise
        os.close(lifeline_r)
        for handle, launch in zip(handles, launches, strict=True):
            self._ranks[handle.rank] = RankRecord(handle, launch.log_path)
            self.sink.log_paths[handle.rank] = str(launch.log_path)
        _lifecycle.record_pool(self._dir, [h.pid for h in handles if h.pid] + launcher.local_pids())
        _live_pools.add(self)
        global _latest
        _latest = self
        foreground, self._foreground = self._foreground, True
        try:
            self._wait_ready()
            note = launcher.started_note()
            if note:
                self._notice(note)
            self._share_registered_strategy()
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._foreground = foreground
        self._start_watcher()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        shown = ""
        while any(r.state is RankState.STARTING for r in self._ranks.values()):
            self._pump(0.1)
            for r in self._ranks.values():
                code = r.handle.poll()
                if code is not None and r.state is RankState.STARTING:
                    self._pump(0.2)
                    raise PoolError(self._startup_failure(r, r.handle.exit_reason(code)))
            waiting = self._launcher.waiting() if self._launcher is not None else None
            if waiting:  # a queued job or nodes yet to join: the start-up clock has not started
                deadline = time.monotonic() + START_TIMEOUT
                if waiting != shown:
                    self._notice(waiting)
                    shown = waiting
            if time.monotonic() > deadline:
                slow = [r.rank for r in self._ranks.values() if r.state is RankState.STARTING]
                raise PoolError(
                    f"rank {format_ranks(slow)} did not start within {START_TIMEOUT:.0f} s; "
                    f"see the logs in {self.log_dir}"
                )

    def _share_registered_strategy(self) -> None:
        """A strategy registered in the kernel with ``register_strategy`` is registered on the ranks too."""
        from jupyter_shard.strategies import registered

        entry = registered(self.spec.strategy)
        if entry is None:
            return
        self.push(_js_strategy=(self.spec.strategy, *entry))
        self._run_foreground(
            "from jupyter_shard.strategies import register_strategy as _register\n"
            "_register(_js_strategy[0], _js_strategy[1], **_js_strategy[2])\n"
            "del _register, _js_strategy",
            None,
            None,
            0,
            record=False,
        )

    def _startup_failure(self, r: RankRecord, how: str) -> str:
        tb = r.exit or _tail(r.log_path)
        agent = getattr(r.handle, "agent", lambda: None)()
        if not r.exit and not r.log_path.exists() and agent is not None:
            tb = agent.tail()  # the rank never got as far as its own log: the agent says why
        return f"rank {r.rank} failed to start ({how}); its log {r.log_path} ends with:\n{tb}"

    def shutdown(self) -> None:
        """Stop every rank (and its children) and release the socket, key and private directory."""
        self._stop_watcher()
        if self._sock is not None and self._wire is not None:
            for r in self._live():
                with contextlib.suppress(PoolError):  # one not (yet) connected: it is killed below
                    self._send([r], "shutdown", {})
        deadline = time.monotonic() + 1.0
        for r in self._ranks.values():
            r.handle.wait(max(0.0, deadline - time.monotonic()))
            r.handle.kill_tree()
        self._ranks.clear()
        if self._launcher is not None:
            self._launcher.stop()
            self._launcher = None
        self._teardown()
        _live_pools.discard(self)
        run = self.background
        if run is not None and run.running:
            run.abandon("the pool was shut down")

    def _teardown(self) -> None:
        if self._curve is not None:
            self._curve.stop()
            self._curve = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._lifeline_w is not None:
            os.close(self._lifeline_w)
            self._lifeline_w = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._wire = None

    def restart(self, spec: LaunchSpec | None = None) -> None:
        """New rank processes (rank state is lost), with the same or a new spec."""
        self.shutdown()
        self._restart_reason = None
        if spec is not None:
            self.spec = spec
        self.start()

    # -- running cells ---------------------------------------------------------------------------

    def run(
        self,
        code: str,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        exec_count: int = 0,
    ) -> RunResult:
        """Run ``code`` on ``ranks`` (default: all); raise :class:`DistributedError` if any fails."""
        return self._run_foreground(code, ranks, timeout, exec_count, record=True)

    def _run_foreground(
        self,
        code: str,
        ranks: Sequence[int] | None,
        timeout: float | None,
        exec_count: int,
        record: bool,
    ) -> RunResult:
        self._refuse_while_background("run a cell")
        foreground, self._foreground = self._foreground, True  # the watcher thread stands aside
        try:
            gathering = self._begin(code, ranks, timeout, exec_count, record)
            try:
                self._gather(gathering)
            finally:
                self._end(gathering)
        finally:
            self._foreground = foreground
        if not gathering.result.ok:
            raise DistributedError(gathering.result)
        return gathering.result

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
        self._refuse_while_background("start another background run")
        gathering = self._begin(code, ranks, timeout, exec_count)
        run = BackgroundRun(gathering, exec_count, on_done)
        self.background = run
        self._start_watcher()
        return run

    def _refuse_while_background(self, what: str) -> None:
        run = self.background
        if run is not None and run.running:
            raise PoolError(
                f"cannot {what}: {run.describe()} is still running on the ranks; "
                "%dist_wait waits for it, %dist_interrupt stops it"
            )

    def _begin(
        self,
        code: str,
        ranks: Sequence[int] | None,
        timeout: float | None,
        exec_count: int,
        record: bool = True,
    ) -> Gathering:
        if self._restart_reason is not None:
            self._notice(f"restarting the pool ({self._restart_reason}); rank state is lost")
            self.restart()
        self.start()
        if self._regroup_needed:
            self._regroup()
        if self._out_of_step:
            self._notice(
                f"the last cell failed on rank {self._out_of_step} only, so the ranks may be out of "
                "step (different variables or training steps); %dist_restart gives fresh ranks"
            )
            self._out_of_step = ""
        targets = self._targets(ranks)
        cell_id = uuid.uuid4().hex
        result = RunResult(cell_id, {r.rank: RankResult(r.rank) for r in targets})
        self._run = result
        self.sink.begin_cell()
        self._send(targets, "execute", {"cell_id": cell_id, "code": code, "exec_count": exec_count})
        head = cell_head(code)
        for r in targets:
            r.state, r.cell, r.collective = RankState.RUNNING, head, ""
        asked = None if ranks is None else tuple(sorted(set(ranks)))
        return Gathering(
            result,
            [r.rank for r in targets],
            time.monotonic(),
            timeout,
            code=code,
            ranks=asked,
            exec_count=exec_count,
            record=record,
        )

    def _targets(self, ranks: Sequence[int] | None) -> list[RankRecord]:
        chosen = sorted(set(ranks)) if ranks is not None else sorted(self._ranks)
        missing = [r for r in chosen if r not in self._ranks]
        if missing:
            raise PoolError(
                f"rank {format_ranks(missing)} does not exist: the pool has {self.world_size} ranks"
            )
        dead = [self._ranks[r] for r in sorted(self._ranks) if self._ranks[r].state is RankState.DEAD]
        if dead:
            why = "; ".join(f"rank {r.rank} {r.exit or 'is dead'}" for r in dead)
            raise PoolError(
                f"{why}. Run %dist_restart (or pool.restart()) for fresh ranks; rank state is lost"
            )
        return [self._ranks[r] for r in chosen]

    def _regroup(self) -> None:
        """A new default process group on every rank, after ranks closed theirs in a release."""
        assert self._dir is not None
        self._regroup_needed = False
        self._groups += 1
        live = self._live()
        # A local pool meets on a fresh FileStore; ranks started by agents on a prefix of their store.
        where = (
            {"prefix": f"jupyter_shard/group-{self._groups}/"}
            if self.spec.multi_node
            else {"store": str(self._dir / f"store-{self._groups}")}
        )
        replies = self._request("regroup", where, live, timeout=self.spec.timeout)
        errors = [
            f"rank {r.rank}: {replies[r.rank].body['error'] if r.rank in replies else 'no answer'}"
            for r in live
            if r.rank not in replies or not replies[r.rank].body["ok"]
        ]
        if errors or len(live) < self.world_size:
            why = "; ".join(errors) or "a rank died"
            self._notice(
                f"could not rebuild the process group ({why}); restarting the pool, rank state is lost"
            )
            self.restart()
            return
        took = max(float(m.body["seconds"]) for m in replies.values())
        note = f"rebuilt the process group after the desync in {took * 1000:.0f} ms; rank state is kept"
        if any(m.body["prepared"] for m in replies.values()):
            note += (
                ". The model prepared with shard.prepare still holds the old group: run the cells that"
                " build and prepare it again, or %dist_restart"
            )
        self._notice(note)

    def _node_failures(self) -> list[str]:
        """One line per node whose ranks went down together (its agent or job step ended)."""
        down: dict[int, list[RankRecord]] = {}
        for r in self._ranks.values():
            if r.state is RankState.DEAD and getattr(r.handle, "node_down", False):
                down.setdefault(r.node, []).append(r)
        lines = []
        for node, records in sorted(down.items()):
            where = records[0].handle.host or "its host"
            again = "in a new SLURM allocation" if self.spec.launcher == "slurm" else "on the same hosts"
            lines.append(
                f"node {node} ({where}) failed: rank {format_ranks([r.rank for r in records])} went down "
                f"with it. %dist_restart starts the pool again {again}; to go on without it, run the next "
                "cell with --hosts naming the other hosts (or fewer --nodes)"
            )
        return lines

    def _end(self, gathering: Gathering) -> None:
        for line in self._node_failures():
            if line not in gathering.result.notes:
                gathering.result.notes.append(line)
        failed = [k for k, r in gathering.result.ranks.items() if r.status not in ("ok", "pending")]
        if failed and len(failed) < len(gathering.targets) and self._restart_reason is None:
            self._out_of_step = format_ranks(failed)
        self.sink.end_cell(failed)
        self._run = None
        if gathering.record:
            status = "ok" if gathering.result.ok else "error"
            self.transcript.add(CellEntry(gathering.code, gathering.ranks, status, gathering.exec_count))
        self._tick(final=True)

    def _gather(self, gathering: Gathering) -> None:
        interrupted = False
        while True:
            try:
                if self._gather_step(gathering, 0.05):
                    break
            except KeyboardInterrupt:
                if interrupted:
                    continue
                interrupted = True
                self._stop(gathering.result, gathering.pending, "interrupted")
                break
        if interrupted:
            gathering.result.notes.append("the cell was interrupted")

    def _gather_step(self, gathering: Gathering, wait: float) -> bool:
        """Receive for up to ``wait`` seconds and act on what happened; True once the cell ended."""
        result, pending = gathering.result, gathering.pending
        self._pump(wait)
        self._tick()
        for k in list(pending):
            r = self._ranks[k]
            if self._check_exit(r, result):
                pending.discard(k)
            if r.pending_done is not None and time.monotonic() - r.pending_since > OUTPUT_WAIT:
                self._finish(r, r.pending_done)  # output lost in transit must not hang the cell
        pending.intersection_update(k for k in pending if result.ranks[k].status == "pending")
        if not pending:
            return True
        now = time.monotonic()
        if not gathering.first_done and len(pending) < len(gathering.targets):
            gathering.first_done = now
        failed = [f for f in result.ranks.values() if f.failed_at]
        dead = [f.rank for f in failed if f.status == "dead"]
        if dead:
            self._stop(result, pending, f"stopped because rank {format_ranks(dead)} died")
            return True
        if failed and now - min(f.failed_at for f in failed) > DESYNC_GRACE:
            self._stop(result, pending, "still running after another rank failed")
            return True
        waiting = {k: self._ranks[k].collective for k in sorted(pending) if self._ranks[k].collective}
        if gathering.first_done and now - gathering.first_done > DESYNC_GRACE and waiting:
            # A collective can never complete once a rank it needs has left the cell: a straggler
            # took another branch (F4). Say who waits where, and for whom.
            done = format_ranks(sorted(set(gathering.targets) - pending))
            calls = ", ".join(sorted(set(waiting.values())))
            self._stop(
                result,
                pending,
                f"waited in {calls} for rank {done}, which finished the cell without joining it",
            )
            return True
        timeout = gathering.timeout
        if timeout is not None and time.monotonic() - gathering.started > timeout:
            self._stop(result, pending, f"still running after the {timeout:g} s timeout")
            return True
        return False

    # -- the watcher thread: background runs, and heartbeats and deaths between cells -------------

    def _start_watcher(self) -> None:
        if self._watcher is not None and self._watcher.is_alive():
            return
        self._watch_stop.clear()
        self._watcher = threading.Thread(target=self._watch, name="jupyter_shard-watcher", daemon=True)
        self._watcher.start()

    def _stop_watcher(self) -> None:
        self._watch_stop.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(5.0)

    def _watch(self) -> None:
        while not self._watch_stop.wait(WATCH_INTERVAL):
            with self._io_lock:
                if self._sock is None or self._watch_stop.is_set():
                    return
                if self._foreground:
                    continue
                run = self.background
                if run is None or not run.running:
                    self._pump(0)
                    for r in self._ranks.values():
                        self._check_exit(r, None)
                    self._tick()
                    continue
            run.context.run(self._background_step, run)

    def _background_step(self, run: BackgroundRun) -> None:
        gathering = run.gathering
        if run.interrupt_requested:
            run.interrupt_requested = False
            self._stop(gathering.result, gathering.pending, "interrupted (%dist_interrupt)")
            gathering.result.notes.append("the cell was interrupted")
            ended = True
        else:
            ended = self._gather_step(gathering, 0.0)
        if ended:
            self._end(gathering)
            run.finish()

    def _tick(self, final: bool = False) -> None:
        """Let observers (dashboards) redraw; each limits its own rate."""
        for observer in list(self.observers):
            try:
                observer.refresh(self, final)
            except Exception as exc:  # a broken display must not break the run
                self.observers.remove(observer)
                print(f"jupyter_shard: a dashboard stopped updating: {exc!r}", file=sys.__stderr__)

    def activity(self) -> list[RankActivity]:
        """Each rank's state, step, throughput, memory and heartbeat age; problems named."""
        now, wall = time.monotonic(), time.time()
        last_logs = {k: self.history.last(k) for k in self._ranks}
        newest = max((v[1] for v in last_logs.values() if v is not None), default=0.0)
        rows = []
        for k, r in sorted(self._ranks.items()):
            last = last_logs[k]
            age = now - r.heartbeat if r.heartbeat else None
            problem = ""
            if r.state is RankState.DEAD:
                problem = f"dead: {r.exit or 'exited'}"
            elif r.state is RankState.RUNNING and age is not None and age > STUCK_AFTER:
                problem = f"stuck: no heartbeat for {age:.0f} s (holding the GIL in native code?)"
            elif r.state is RankState.RUNNING and last is not None and newest - last[1] > STUCK_AFTER * 3:
                problem = f"stuck: no shard.log for {wall - last[1]:.0f} s while other ranks log"
            rows.append(
                RankActivity(
                    rank=k,
                    state=r.state,
                    step=last[0] if last is not None else (float(r.step) if r.step else None),
                    steps_per_s=self.history.throughput(k, wall),
                    memory=dict(r.memory),
                    heartbeat_age=age,
                    cell=r.cell if r.state is RankState.RUNNING else "",
                    last_line=r.last_line,
                    problem=problem,
                )
            )
        return rows

    def _await_stopped(
        self, result: RunResult, ranks: list[int], seconds: float, enough: Callable[[list[int]], bool]
    ) -> list[int]:
        """Receive for up to ``seconds`` until ``ranks`` ended their cell or ``enough(running)``;
        return those still running."""
        deadline = time.monotonic() + seconds
        while True:
            self._pump(0.05)
            for k in ranks:
                self._check_exit(self._ranks[k], result)
            running = [k for k in ranks if result.ranks[k].status == "pending"]
            if not running or enough(running) or time.monotonic() >= deadline:
                return running

    def _release(self, blocked: dict[int, str], running: list[int], released: list[int]) -> list[int]:
        """Ask the idle ranks not asked before to close their process group; the ranks asked."""
        idle = [r for r in self._live() if r.rank not in running and r.rank not in released]
        waiting = [k for k in running if k in blocked]
        if not idle or not waiting:
            return []
        names = format_ranks([r.rank for r in idle])
        calls = ", ".join(sorted({blocked[k] or "a collective or native code" for k in waiting}))
        self._notice(
            f"rank {format_ranks(waiting)} is blocked in {calls}: closing the process group on "
            f"rank {names} to release it"
        )
        live = self._live()
        body = {"peers": [r.handle.pid for r in live], "peer_hosts": [r.handle.host for r in live]}
        replies = self._request("release", body, idle, timeout=INTERRUPT_GRACE)
        for r in idle:
            reply = replies.get(r.rank)
            if reply is None:
                self._notice(
                    f"rank {r.rank} did not confirm closing its process group within {INTERRUPT_GRACE:g} s"
                )
            elif not reply.body["ok"]:
                self._notice(f"rank {r.rank} could not close its process group: {reply.body['error']}")
        self._regroup_needed = True
        return [r.rank for r in idle]

    def _stop(self, result: RunResult, pending: set[int], why: str) -> None:
        """Escalate until the pending ranks stop, saying each step.

        1. SIGINT to the ranks running Python. A rank blocked in a gloo collective sees no signal;
           for it, the ranks that are idle close their process group, so the collective fails at
           once and every rank keeps its state (the group is rebuilt before the next cell).
        2. When only blocked ranks are left, or after ``INTERRUPT_GRACE``: a release by the ranks
           that became idle meanwhile, and SIGINT to whatever else still runs.
        3. After another ``INTERRUPT_GRACE``: the stacks of what still runs, then a kill.
        """
        ranks = sorted(pending)
        blocked = {k: self._ranks[k].collective for k in ranks if self._ranks[k].collective}
        running = [k for k in ranks if k not in blocked]
        if running:
            self._notice(f"rank {format_ranks(running)} {why}: sending SIGINT")
        else:
            self._notice(f"rank {format_ranks(ranks)} {why}")
        if blocked:
            result.notes.append(f"rank {format_ranks(ranks)} {why}")
        for k in running:
            self._ranks[k].handle.send_signal(signal.SIGINT)
        released = self._release(blocked, ranks, [])

        def only_blocked_left(still: list[int]) -> bool:  # and someone idle could release them
            idle = any(r.rank not in still and r.rank not in released for r in self._live())
            return idle and all(k in blocked for k in still)

        still = self._await_stopped(result, ranks, INTERRUPT_GRACE, only_blocked_left)
        suspects: dict[int, str] = {}
        if still:
            # A heartbeat may have named the collective since; and a rank that let SIGINT pass for
            # INTERRUPT_GRACE is likely blocked in one anyway: a release costs only a regroup.
            blocked.update({k: self._ranks[k].collective for k in still if self._ranks[k].collective})
            suspects = {k: blocked.get(k, "") for k in still}
            fresh = self._release(suspects, still, released)
            released += fresh
            others = [k for k in still if not (k in blocked and fresh)]
            if others:
                self._notice(f"rank {format_ranks(others)} still running: sending SIGINT")
                for k in others:
                    self._ranks[k].handle.send_signal(signal.SIGINT)
            still = self._await_stopped(result, still, INTERRUPT_GRACE, lambda _: False)
        for k in sorted(set(blocked) | set(suspects)):
            failure = result.ranks[k]
            if released and k not in still and failure.status == "error":
                failure.evalue = (
                    f"left waiting in {blocked.get(k) or 'a collective'}; released by closing the "
                    f"process group on rank {format_ranks(released)}"
                )
        if released and any(k not in still for k in set(blocked) | set(suspects)):
            result.notes.append(
                f"closed the process group on rank {format_ranks(released)} to release the ranks "
                "blocked in a collective; the next cell first rebuilds the group (rank state is kept)"
            )
        if not still:
            return
        stuck = still
        stacks = self.stacks(timeout=1.0, ranks=stuck)
        waited = 2 * INTERRUPT_GRACE
        for k in stuck:
            why = f"was killed by jupyter_shard: still running {waited:g} s after it was asked to stop"
            self._ranks[k].killed_by_pool = why
            self._ranks[k].handle.kill_tree()
            self._check_exit(self._ranks[k], result)
            result.ranks[k].traceback[:0] = [
                f"rank {k} did not stop within {waited:g} s (SIGINT, then a release of any collective "
                "it waited in); its stack before it was killed:",
                stacks[k],
            ]
        note = (
            f"killed rank {format_ranks(stuck)} (still running {waited:g} s after it was asked to stop); "
            "the next cell restarts the pool: rank state is lost"
        )
        result.notes.append(note)
        self._notice(note)
        self._restart_reason = f"rank {format_ranks(stuck)} was killed"

    # -- moving values ---------------------------------------------------------------------------

    def push(self, ranks: Sequence[int] | None = None, **values: Any) -> None:
        """Copy kernel values to every rank (or ``ranks``) under the given names."""
        import cloudpickle

        self._refuse_while_background("push values")
        self.start()
        names = list(values)
        buffers = [cloudpickle.dumps(values[n]) for n in names]
        too_big = [n for n, b in zip(names, buffers, strict=True) if len(b) > MAX_FRAME]
        if too_big:
            raise PoolError(
                f"{too_big[0]!r} is over the {MAX_FRAME // 2**20} MiB message limit; "
                "save it to a file and load it on the ranks"
            )
        replies = self._request("push", {"names": names}, self._targets(ranks), buffers=buffers, timeout=60.0)
        errors = [f"rank {k}: {m.body['error']}" for k, m in sorted(replies.items()) if not m.body["ok"]]
        if errors:
            raise PoolError("push failed on " + "; ".join(errors))
        if not names[0].startswith("_js_"):  # the pool's own pushes are not the user's work
            asked = None if ranks is None else tuple(sorted(set(ranks)))
            self.transcript.add(PushEntry(tuple(zip(names, buffers, strict=True)), asked))

    def pull(self, name: str, rank: int = 0, *, gather: bool = False) -> Any:
        """A copy of the rank's variable ``name``.

        ``gather=True``: ``name`` is the model returned by ``shard.prepare``; every rank takes part
        in gathering its shards and rank 0 returns it as a plain ``nn.Module`` on the CPU.
        """
        if gather:
            return self.pull_all(name, gather=True)[0]
        return self.pull_all(name, ranks=[rank])[rank]

    def pull_all(
        self, name: str, ranks: Sequence[int] | None = None, *, gather: bool = False
    ) -> dict[int, Any]:
        import cloudpickle

        self._refuse_while_background("pull values")
        self.start()
        if gather and self._regroup_needed:  # gathering is a collective: it needs a working group
            self._regroup()
        body = {"name": name, "gather": gather}
        replies = self._request("pull", body, self._targets(None if gather else ranks), timeout=600.0)
        out: dict[int, Any] = {}
        for k, msg in sorted(replies.items()):
            if not msg.body["ok"]:
                raise PoolError(msg.body["error"])
            out[k] = cloudpickle.loads(msg.buffers[0])
        missing = sorted(set(r.rank for r in self._targets(None if gather else ranks)) - set(out))
        if missing:
            raise PoolError(f"rank {format_ranks(missing)} did not answer the pull of {name!r}")
        return out

    # -- inspecting ------------------------------------------------------------------------------

    def status(self) -> list[RankStatus]:
        replies = self._request("status", {}, self._live(), timeout=1.0) if self.started else {}
        rows = []
        for k, r in sorted(self._ranks.items()):
            self._check_exit(r, None)
            reply = replies.get(k)
            memory = dict(reply.body["memory"]) if reply else {}
            cell = (
                str(reply.body["cell"])
                if reply and reply.body["executing"]
                else r.cell
                if r.state is RankState.RUNNING
                else ""
            )
            collective = str(reply.body.get("collective", "")) if reply else ""
            if collective:
                cell = f"{cell} · in {collective}"
            rows.append(
                RankStatus(
                    k, r.handle.pid, r.handle.host, r.device, r.state, memory, cell, str(r.log_path), r.exit
                )
            )
        return rows

    def stacks(self, timeout: float = 2.0, ranks: Sequence[int] | None = None) -> dict[int, str]:
        """Every rank's current Python stacks, even mid-cell (safe to call from another thread)."""
        chosen = sorted(self._ranks) if ranks is None else sorted(ranks)
        live = [r for r in self._live() if r.rank in chosen]
        replies = self._request("stacks", {}, live, timeout=timeout)
        out: dict[int, str] = {}
        for k in chosen:
            r = self._ranks[k]
            if k in replies:
                parts = [f"{s['thread']}:\n{s['stack']}" for s in replies[k].body["stacks"]]
                out[k] = "\n".join(parts)
            elif r.state is RankState.DEAD:
                out[k] = f"(rank {k} {r.exit})"
            else:
                out[k] = f"(no answer within {timeout:g} s: the rank may hold the GIL in native code)"
        return out

    def interrupt(self) -> None:
        """Interrupt whatever the ranks are running (outside a foreground :meth:`run`).

        A background run is stopped by the watcher thread: SIGINT, then after the grace period the
        stacks of ranks that did not stop and a kill; :meth:`BackgroundRun.wait` sees the end.
        """
        run = self.background
        if run is not None and run.running:
            run.interrupt_requested = True
            return
        for r in self._live():
            if r.state is RankState.RUNNING:
                r.handle.send_signal(signal.SIGINT)

    # -- plumbing --------------------------------------------------------------------------------

    def _deliver_signal(self, rank: int, sig: int) -> None:
        """Ask a rank started by an agent to signal itself (its I/O thread does, even mid-cell)."""
        r = self._ranks.get(rank)
        if r is not None and self._sock is not None:
            self._send([r], "signal", {"signal": int(sig)})


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return "(no log)"
    return data.decode(errors="replace").strip() or "(the log is empty)"


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_live_pools):
        pool.shutdown()
