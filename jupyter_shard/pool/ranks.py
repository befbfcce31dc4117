"""The kernel's table of rank processes: what each one is doing, as far as the kernel knows.

One :class:`RankRecord` per rank holds its handle (from the launcher), its state and what its
``ready`` and heartbeats said. :class:`RankTable` owns the records: it applies the messages that
describe a rank rather than a cell (``ready``, ``heartbeat``, ``startup_failed``, ``metrics``), notices
deaths, and gives the one snapshot type the rest of the package shows (:class:`RankSnapshot`:
``%dist_status``, the dashboard, the comm panel, the picker's free memory).
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from jupyter_shard.errors import PoolError
from jupyter_shard.launchers import RankHandle
from jupyter_shard.pool import oom
from jupyter_shard.pool.history import History
from jupyter_shard.spec import format_ranks
from jupyter_shard.wire.protocol import Message, io_identity, rank_identity

__all__ = ["RankRecord", "RankSnapshot", "RankState", "RankTable", "lost_context_line", "restart_advice"]

STUCK_AFTER = 5.0  # seconds without a heartbeat (or a log while others log) before a rank looks stuck
IMPORT_GRACE = 60.0  # a rank last seen importing looks busy, not stuck, this long without a heartbeat


class RankState(str, Enum):
    STARTING = "starting"
    IDLE = "idle"
    RUNNING = "running"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # its last cell was stopped (an interrupt, a --timeout); idle now
    PROMPT = "at a prompt"  # running a cell that waits for an answer (input(), pdb) from the notebook
    BROKEN = "broken"  # its CUDA context is lost (a device-side assert...): it runs no cell until a restart
    DEAD = "dead"


@dataclass(frozen=True)
class RankSnapshot:
    """One rank as shown to people: ``%dist_status``, the dashboard, the panel, free-memory probes.

    ``memory`` is fresh from the rank in :meth:`~jupyter_shard.pool.pool.Pool.status` and from
    its last heartbeat in :meth:`~jupyter_shard.pool.pool.Pool.activity`; ``problem`` names a
    rank that needs attention (``dead: …``, ``broken: …`` or ``stuck: …``).
    """

    rank: int
    state: RankState
    memory: dict[str, int] = field(default_factory=dict)
    cell: str = ""
    pid: int = 0
    host: str = ""
    device: str = ""
    log_path: str = ""
    exit: str = ""
    step: float | None = None
    steps_per_s: float | None = None
    heartbeat_age: float | None = None
    last_line: str = ""
    problem: str = ""


class RankRecord:
    """The kernel's record of one rank process."""

    def __init__(self, handle: RankHandle, log_path: Path) -> None:
        self.handle = handle
        self.rank = handle.rank
        self.identity = rank_identity(handle.rank).encode()
        self.io_identity = io_identity(handle.rank).encode()
        self.io_received = 0
        self.recount = False  # take io_received from the rank's next status reply (after an attach)
        self.pending_done: Message | None = None
        self.pending_since = 0.0
        self.state = RankState.STARTING
        self.device = ""
        self.log_path = log_path
        self.cell = ""
        self.exit = ""
        self.broken = ""  # the CUDA error that lost its CUDA context for good ("" while it works)
        # from the rank's heartbeat (sent by its I/O thread every second during a cell, else every 5 s)
        self.heartbeat = 0.0
        self.sent = 0.0  # when the kernel last sent it a cell (monotonic): it beats within a second after
        self.memory: dict[str, int] = {}
        self.step = 0
        self.last_line = ""
        self.killed_by_pool = ""  # why the pool itself killed the rank, if it did
        self.collective = ""  # the torch.distributed call its running cell was in at the last heartbeat
        self.importing = ""  # the module its main thread was importing at the last heartbeat
        self.group_ranks: list[int] = []  # that call's group; [] for the default group (every rank)
        self.waiting = ""  # the prompt its running cell waits at for an answer from the notebook
        self.node = 0  # which node it runs on (its agent's), from its ready
        self.job = ""  # the SLURM job it runs in, if any
        # its memory cgroup's oom_kill counter, to tell an OOM kill from another SIGKILL
        self.oom_file = oom.counter_file(handle.pid) if handle.host == socket.gethostname() else None
        self.oom_before = oom.read_count(self.oom_file)

    @property
    def dead(self) -> bool:
        return self.state is RankState.DEAD

    def poll_exit(self) -> bool:
        """Whether the process has just been found gone (then it is marked dead, with why)."""
        code = self.handle.poll()
        if code is None or self.dead:
            return False
        self.state, self.exit = RankState.DEAD, (self.killed_by_pool or self.handle.exit_reason(code))
        if not self.killed_by_pool and code == -signal.SIGKILL:
            by_oom = oom.explain_sigkill(self.oom_file, self.oom_before)
            self.exit = f"was killed by SIGKILL {by_oom}" if by_oom else self.exit
        return True


