"""The kernel end of the JupyterLab extension: the ``jupyter_shard`` comm its side panel talks through.

The panel opens one comm per notebook kernel and polls it (``{"request": "status"}`` every 2 s while
visible); buttons send ``interrupt``, ``restart``, ``shutdown`` or ``stacks``. Every request gets one
reply: the pool summary (``{"reply": "status", ...}``), the stacks text, or ``{"reply": "error"}`` with
one line saying what went wrong. No HTTP endpoint: the comm is the kernel's own channel, so the panel
sees exactly the pool of the notebook it belongs to. While a cell runs, the kernel may answer only
when the cell yields (ipykernel 7 dispatches comm messages between a cell's steps) or not at all;
the panel then keeps its last status and says the kernel is busy. Restart and shutdown are refused
while ranks run a cell.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from jupyter_shard.notebook.figure import BAND_FROM, row_groups
from jupyter_shard.pool.pool import Pool
from jupyter_shard.pool.ranks import RankSnapshot, RankState
from jupyter_shard.spec import format_ranks

COMM_TARGET = "jupyter_shard"
START_EVERY = 0.5  # seconds between start statuses sent to the panel
log = logging.getLogger(__name__)


class Comm(Protocol):
    """The part of ``comm.base_comm.BaseComm`` used here (a fake in the unit tests)."""

    def send(self, data: dict[str, Any]) -> None: ...

    def on_msg(self, callback: Callable[[dict[str, Any]], None]) -> None: ...

    def on_close(self, callback: Callable[[dict[str, Any]], None]) -> None: ...

    def close(self) -> None: ...


class PoolHolder(Protocol):
    """What the panel needs from :class:`~jupyter_shard.notebook.magics.DistributedMagics`: its pool."""

    pool: Pool | None


def status_reply(pool: Pool | None) -> dict[str, Any]:
    """The status reply: the pool's description, its overall state and one row per rank."""
    if pool is None or not pool.started:
        return {"reply": "status", "pool": None, "state": "no pool", "ranks": []}
    rows = pool.activity()
    states = {row.state for row in rows}
    if RankState.PROMPT in states:  # a rank waits for the person: say so before anything else
        asking = ", ".join(str(r.rank) for r in rows if r.state is RankState.PROMPT)
        state = f"waiting for input (rank {asking})"
    elif RankState.RUNNING in states or (pool.background is not None and pool.background.running):
        state = "running"
    elif RankState.BROKEN in states and RankState.DEAD not in states:  # only a restart helps: say so
        broken = ", ".join(str(r.rank) for r in rows if r.state is RankState.BROKEN)
        state = f"broken (rank {broken}: CUDA context lost; restart)"
    elif states & {RankState.DEAD, RankState.FAILED}:
        state = "failed"
    elif RankState.INTERRUPTED in states:  # the last cell was stopped; the ranks are idle and well
        state = "interrupted"
    elif RankState.STARTING in states:  # how many are ready, and which are not yet
        state = starting_text(rows)
    else:
        state = "idle"
    return {"reply": "status", "pool": pool.spec.describe(), "state": state, "ranks": _rows(rows)}


def _rows(rows: list[RankSnapshot]) -> list[dict[str, Any]]:
    """A row per rank below ``BAND_FROM`` ranks; from there the status table's rows
    (:func:`~jupyter_shard.notebook.figure.row_groups`), each with its ranks as a range
    (``"0-4,6-1023"``) and ``count``."""
    if len(rows) < BAND_FROM:
        return [_row(row) for row in rows]
    return [_group(members) for members, _ in row_groups(rows)]


def _row(row: RankSnapshot) -> dict[str, Any]:
    return {
        "rank": row.rank,
        "state": row.state.value,
        "step": row.step,
        "memory": {"rss": row.memory.get("rss"), "cuda": row.memory.get("cuda_allocated")},
        "heartbeat_age": row.heartbeat_age,
        "cell": row.cell,
        "problem": row.problem,
    }


def _group(members: list[RankSnapshot]) -> dict[str, Any]:
    """One row for ``members``: the lowest step (the straggler), the largest memory, the oldest
    heartbeat, their cell if they share one, the first one's problem."""
    first, count = members[0], len(members)

    def largest(key: str) -> int | None:
        return max((r.memory[key] for r in members if r.memory.get(key) is not None), default=None)

    steps = [r.step for r in members if r.step is not None]
    ages = [r.heartbeat_age for r in members if r.heartbeat_age is not None]
    cells = {r.cell for r in members}
    more = f" (and {count - 1} more)" if count > 1 and first.problem else ""
    return {
        "rank": format_ranks([r.rank for r in members]),
        "count": count,
        "state": first.state.value,
        "step": min(steps) if steps else None,
        "memory": {"rss": largest("rss"), "cuda": largest("cuda_allocated")},
        "heartbeat_age": max(ages) if ages else None,
        "cell": next(iter(cells)) if len(cells) == 1 else "",
        "problem": first.problem + more,
    }


def starting_text(rows: list[RankSnapshot]) -> str:
    """``starting: 37 of 64 ranks ready`` and, when few are left, which: ``(waiting for rank 5, 9)``."""
    waiting = [r.rank for r in rows if r.state is RankState.STARTING]
    text = f"starting: {len(rows) - len(waiting)} of {len(rows)} ranks ready"
    if waiting and len(waiting) <= 8 and len(waiting) < len(rows):
        text += f" (waiting for rank {format_ranks(waiting)})"
    return text


