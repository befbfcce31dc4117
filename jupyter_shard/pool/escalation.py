"""Stopping ranks that will not stop by themselves: interrupt, release, regroup, kill.

A rank running Python stops on SIGINT. A rank blocked in a gloo collective sees no signal; for it the
ranks that are idle close their process group (a *release*), so the collective fails at once and
every rank keeps its state; the group is rebuilt (a *regroup*) before the next cell. On an NCCL pool
(CUDA ranks) closing a peer's group frees nobody: there the blocked ranks are also asked to *abort*
their own group from their I/O thread (their main thread is stuck in an NCCL wait or a CUDA sync),
at the same moment as the release; a rank that let SIGINT pass for the grace period counts as
blocked, since its heartbeat cannot name a CUDA sync. A rank that does none of this within the
grace periods has its stack taken and is killed; then the next cell restarts the pool. Every step is
said to the user as it happens. What happened is returned as :class:`Stopped` for the cell's result
(:mod:`.cell` writes it down).
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.ranks import RankState, RankTable
from jupyter_shard.spec import format_ranks
from jupyter_shard.wire.messages import (
    ABORT,
    GROUP_DESTROYED,
    GROUP_UNKNOWN,
    REGROUP,
    RELEASE,
    SIGNAL,
    RegroupBody,
    ReleaseBody,
)

__all__ = ["INTERRUPT_GRACE", "Escalation", "Stopped"]

INTERRUPT_GRACE = 2.0
_NCCL_ERRORS = {  # torch's ErrorType names, as a notice says them
    "TIMEOUT": "TIMEOUT: a collective timed out",
    "COMM_ERROR": "COMM_ERROR: a communication error",
    "REMOTE_ERROR": "REMOTE_ERROR: an error on a peer rank",
}

AwaitStopped = Callable[[list[int], float, Callable[[list[int]], bool]], list[int]]


@dataclass
class Stopped:
    """How stopping a cell's ranks went."""

    blocked: dict[int, str] = field(default_factory=dict)  # rank -> the collective it waited in
    # ranks that closed their group to release others (on NCCL, also the blocked ranks that aborted theirs)
    released: list[int] = field(default_factory=list)
    released_from: list[int] = field(default_factory=list)  # blocked ranks that came free that way
    killed: dict[int, str] = field(default_factory=dict)  # rank -> its stack before the kill
    waited: float = 0.0
    kill_note: str = ""


