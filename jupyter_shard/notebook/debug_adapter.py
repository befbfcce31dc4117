"""JupyterLab's visual debugger on the ranks: the kernel's debugger (ipykernel with debugpy) keeps
debugging the kernel's own cells, and requests that concern a rank go to that rank.

With the debugger on, every ``%%distributed`` cell is compiled on the ranks under the file name the
kernel's debugger gives the whole cell (the ``%%distributed`` line stays line 1), so a breakpoint set
in the cell's gutter is one on the ranks too (:class:`~jupyter_shard.wire.messages.DebugSetup`). A rank
that reaches it sends ``stopped``; the frontend sees a thread per rank (``rank 1 · MainThread``) and
a call stack of every stopped rank's frames, each named by its rank (``rank 1 · step``); scopes,
variables and evaluate read the frame's rank; ``next`` and the steps act on the selected rank, and
``continue`` lets every stopped rank go on.

The ranks' ids (thread, frame, variable reference) are their own; here each becomes
``RANK_IDS * (rank + 1) + id``, far above the ids debugpy gives the kernel's own, and back.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from jupyter_shard.pool import debugging
from jupyter_shard.pool.pool import Pool
from jupyter_shard.wire.messages import DebugSetup

__all__ = ["RankDebugRouter", "from_global", "to_global"]

RANK_IDS = 1 << 40
_BY_THREAD = ("continue", "next", "stepIn", "stepOut", "stackTrace")
_BY_FRAME = ("scopes", "evaluate", "richInspectVariables")


def to_global(rank: int, local: int) -> int:
    return RANK_IDS * (rank + 1) + local


def from_global(number: Any) -> tuple[int, int] | None:
    """``(rank, its id)`` for an id that names a rank's thread, frame or variable, else None."""
    if not isinstance(number, int) or number < RANK_IDS:
        return None
    return number // RANK_IDS - 1, number % RANK_IDS


class PoolHolder(Protocol):
    pool: Pool | None


class RankDebugRouter:
    """Wraps the kernel debugger's ``process_request``; installed with the extension."""

    def __init__(self, kernel: Any, holder: PoolHolder) -> None:
        self.kernel = kernel
        self.debugger = kernel.debugger
        self.holder = holder
        self._original = self.debugger.process_request

    def install(self) -> None:
        self.debugger.process_request = self.process_request
        debugging.set_notebook_debugger(self)

    def uninstall(self) -> None:
        self.debugger.process_request = self._original
        debugging.set_notebook_debugger(None)

    # -- what the ranks get with each cell, and what they say -----------------------------------------

    def setup(self) -> DebugSetup | None:
        """The running cell's file name and every breakpoint, while the frontend's debugger is on."""
        if not self.debugger.is_started:
            return None
        from ipykernel.compiler import get_file_name

        code = str(self.kernel.get_parent("shell").get("content", {}).get("code", ""))
        breakpoints = {
            path: [int(b["line"]) for b in points] for path, points in self.debugger.breakpoint_list.items()
        }
        filename: str = get_file_name(code)  # type: ignore[no-untyped-call]
        return {"filename": filename, "breakpoints": breakpoints}

    def on_event(self, rank: int, event: dict[str, Any]) -> None:
        body = dict(event["body"])
        if "threadId" in body:
            body["threadId"] = to_global(rank, int(body["threadId"]))
        if event["event"] == "stopped":
            self.debugger.stopped_threads.add(body["threadId"])
        elif event["event"] == "continued":
            self.debugger.stopped_threads.discard(body["threadId"])
        self.debugger.event_callback({"type": "event", "seq": 0, "event": event["event"], "body": body})

    # -- requests from the frontend -----------------------------------------------------------------

    async def process_request(self, message: dict[str, Any]) -> dict[str, Any]:
        pool = self.holder.pool
        link = pool.debugger if pool is not None and pool.started else None
        command, args = message.get("command"), dict(message.get("arguments") or {})
        if link is None:
            return dict(await self._original(message))
        if command == "threads":
            reply = dict(await self._original(message))
            threads = [
                {"id": to_global(k, 1), "name": f"rank {k} · MainThread"} for k in sorted(link.stopped)
            ]
            reply.setdefault("body", {}).setdefault("threads", []).extend(threads)
            return reply
        if command == "continue" and link.stopped and self._not_stopped_here(args.get("threadId")):
            # JupyterLab forgets the stopped thread before it asks to continue, then names thread 1
            # (the kernel's main thread, which runs the cell and is not stopped): the ranks go on.
            message = {**message, "arguments": {**args, "threadId": to_global(min(link.stopped), 1)}}
            args = message["arguments"]
        key = "threadId" if command in _BY_THREAD else "frameId" if command in _BY_FRAME else ""
        key = "variablesReference" if command == "variables" else key
        target = from_global(args.get(key)) if key else None
        if target is None:
            return dict(await self._original(message))
        rank, local = target
        if command == "continue":  # every stopped rank goes on, as "continue" on the kernel does
            for k in sorted(link.stopped):
                await self._ask(link, message, k, "continue", {"threadId": 1})
            return _response(message, True, "", {"allThreadsContinued": True})
        if command == "stackTrace":
            return await self._stack(link, message)
        return await self._ask(link, message, rank, str(command), {**args, key: local})

    def _not_stopped_here(self, thread: Any) -> bool:
        """A thread of the kernel's own that its debugger does not have stopped."""
        return from_global(thread) is None and thread not in self.debugger.stopped_threads

    async def _ask(
        self,
        link: debugging.DebugLink,
        message: dict[str, Any],
        rank: int,
        command: str,
        args: dict[str, Any],
    ) -> dict[str, Any]:
        answer = await asyncio.to_thread(link.request, rank, command, args)
        return _response(message, answer["success"], answer["message"], _mapped(rank, answer["body"]))

    async def _stack(self, link: debugging.DebugLink, message: dict[str, Any]) -> dict[str, Any]:
        """Every stopped rank's frames, in rank order, each named by its rank."""
        frames: list[dict[str, Any]] = []
        for k in sorted(link.stopped):
            answer = await asyncio.to_thread(link.request, k, "stackTrace", {"threadId": 1})
            for frame in _mapped(k, answer["body"]).get("stackFrames", []):
                frames.append({**frame, "name": f"rank {k} · {frame['name']}"})
        return _response(message, True, "", {"stackFrames": frames, "totalFrames": len(frames)})


def _mapped(rank: int, body: dict[str, Any]) -> dict[str, Any]:
    """A rank's response body with its ids made global."""
    out = dict(body)
    if "stackFrames" in out:
        out["stackFrames"] = [{**f, "id": to_global(rank, int(f["id"]))} for f in out["stackFrames"]]
    for key in ("scopes", "variables"):
        if key in out:
            out[key] = [_global_ref(rank, item) for item in out[key]]
    if out.get("variablesReference"):
        out["variablesReference"] = to_global(rank, int(out["variablesReference"]))
    return out


def _global_ref(rank: int, item: dict[str, Any]) -> dict[str, Any]:
    ref = int(item.get("variablesReference", 0))
    return {**item, "variablesReference": to_global(rank, ref) if ref else 0}


def _response(message: dict[str, Any], success: bool, error: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = {
        "type": "response",
        "request_seq": message.get("seq"),
        "success": success,
        "command": message.get("command"),
        "body": body,
    }
    if error:
        reply["message"] = error
    return reply
