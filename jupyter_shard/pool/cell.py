"""One cell on the ranks, from ``execute`` to the last rank's ``done``: the only writer of a
:class:`~jupyter_shard.pool.results.RunResult`.

:class:`CellGathering` sends the cell, takes in what the ranks send about it (output, displays, the
last expression's value, ``done``) and decides each step whether the cell is over: every rank done, a
rank dead, a rank failed while others still run (a desync), a collective that can never complete, or
the timeout. Whatever has to be stopped is handed to :class:`~jupyter_shard.pool.escalation.Escalation`,
whose outcome is written into the result here.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.debugging import DebugLink
from jupyter_shard.pool.escalation import Escalation, Stopped
from jupyter_shard.pool.output import RankSink, visible_text
from jupyter_shard.pool.prompts import Prompts
from jupyter_shard.pool.ranks import RankRecord, RankState, RankTable, lost_context_line, restart_advice
from jupyter_shard.pool.results import RankResult, RunResult
from jupyter_shard.pool.stdin import StdinSource, default_stdin
from jupyter_shard.spec import format_ranks
from jupyter_shard.wire.messages import EXECUTE, ExecuteBody
from jupyter_shard.wire.protocol import TEXT_ERRORS, Message, cell_head

__all__ = ["POST_MORTEM", "CellGathering", "Gathering"]

POST_MORTEM = "%debug"  # the cell that opens pdb where the rank's last failed cell raised

CAPTURE_LIMIT = 4 * 1024 * 1024  # of each rank's stdout and stderr kept in the result
DESYNC_GRACE = 3.0
EXIT_CHECK = 0.02  # seconds between polls of the running ranks' processes during a cell
IDLE_EXIT_CHECK = 0.25  # the same between cells (a status or the next cell polls at once)
OUTPUT_WAIT = 2.0


@dataclass
class Gathering:
    """One cell in flight: its result so far, the ranks it waits on and its limits."""

    result: RunResult
    targets: list[int]
    started: float
    timeout: float | None
    pending: set[int] = field(default_factory=set)
    first_done: float = 0.0  # when the first rank finished the cell (monotonic), 0 before
    exits_checked: float = 0.0  # when the ranks' processes were last polled (monotonic)
    code: str = ""
    ranks: tuple[int, ...] | None = None  # as asked for (None: all ranks)
    exec_count: int = 0
    record: bool = True  # kept in the pool's transcript (what %dist_export writes out)
    stdin: StdinSource | None = None  # where prompts are answered (None: a background run, not yet)
    prompts: Prompts = field(default_factory=Prompts)
    lost: list[int] = field(default_factory=list)  # ranks whose CUDA context this cell lost for good

    def __post_init__(self) -> None:
        self.pending = set(self.targets)


def _last_visible_line(text: str, look_back: int = 64) -> str:
    """The last non-blank line a terminal would show, looking only at the end of ``text``."""
    for line in reversed(text.rsplit("\n", look_back)[-look_back:]):
        shown = visible_text(line.removesuffix("\r"))
        if shown.strip():
            return shown
    return ""


class CellGathering:
    """Sends cells and gathers their results; at most one cell is in flight at a time."""

    def __init__(
        self,
        conn: Connection,
        ranks: RankTable,
        escalation: Escalation,
        sink: Callable[[], RankSink],
        tick: Callable[[], None] = lambda: None,
        stdin: Callable[[], StdinSource] = default_stdin,  # for each foreground cell, in its thread
    ) -> None:
        self.conn = conn
        self.tick = tick  # after each receive: observers (dashboards) redraw at their own rate
        self.ranks = ranks
        self.escalation = escalation
        self._exits_checked = 0.0  # between cells (monotonic)
        self._sink = sink
        self.current: Gathering | None = None
        self.stdin = stdin
        self.debug = DebugLink(conn, ranks)  # the notebook's debugger, on ranks stopped at breakpoints
        self.last: RunResult | None = None  # the result of the last cell that ended
        self.out_of_step = ""  # the ranks the last cell failed on, when it failed on only some
        conn.on_io = self._on_io
        conn.handle(
            {
                "stream": self.on_stream,
                "display": self.on_display,
                "result": self.on_result,
                "done": self.on_done,
                "prompt": self.on_prompt,
            }
        )

    def open(
        self,
        code: str,
        targets: list[RankRecord],
        timeout: float | None,
        exec_count: int,
        asked: Sequence[int] | None,
        record: bool,
    ) -> Gathering:
        """Make ``code`` the cell in flight on ``targets`` (:meth:`send` sends it)."""
        if code != POST_MORTEM:  # a look at the last failure is not the next step
            self.warn_out_of_step()
        result = RunResult(uuid.uuid4().hex, {r.rank: RankResult(r.rank) for r in targets})
        self.current = Gathering(
            result,
            [r.rank for r in targets],
            time.monotonic(),
            timeout,
            code=code,
            ranks=None if asked is None else tuple(sorted(set(asked))),
            exec_count=exec_count,
            record=record,
        )
        return self.current

    def send(self, gathering: Gathering, targets: list[RankRecord]) -> Gathering:
        """Send the opened cell to ``targets``; the ranks are running it from now on."""
        self._sink().begin_cell(len(targets))
        body: ExecuteBody = {
            "cell_id": gathering.result.cell_id,
            "code": gathering.code,
            "exec_count": gathering.exec_count,
            "cwd": os.getcwd(),
        }
        if gathering.code == POST_MORTEM and not gathering.record:
            body["post_mortem"] = True
        elif (setup := self.debug.setup()) is not None:
            body["debug"] = setup
        self.conn.send(targets, *EXECUTE(body))
        head, now = cell_head(gathering.code), time.monotonic()
        for r in targets:
            r.state, r.cell, r.collective, r.group_ranks, r.waiting = RankState.RUNNING, head, "", [], ""
            r.sent = now
        return gathering

    def follow(self, cell_id: str, targets: list[RankRecord], head: str) -> Gathering:
        """Make the cell ``cell_id``, which ``targets`` already run (sent by a kernel before this one,
        to a kept pool), the cell in flight: its output and its end are gathered from now on."""
        result = RunResult(cell_id, {r.rank: RankResult(r.rank) for r in targets})
        self.current = Gathering(
            result, [r.rank for r in targets], time.monotonic(), None, code=head, record=False
        )
        self._sink().begin_cell(len(targets))
        now = time.monotonic()
        for r in targets:
            r.state, r.cell, r.sent = RankState.RUNNING, head, now
        return self.current

    def end(self, gathering: Gathering, notes: Sequence[str]) -> None:
        """Close the cell: add ``notes`` (node failures), flush its output."""
        for line in notes:
            if line not in gathering.result.notes:
                gathering.result.notes.append(line)
        dead = [k for k, r in gathering.result.ranks.items() if r.status == "dead"]
        if dead and self.escalation.restart_reason is None:
            gathering.result.notes.append(
                f"rank {format_ranks(dead)} died: run %dist_restart for fresh ranks (rank state is lost)"
            )
        if gathering.lost:  # the root cause: said first
            gathering.result.notes[:0] = lost_context_notes([self.ranks[k] for k in gathering.lost])
        failed = [k for k, r in gathering.result.ranks.items() if r.status not in ("ok", "pending")]
        if failed and len(failed) < len(gathering.targets) and self.escalation.restart_reason is None:
            self.out_of_step = format_ranks(failed)
        self.escalation.say_group_closed()
        self._sink().end_cell(failed)
        self.current, self.last = None, gathering.result

    def warn_out_of_step(self) -> None:
        """Before the next cell: say once that the last one failed on some ranks only."""
        if self.out_of_step:
            self.escalation.notice(
                f"the last cell failed on rank {self.out_of_step} only, so the ranks may be out of "
                "step (different variables or training steps); %dist_restart gives fresh ranks"
            )
            self.out_of_step = ""

    def gather(self, gathering: Gathering) -> None:
        """Receive until the cell ends; Ctrl-C in the kernel stops the ranks (escalating)."""
        gathering.stdin = self.stdin()
        interrupted = False
        while True:
            try:
                if self.step(gathering, 0.05):
                    break
            except KeyboardInterrupt:
                if interrupted:
                    continue
                interrupted = True
                self.stop(gathering, "interrupted")
                break
        if interrupted:
            gathering.result.notes.append("the cell was interrupted")

    def serve_prompts(self, gathering: Gathering) -> None:
        """Ask the person for a background run's prompts (``%dist_wait``, in its own cell and thread,
        whose answers it takes)."""
        gathering.prompts.serve(self.ranks, self.stdin(), self.conn.send, self._sink())

    def interrupted(self, gathering: Gathering, why: str) -> None:
        """Stop a cell the user interrupted from elsewhere (a background run)."""
        self.stop(gathering, why)
        gathering.result.notes.append("the cell was interrupted")

    def step(self, gathering: Gathering, wait: float) -> bool:
        """Receive for up to ``wait`` seconds and act on what happened; True once the cell ended."""
        result, pending = gathering.result, gathering.pending
        self.conn.pump(wait)
        self.tick()
        now = time.monotonic()
        exits = now - gathering.exits_checked >= EXIT_CHECK  # at 1,024 ranks, not a poll each per message
        if exits:
            gathering.exits_checked = now
        for k in list(pending):
            r = self.ranks[k]
            if exits and self.check_exit(r, result):
                pending.discard(k)
            if r.pending_done is not None and now - r.pending_since > OUTPUT_WAIT:
                self._finish(r, r.pending_done)  # output lost in transit must not hang the cell
        pending.intersection_update(k for k in pending if result.ranks[k].status == "pending")
        if not pending:
            return True
        gathering.prompts.serve(self.ranks, gathering.stdin, self.conn.send, self._sink())
        now = time.monotonic()
        if not gathering.first_done and len(pending) < len(gathering.targets):
            gathering.first_done = now
        failed = [f for f in result.ranks.values() if f.failed_at]
        dead = [f.rank for f in failed if f.status == "dead"]
        if dead:
            self.stop(gathering, f"stopped because rank {format_ranks(dead)} died")
            return True
        at_prompt = any(self.ranks[k].waiting for k in pending)  # a person is looking: no desync
        if failed and now - min(f.failed_at for f in failed) > DESYNC_GRACE and not at_prompt:
            self.stop(gathering, "still running after another rank failed")
            return True
        waiting = {k: self.ranks[k].collective for k in sorted(pending) if self.ranks[k].collective}
        if gathering.first_done and now - gathering.first_done > DESYNC_GRACE and waiting:
            # A collective can never complete once a rank it needs has left the cell: a straggler
            # took another branch (F4). Say who waits where, and for whom.
            done = format_ranks(sorted(set(gathering.targets) - pending))
            calls = ", ".join(sorted(set(waiting.values())))
            self.stop(
                gathering, f"waited in {calls} for rank {done}, which finished the cell without joining it"
            )
            return True
        if self._lone_collective(gathering, waiting):
            return True
        timeout = gathering.timeout
        if timeout is not None and time.monotonic() - gathering.started > timeout:
            result.timed_out = timeout
            self.stop(gathering, f"still running after the {timeout:g} s timeout")
            return True
        return False

    def _lone_collective(self, gathering: Gathering, waiting: dict[int, str]) -> bool:
        """A cell on some ranks only (``%%rank``, ``--ranks``) whose heartbeat shows a rank in a
        collective of a group with ranks outside the cell (the default group, say): those ranks are
        idle and can never join it. Stop the cell and release the collective as after an interrupt;
        the next cell rebuilds the group, rank state kept. True once stopped. A collective on a
        subgroup of the cell's own ranks is left alone."""
        if not waiting:
            return False
        live = [r.rank for r in self.ranks.live()]
        needs = {k: self.ranks[k].group_ranks or live for k in waiting}
        outside = sorted({o for k in waiting for o in needs[k] if o not in gathering.targets})
        if not outside:
            return False
        calls = ", ".join(sorted(set(waiting.values())))
        self.stop(
            gathering,
            f"is waiting in {calls} while rank {format_ranks(outside)} "
            f"{'is' if len(outside) == 1 else 'are'} not running this cell; a collective needs every "
            "rank of its group: run it in a cell on all ranks",
        )
        return True

    def check_exits(self) -> None:
        """Notice the ranks that exited outside a cell."""
        for r in self.ranks:
            self.check_exit(r, None)

    def idle_step(self) -> None:
        """Between cells (the watcher thread): receive what came, notice exits, let observers redraw."""
        self.conn.pump(0)
        if time.monotonic() - self._exits_checked >= IDLE_EXIT_CHECK:
            self._exits_checked = time.monotonic()
            self.check_exits()
        self.tick()

    def check_exit(self, r: RankRecord, result: RunResult | None) -> bool:
        """Notice that ``r`` died; True if that failed its part of ``result`` (then it is recorded)."""
        if not self.conn.poll_exit(r):
            return False
        if result is None or r.rank not in result.ranks or result.ranks[r.rank].status != "pending":
            return False
        failure = result.ranks[r.rank]
        failure.status, failure.evalue, failure.failed_at = (
            "dead",
            f"rank {r.rank} {r.exit}",
            time.monotonic(),
        )
        failure.traceback = [f"rank {r.rank} {r.exit} while running the cell; its log: {r.log_path}"]
        return True

    # -- stopping ranks that still run, and writing down how it went ------------------------------

    def stop(self, gathering: Gathering, why: str) -> None:
        result = gathering.result
        pending = sorted(gathering.pending)
        if any(self.ranks[k].collective for k in pending):
            result.notes.append(f"rank {format_ranks(pending)} {why}")
        stopped = self.escalation.stop(
            pending, why, lambda ranks, secs, enough: self._await(result, ranks, secs, enough)
        )
        self._record(result, stopped)

    def _await(
        self, result: RunResult, ranks: list[int], seconds: float, enough: Callable[[list[int]], bool]
    ) -> list[int]:
        """Receive for up to ``seconds`` until ``ranks`` ended their cell or ``enough(running)``;
        return those still running."""
        deadline = time.monotonic() + seconds
        while True:
            self.conn.pump(0.05)
            for k in ranks:
                self.check_exit(self.ranks[k], result)
            running = [k for k in ranks if result.ranks[k].status == "pending"]
            if not running or enough(running) or time.monotonic() >= deadline:
                return running

    def _record(self, result: RunResult, stopped: Stopped) -> None:
        for k in stopped.released_from:
            failure = result.ranks[k]
            if failure.status == "error":
                failure.evalue = (
                    f"left waiting in {stopped.blocked.get(k) or 'a collective'}; released by closing the "
                    f"process group on rank {format_ranks(stopped.released)}"
                )
        if stopped.released_from:
            # a dead or broken rank needs a restart, which end() says, not a rebuilt group
            restart = any(r.status == "dead" or self.ranks[k].broken for k, r in result.ranks.items())
            result.notes.append(
                f"closed the process group on rank {format_ranks(stopped.released)} to release the ranks "
                "blocked in a collective"
                + ("" if restart else "; the next cell first rebuilds the group (rank state is kept)")
            )
        for k, stack in stopped.killed.items():
            self.check_exit(self.ranks[k], result)
            result.ranks[k].traceback[:0] = [
                f"rank {k} did not stop within {stopped.waited:g} s (SIGINT, then a release of any "
                "collective it waited in); its stack before it was killed:",
                stack,
            ]
        if stopped.killed:
            result.notes.append(stopped.kill_note)

    # -- what ranks send about the running cell (dispatched by the connection) --------------------

    def on_stream(self, r: RankRecord, msg: Message) -> None:
        name = str(msg.body["name"])
        try:
            (data,) = msg.buffers
            text = data.decode("utf-8", TEXT_ERRORS)
        except ValueError:  # not one buffer, or not UTF-8
            self.ranks.drop_malformed(r, "output")
            return
        self._sink().stream(r.rank, name, text)
        last = _last_visible_line(text)
        if last:
            r.last_line = last[:200]
        run = self.current
        if run is not None and r.rank in run.result.ranks:
            res = run.result.ranks[r.rank]
            if name == "stderr" and len(res.stderr) < CAPTURE_LIMIT:
                res.stderr += text
            elif name == "stdout" and len(res.stdout) < CAPTURE_LIMIT:
                res.stdout += text

    def on_prompt(self, r: RankRecord, msg: Message) -> None:
        run = self.current
        if run is None or msg.body["cell_id"] != run.result.cell_id or r.rank not in run.result.ranks:
            Prompts.refuse(self.conn.send, r, "the cell that asked has ended")
            return
        run.prompts.add(r, msg)

    def on_display(self, r: RankRecord, msg: Message) -> None:
        self._sink().display(r.rank, dict(msg.body["data"]), dict(msg.body["metadata"]))

    def on_result(self, r: RankRecord, msg: Message) -> None:
        run = self.current
        if run is not None and r.rank in run.result.ranks:
            run.result.ranks[r.rank].result = dict(msg.body["data"])

    def on_done(self, r: RankRecord, msg: Message) -> None:
        if r.io_received < int(msg.body["io_count"]):
            r.pending_done = msg  # its output is still in flight on the I/O socket
            r.pending_since = time.monotonic()
            return
        self._finish(r, msg)

    def _on_io(self, r: RankRecord) -> None:
        if r.pending_done is not None and r.io_received >= r.pending_done.body["io_count"]:
            self._finish(r, r.pending_done)

    def _finish(self, r: RankRecord, msg: Message) -> None:
        r.pending_done, r.waiting = None, ""
        body = msg.body
        if not body.get("grouped", True):
            self.escalation.group_closed(r.rank, str(body.get("ungrouped", "")))
        ok = body["status"] == "ok"
        lost = "" if r.broken else str(body.get("lost_context", ""))  # newly lost, by this cell
        r.broken = r.broken or lost
        r.state = RankState.BROKEN if r.broken else _state_after(body["status"], str(body.get("ename", "")))
        r.cell = ""
        run = self.current
        if run is None or body["cell_id"] != run.result.cell_id or r.rank not in run.result.ranks:
            return
        if lost:
            run.lost.append(r.rank)
        res = run.result.ranks[r.rank]
        res.duration = float(body["duration"])
        if ok:
            res.status = "ok"
            return
        res.status = "interrupted" if body["ename"] == "KeyboardInterrupt" else "error"
        res.ename, res.evalue = str(body["ename"]), str(body["evalue"])
        res.traceback = [str(line) for line in body["traceback"]]
        res.failed_at = time.monotonic()


def lost_context_notes(broken: Sequence[RankRecord]) -> list[str]:
    """What the cell that lost ranks' CUDA context says: what that means, and what to do."""
    where = "that process" if len(broken) == 1 else "those processes"
    return [
        f"{lost_context_line(broken)}: every later CUDA call in {where} fails the same way and only a "
        f"new process helps, so cells on it are refused from now on; {restart_advice(broken)}",
        "to locate the failing operation: %env CUDA_LAUNCH_BLOCKING=1, then %dist_restart and run the "
        "cells again (each CUDA call then waits for its kernels, so the error is raised at the operation "
        "that failed)",
    ]


def _state_after(status: str, ename: str) -> RankState:
    """A rank's state once its cell ended: idle, failed, or interrupted (stopped, not broken)."""
    if status == "ok":
        return RankState.IDLE
    return RankState.INTERRUPTED if ename == "KeyboardInterrupt" else RankState.FAILED