class RankTable:
    """Every rank of the running pool, by rank number; empty while the pool is stopped."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.records: dict[int, RankRecord] = {}
        self.dropped = 0  # signed messages whose content did not have the shape their type promises

    def __iter__(self) -> Iterator[RankRecord]:
        return iter(self.records.values())

    def __getitem__(self, rank: int) -> RankRecord:
        return self.records[rank]

    def get(self, rank: int) -> RankRecord | None:
        return self.records.get(rank)

    def add(self, record: RankRecord) -> None:
        self.records[record.rank] = record

    def clear(self) -> None:
        self.records.clear()

    def live(self) -> list[RankRecord]:
        return [r for r in self.records.values() if not r.dead and r.handle.poll() is None]

    def groupable(self) -> bool:
        """Whether the process group can be rebuilt on every rank: none is dead or broken (a rebuild
        would wait for a dead rank, and build NCCL on a lost CUDA context)."""
        return not any(r.dead or r.broken for r in self.records.values())

    def targets(self, ranks: Sequence[int] | None, cell: bool = False) -> list[RankRecord]:
        """The records of ``ranks`` (default: all); a missing or a dead rank is a :class:`PoolError`,
        and for a ``cell`` so is a broken one (a copy of its CPU values still works)."""
        chosen = sorted(set(ranks)) if ranks is not None else sorted(self.records)
        missing = [r for r in chosen if r not in self.records]
        if missing:
            raise PoolError(
                f"rank {format_ranks(missing)} does not exist: the pool has {len(self.records)} ranks"
            )
        dead = [self.records[r] for r in sorted(self.records) if self.records[r].dead]
        if dead:
            why = "; ".join(f"rank {r.rank} {r.exit or 'is dead'}" for r in dead)
            raise PoolError(
                f"{why}. Run %dist_restart (or pool.restart()) for fresh ranks; rank state is lost"
            )
        broken = [self.records[r] for r in chosen if self.records[r].broken] if cell else []
        if broken:
            raise PoolError(f"{lost_context_line(broken)} and can run no cell: {restart_advice(broken)}")
        return [self.records[r] for r in chosen]

    def starting(self) -> list[RankRecord]:
        return [r for r in self.records.values() if r.state is RankState.STARTING]

    def node_failures(self, restart_hint: str) -> list[str]:
        """One line per node whose ranks went down together (its agent or job step ended)."""
        down: dict[int, list[RankRecord]] = {}
        for r in self.records.values():
            if r.dead and r.handle.node_down:
                down.setdefault(r.node, []).append(r)
        lines = []
        for node, records in sorted(down.items()):
            where = records[0].handle.host or "its host"
            lines.append(
                f"node {node} ({where}) failed: rank {format_ranks([r.rank for r in records])} went down "
                f"with it. %dist_restart starts the pool again {restart_hint}; to go on without it, run "
                "the next cell with --hosts naming the other hosts (or fewer --nodes)"
            )
        return lines

    # -- what ranks say about themselves (dispatched by the connection) -------------------------

    def handlers(self) -> dict[str, Callable[[RankRecord, Message], None]]:
        return {
            "ready": self.on_ready,
            "heartbeat": self.on_heartbeat,
            "startup_failed": self.on_startup_failed,
            "metrics": self.on_metrics,
        }

    def on_ready(self, r: RankRecord, msg: Message) -> None:
        r.state, r.device = RankState.IDLE, str(msg.body["device"])
        r.heartbeat = time.monotonic()
        r.node = int(msg.body["node"])
        r.job = str(msg.body["job"])
        r.handle.bind(int(msg.body["pid"]), str(msg.body["host"]), r.node)

    def on_heartbeat(self, r: RankRecord, msg: Message) -> None:
        r.heartbeat = time.monotonic()
        r.memory = {str(k): int(v) for k, v in msg.body["memory"].items()}
        r.step = int(msg.body["step"])
        r.collective = str(msg.body["collective"])
        r.group_ranks = [int(k) for k in msg.body["group_ranks"]]
        r.waiting = str(msg.body.get("waiting", "")) if r.state is RankState.RUNNING else ""
        r.importing = str(msg.body.get("importing", ""))
        self.history.add_memory(r.rank, time.time(), r.memory)

    def on_startup_failed(self, r: RankRecord, msg: Message) -> None:
        r.exit = str(msg.body["traceback"])

    def on_metrics(self, r: RankRecord, msg: Message) -> None:
        names, count = [str(n) for n in msg.body["names"]], int(msg.body["count"])
        if len(msg.buffers) != 2 + len(names) or any(len(b) != 8 * count for b in msg.buffers):
            self.drop_malformed(r, "metrics")
            return
        steps, times, *values = (array("d", bytes(b)) for b in msg.buffers)
        self.history.extend_columns(r.rank, steps, times, dict(zip(names, values, strict=True)))

    def drop_malformed(self, r: RankRecord, what: str) -> None:
        """A signed message whose content does not have the shape its type promises: counted, logged."""
        self.dropped += 1
        print(f"jupyter_shard: dropped malformed {what} from rank {r.rank}", file=sys.__stderr__)

    # -- snapshots ----------------------------------------------------------------------------------

    def status(self, replies: Mapping[int, Message]) -> list[RankSnapshot]:
        """Every rank with what its ``status_reply`` said now (fresh memory, the cell and where)."""
        rows = []
        for k, r in sorted(self.records.items()):
            reply = replies.get(k)
            memory = dict(reply.body["memory"]) if reply else {}
            running = r.cell if r.state is RankState.RUNNING else ""
            cell = str(reply.body["cell"]) if reply and reply.body["executing"] else running
            collective = str(reply.body["collective"]) if reply else ""
            if collective:
                cell = f"{cell} · in {collective}"
            if r.waiting:
                cell = f"{cell} · at {r.waiting}"
            rows.append(self.snapshot(r, memory=memory, cell=cell))
        return rows

    def stacks(self, chosen: Sequence[int], replies: Mapping[int, Message], timeout: float) -> dict[int, str]:
        """Each chosen rank's stacks from its ``stacks_reply``, or why there is none."""
        out: dict[int, str] = {}
        for k in chosen:
            r = self.records[k]
            if k in replies:
                out[k] = "\n".join(f"{s['thread']}:\n{s['stack']}" for s in replies[k].body["stacks"])
            elif r.dead:
                out[k] = f"(rank {k} {r.exit})"
            else:
                out[k] = f"(no answer within {timeout:g} s: the rank may hold the GIL in native code)"
        return out

    def activity(self) -> list[RankSnapshot]:
        """Each rank from its heartbeats and logs (no request): state, step, throughput, problems."""
        now, wall = time.monotonic(), time.time()
        last_logs = {k: self.history.last(k) for k in self.records}
        newest = max((v[1] for v in last_logs.values() if v is not None), default=0.0)
        rows = []
        for k, r in sorted(self.records.items()):
            last = last_logs[k]
            # between cells a rank beats every 5 s: a cell's quiet time counts from when it was sent
            age = now - max(r.heartbeat, r.sent) if r.heartbeat else None
            problem = ""
            if r.dead:
                problem = f"dead: {r.exit or 'exited'}"
            elif r.waiting:  # a person is looking at it: not stuck, however long
                pass
            elif (
                r.state is RankState.RUNNING
                and age is not None
                and STUCK_AFTER < age < IMPORT_GRACE
                and r.importing
            ):
                pass  # a long import holds the GIL in native code: busy, not stuck (the cell says so)
            elif r.state is RankState.RUNNING and age is not None and age > STUCK_AFTER:
                problem = f"stuck: no heartbeat for {age:.0f} s (holding the GIL in native code?)"
            elif r.state is RankState.RUNNING and last is not None and newest - last[1] > STUCK_AFTER * 3:
                problem = f"stuck: no shard.log for {wall - last[1]:.0f} s while other ranks log"
            rows.append(
                self.snapshot(
                    r,
                    memory=dict(r.memory),
                    cell=_running_cell(r, age),
                    step=last[0] if last is not None else (float(r.step) if r.step else None),
                    steps_per_s=self.history.throughput(k, wall),
                    heartbeat_age=age,
                    problem=problem,
                )
            )
        return rows

    @staticmethod
    def snapshot(
        r: RankRecord,
        *,
        memory: dict[str, int],
        cell: str,
        step: float | None = None,
        steps_per_s: float | None = None,
        heartbeat_age: float | None = None,
        problem: str = "",
    ) -> RankSnapshot:
        return RankSnapshot(
            rank=r.rank,
            state=RankState.PROMPT if r.waiting and r.state is RankState.RUNNING else r.state,
            memory=memory,
            cell=cell,
            pid=r.handle.pid,
            host=r.handle.host,
            device=r.device,
            log_path=str(r.log_path),
            exit=r.exit,
            step=step,
            steps_per_s=steps_per_s,
            heartbeat_age=heartbeat_age,
            last_line=r.last_line,
            problem=problem or (broken_problem(r) if r.broken and not r.dead else ""),
        )