class Escalation:
    """Interrupts, releases, regroups and kills; remembers what the next cell must do first."""

    def __init__(
        self,
        conn: Connection,
        ranks: RankTable,
        notice: Callable[[str], None],
        stacks: Callable[[list[int]], dict[int, str]],
    ) -> None:
        self.conn = conn
        self.ranks = ranks
        self.notice = notice
        self.stacks = stacks
        self.regroup_needed = False  # ranks closed their process group to release a blocked rank
        # rank -> why its cell ended without a usable group (done's ``ungrouped``): destroyed by the
        # cell, found broken by NCCL, or of unknown health after a failed collective
        self.closed_by_cell: dict[int, str] = {}
        self.aborted: set[int] = set()  # ranks asked to abort their group (NCCL release) since a regroup
        self.restart_reason: str | None = None  # set once a rank was killed: the next cell restarts
        self._groups = 0  # process groups built after the first, each on its own store

    def reset(self) -> None:
        self.regroup_needed, self.restart_reason = False, None
        self.closed_by_cell, self.aborted = {}, set()

    def group_closed(self, rank: int, why: str = "") -> None:
        """A cell ended on ``rank`` without a usable process group, ``why`` as its done said (""
        reads as destroyed): the next cell gets a new one."""
        self.closed_by_cell[rank] = why or GROUP_DESTROYED
        self.regroup_needed = True

    def say_group_closed(self) -> None:
        """Once, as the cell that closed the group ends: why, by cause (a group this pool aborted to
        free a blocked rank was said when it was)."""
        causes = self._causes()
        if causes and self.restart_reason is None:
            lines = [_closed_line(why, format_ranks(ranks)) for why, ranks in causes.items()]
            self.notice(f"{'; '.join(lines)}; the next cell gets a new one")

    def _causes(self) -> dict[str, list[int]]:
        """Why groups were lost, first the cell's own destroy_process_group: cause -> its ranks."""
        causes: dict[str, list[int]] = {}
        for rank, why in sorted(self.closed_by_cell.items()):
            if not (why == GROUP_DESTROYED and rank in self.aborted):
                causes.setdefault(why, []).append(rank)
        return dict(sorted(causes.items(), key=lambda c: c[0] != GROUP_DESTROYED))

    def deliver_signal(self, rank: int, sig: int) -> None:
        """Ask a rank started by an agent to signal itself (its I/O thread does, even mid-cell)."""
        r = self.ranks.get(rank)
        if r is not None and self.conn.open:
            self.conn.send([r], *SIGNAL({"signal": int(sig)}))

    def interrupt(self) -> list[int]:
        """SIGINT to every rank that runs a cell (outside a foreground run); the ranks signalled."""
        running = [r for r in self.ranks.live() if r.state is RankState.RUNNING]
        for r in running:
            r.handle.send_signal(signal.SIGINT)
        return [r.rank for r in running]

    def stop(self, pending: list[int], why: str, await_stopped: AwaitStopped) -> Stopped:
        """Escalate until the pending ranks stop, saying each step.

        1. SIGINT to the ranks running Python; for ranks blocked in a collective, a release by the
           idle ranks.
        2. When only blocked ranks are left, or after ``INTERRUPT_GRACE``: a release by the ranks
           that became idle meanwhile, and SIGINT to whatever else still runs.
        3. After another ``INTERRUPT_GRACE``: the stacks of what still runs, then a kill.
        """
        ranks = sorted(pending)
        blocked = {k: self.ranks[k].collective for k in ranks if self.ranks[k].collective}
        running = [k for k in ranks if k not in blocked]
        if running:
            self.notice(f"rank {format_ranks(running)} {why}: sending SIGINT")
        else:
            self.notice(f"rank {format_ranks(ranks)} {why}")
        for k in running:
            self.ranks[k].handle.send_signal(signal.SIGINT)
        released = self._release(blocked, ranks, [])

        def only_blocked_left(still: list[int]) -> bool:  # and someone idle could release them
            # heartbeats since the stop began may name a collective (a peer's death often comes
            # within a second of the cell's start, before any heartbeat said where a rank waits)
            blocked.update({k: self.ranks[k].collective for k in still if self.ranks[k].collective})
            idle = any(r.rank not in still and r.rank not in released for r in self.ranks.live())
            return idle and all(k in blocked for k in still)

        still = await_stopped(ranks, INTERRUPT_GRACE, only_blocked_left)
        suspects: dict[int, str] = {}
        if still:
            # A heartbeat may have named the collective since; and a rank that let SIGINT pass for
            # INTERRUPT_GRACE is likely blocked in one anyway: a release costs only a regroup.
            blocked.update({k: self.ranks[k].collective for k in still if self.ranks[k].collective})
            suspects = {k: blocked.get(k, "") for k in still}
            fresh = self._release(suspects, still, released)
            released += fresh
            others = [k for k in still if not (k in blocked and fresh)]
            if others:
                self.notice(f"rank {format_ranks(others)} still running: sending SIGINT")
                for k in others:
                    self.ranks[k].handle.send_signal(signal.SIGINT)
            # A rank freed in this round may be what another one waits for (3 or more ranks): ranks
            # that become idle meanwhile release the rest, until INTERRUPT_GRACE is up.
            deadline = time.monotonic() + INTERRUPT_GRACE

            def newly_idle(running: list[int]) -> bool:  # not asked to release yet
                return any(r.rank not in running and r.rank not in released for r in self.ranks.live())

            while still:
                still = await_stopped(still, max(0.0, deadline - time.monotonic()), newly_idle)
                if not still or time.monotonic() >= deadline:
                    break
                suspects.update({k: blocked.get(k, "") for k in still})
                released += self._release(suspects, still, released)
        waited = 2 * INTERRUPT_GRACE
        stopped = Stopped(blocked=blocked, released=released, waited=waited)
        if released:
            stopped.released_from = [k for k in sorted(set(blocked) | set(suspects)) if k not in still]
        if still:
            self._kill(still, stopped)
        return stopped

    def _kill(self, stuck: list[int], stopped: Stopped) -> None:
        stacks = self.stacks(stuck)
        for k in stuck:
            r = self.ranks[k]
            r.killed_by_pool = (
                f"was killed by jupyter_shard: still running {stopped.waited:g} s after it was asked to stop"
            )
            r.handle.kill_tree()
            stopped.killed[k] = stacks[k]
        stopped.kill_note = (
            f"killed rank {format_ranks(stuck)} (still running {stopped.waited:g} s after it was asked to "
            "stop); the next cell restarts the pool: rank state is lost"
        )
        self.notice(stopped.kill_note)
        self.restart_reason = f"rank {format_ranks(stuck)} was killed"

    def _release(self, blocked: dict[int, str], running: list[int], released: list[int]) -> list[int]:
        """Ask the idle ranks not asked before to close their process group (and, on an NCCL pool,
        the blocked ranks to abort theirs); the ranks asked."""
        waiting = [k for k in running if k in blocked]
        aborted = self._abort([k for k in waiting if k not in released], blocked)
        idle = [r for r in self.ranks.live() if r.rank not in running and r.rank not in released]
        if not idle or not waiting:
            return aborted
        names = format_ranks([r.rank for r in idle])
        calls = ", ".join(sorted({blocked[k] or "a collective or native code" for k in waiting}))
        self.notice(
            f"rank {format_ranks(waiting)} is blocked in {calls}: closing the process group on "
            f"rank {names} to release it"
        )
        live = self.ranks.live()
        body: ReleaseBody = {
            "peers": [r.handle.pid for r in live],
            "peer_hosts": [r.handle.host for r in live],
        }
        replies = self.conn.request(*RELEASE(body), idle, timeout=INTERRUPT_GRACE)
        for r in idle:
            reply = replies.get(r.rank)
            if reply is None:
                # Its main thread is stuck; a rebuild of the group would wait for it until the
                # collective timeout, so the next cell starts fresh ranks instead.
                self.restart_reason = (
                    self.restart_reason or f"rank {r.rank} could not close its process group"
                )
                self.notice(
                    f"rank {r.rank} did not confirm closing its process group within {INTERRUPT_GRACE:g} s;"
                    " the next cell restarts the pool: rank state is lost"
                )
            elif not reply.body["ok"]:
                self.notice(f"rank {r.rank} could not close its process group: {reply.body['error']}")
        self.regroup_needed = True
        return aborted + [r.rank for r in idle]

    def _abort(self, waiting: list[int], blocked: dict[int, str]) -> list[int]:
        """On an NCCL pool, ask the ``waiting`` ranks to abort their process group from their I/O
        thread (nothing else frees a rank stuck in an NCCL wait or a CUDA sync); the ranks asked."""
        targets = [r for r in self.ranks.live() if r.rank in waiting]
        if not targets or not any(r.device.startswith("cuda") for r in self.ranks.live()):
            return []
        calls = ", ".join(sorted({blocked.get(r.rank) or "a collective or a CUDA sync" for r in targets}))
        names = format_ranks([r.rank for r in targets])
        self.notice(f"rank {names} is blocked in {calls} on NCCL: aborting its process group to free it")
        self.conn.send(targets, *ABORT({}))
        self.aborted.update(r.rank for r in targets)
        self.regroup_needed = True
        return [r.rank for r in targets]

    def regroup(self, pool_dir: Path, on_agent_store: bool, world_size: int, timeout: float) -> bool:
        """A new default process group on every rank, after ranks closed theirs in a release.

        False when it could not be built (a rank died or failed): then the pool must restart.
        """
        self.regroup_needed = False
        causes = self._causes()
        self.closed_by_cell, self.aborted = {}, set()
        self._groups += 1
        live = self.ranks.live()
        # A local pool meets on a fresh FileStore; ranks started by agents on a prefix of their store.
        # The name is this kernel's own: a kept pool's earlier kernel rebuilt groups on store-1, 2...
        # too, and a store holding their keys makes the new rendezvous wait for peers long gone.
        name = f"{self._groups}-{secrets.token_hex(4)}"
        where: RegroupBody = (
            {"prefix": f"jupyter_shard/group-{name}/"}
            if on_agent_store
            else {"store": str(pool_dir / f"store-{name}")}
        )
        replies = self.conn.request(*REGROUP(where), live, timeout=timeout)
        errors = [
            f"rank {r.rank}: {replies[r.rank].body['error'] if r.rank in replies else 'no answer'}"
            for r in live
            if r.rank not in replies or not replies[r.rank].body["ok"]
        ]
        if errors or len(live) < world_size:
            why = "; ".join(errors) or "a rank died"
            self.notice(
                f"could not rebuild the process group ({why}); restarting the pool, rank state is lost"
            )
            return False
        took = max(float(m.body["seconds"]) for m in replies.values())
        after = _rebuilt_after(next(iter(causes), ""))
        note = f"rebuilt the process group after {after} in {took * 1000:.0f} ms; rank state is kept"
        if any(m.body["prepared"] for m in replies.values()):
            note += (
                ". The model prepared with shard.prepare still holds the old group: run the cells that"
                " build and prepare it again, or %dist_restart"
            )
        self.notice(note)
        return True


def _closed_line(why: str, ranks: str) -> str:
    """What happened to the process group of ``ranks``, by the ``why`` of their done."""
    if why == GROUP_DESTROYED:
        return f"the cell closed the process group on rank {ranks} (destroy_process_group)"
    if why == GROUP_UNKNOWN:
        return (
            f"a collective failed on rank {ranks}, where NCCL's error record cannot be read, so its "
            "process group is not trusted"
        )
    return f"NCCL found the process group broken on rank {ranks} ({_NCCL_ERRORS.get(why, why)})"


def _rebuilt_after(why: str) -> str:
    """``rebuilt the process group after …``: the first cause, or a release's."""
    if why == GROUP_DESTROYED:
        return "destroy_process_group"
    if why == GROUP_UNKNOWN:
        return "a failed collective"
    return f"NCCL found it broken ({why})" if why else "the desync"