class PanelComm:
    """Answers one frontend's requests; requests dispatch through a table, an unknown one is an error."""

    def __init__(self, comm: Comm, holder: PoolHolder) -> None:
        self.comm = comm
        self.holder = holder
        self._handlers: dict[str, Callable[[], dict[str, Any]]] = {
            "status": self._status,
            "interrupt": self._interrupt,
            "restart": self._restart,
            "shutdown": self._shutdown,
            "stacks": self._stacks,
        }
        comm.on_msg(self.on_msg)

    def on_msg(self, msg: dict[str, Any]) -> None:
        data = msg.get("content", {}).get("data", {})
        request = data.get("request") if isinstance(data, dict) else None
        handler = self._handlers.get(request) if isinstance(request, str) else None
        if handler is None:
            allowed = ", ".join(self._handlers)
            self.comm.send({"reply": "error", "error": f"unknown request {request!r}; allowed: {allowed}"})
            return
        try:
            reply = handler()
        except Exception as exc:  # the panel shows the error; the kernel carries on
            log.debug("jupyter_shard panel request %s failed", request, exc_info=True)
            reply = {"reply": "error", "request": request, "error": f"{request} failed: {exc}"}
        self.comm.send(reply)

    def _pool(self, action: str) -> Pool:
        pool = self.holder.pool
        if pool is None or not pool.started:
            raise RuntimeError(f"no pool to {action}; start one with a %%distributed cell")
        return pool

    def _status(self, message: str = "") -> dict[str, Any]:
        reply = status_reply(self.holder.pool)
        reply["message"] = message
        return reply

    def _interrupt(self) -> dict[str, Any]:
        self._pool("interrupt").interrupt()
        return self._status("interrupt sent")

    def _restart(self) -> dict[str, Any]:
        pool = self._pool("restart")
        _refuse_while_running(pool, "restart")
        pool.restart()
        return self._status(f"restarted {pool.spec.describe()}; rank state is lost")

    def _shutdown(self) -> dict[str, Any]:
        pool = self.holder.pool
        if pool is not None:
            _refuse_while_running(pool, "shut down")
            pool.shutdown()
            self.holder.pool = None
        return self._status("pool shut down")

    def _stacks(self) -> dict[str, Any]:
        stacks = self._pool("show stacks of").stacks()
        text = "\n".join(f"──── rank {rank} ────\n{stack}" for rank, stack in stacks.items())
        return {"reply": "stacks", "text": text}


class PromptNotice:
    """A pool observer that tells the open panels at once when a rank starts or stops waiting at a
    prompt: the panel's own requests go unanswered while the kernel runs the cell (it is busy), so
    the status is sent without one."""

    def __init__(self) -> None:
        self._waiting: tuple[int, ...] = ()
        self._start_said = ("", 0.0)  # the last start status sent, and when

    def starting(self, pool: Pool) -> None:
        """While the ranks start (the kernel is busy in the cell): the count of ready ranks, at most
        twice a second and only when it changed, so the panel no longer says "no pool" meanwhile."""
        if not _open:
            return
        reply = status_reply(pool)
        now = time.monotonic()
        if reply["state"] == self._start_said[0] or now - self._start_said[1] < START_EVERY:
            return
        self._start_said = (str(reply["state"]), now)
        reply["message"] = ""
        for panel in list(_open):
            panel.comm.send(reply)

    def refresh(self, pool: Pool, final: bool) -> None:
        waiting = tuple(r.rank for r in pool.ranks if r.waiting)
        if waiting == self._waiting or not _open:
            return
        self._waiting = waiting
        reply = status_reply(pool)
        reply["message"] = ""
        for panel in list(_open):
            panel.comm.send(reply)


def _refuse_while_running(pool: Pool, action: str) -> None:
    """The kernel may answer the panel between steps of a running cell: not the moment to replace ranks."""
    if any(row.state is RankState.RUNNING for row in pool.activity()):
        raise RuntimeError(f"a cell is running on the ranks; interrupt it first, then {action}")


_open: list[PanelComm] = []


def frontend_attached() -> bool:
    """Whether a JupyterLab extension opened the comm in this kernel."""
    return bool(_open)


def register_comm(shell: Any, holder: PoolHolder) -> None:
    """Accept ``jupyter_shard`` comms from the frontend; a shell without a kernel (plain IPython) has none."""
    if getattr(shell, "kernel", None) is None:
        return
    from comm import get_comm_manager

    def on_open(comm: Comm, open_msg: dict[str, Any]) -> None:
        panel = PanelComm(comm, holder)
        _open.append(panel)
        comm.on_close(lambda _msg: _open.remove(panel) if panel in _open else None)
        panel.on_msg(open_msg)

    get_comm_manager().register_target(COMM_TARGET, on_open)


def unregister_comm(shell: Any) -> None:
    """Close the open panels and stop accepting new ones (the extension is unloaded)."""
    if getattr(shell, "kernel", None) is None:
        return
    from comm import get_comm_manager

    for panel in list(_open):
        panel.comm.close()
    _open.clear()
    manager = get_comm_manager()
    if COMM_TARGET in manager.targets:
        manager.unregister_target(COMM_TARGET, manager.targets[COMM_TARGET])