def broken_problem(r: RankRecord) -> str:
    """A broken rank's ``problem``, as the dashboard and the side panel show it."""
    return f"broken: CUDA context lost ({r.broken}); %dist_restart for fresh ranks"


def lost_context_line(broken: Sequence[RankRecord]) -> str:
    """``rank 1 lost its CUDA context (CUDA error: …)``: the first words of what a broken rank means."""
    names = format_ranks([r.rank for r in broken])
    whose = "its" if len(broken) == 1 else "their"
    return f"rank {names} lost {whose} CUDA context ({broken[0].broken})"


def restart_advice(broken: Sequence[RankRecord]) -> str:
    """What to do about broken ranks: only new processes help; CPU values can be copied out first."""
    rank = str(broken[0].rank) if len(broken) == 1 else "K"
    return (
        "run %dist_restart for fresh ranks (rank state is lost; values on the CPU can be copied out "
        f"first with %dist_pull NAME --rank {rank})"
    )


def _running_cell(r: RankRecord, age: float | None) -> str:
    """A running rank's cell, with the import that holds it up (``· importing torch, 12 s``)."""
    if r.state is not RankState.RUNNING:
        return ""
    if r.importing:
        quiet = f", no heartbeat for {age:.0f} s" if age is not None and age > STUCK_AFTER else ""
        return f"{r.cell} · importing {r.importing}{quiet}"
    return r.cell
