"""The kernel's link to ranks stopped at a breakpoint: what the notebook's debugger asks of them, and
what they say (``stopped``, ``continued``).

:meth:`DebugLink.request` may be called from any thread (ipykernel answers debug requests on its
control thread while the cell runs on the main one): it sends a signed ``debug_request`` and waits
for the ``debug_response``, which whichever thread receives for the pool (the running cell's, or the
watcher between cells) hands over. The notebook layer plugs in what knows the frontend's debugger
(:func:`set_notebook_debugger`): it gives each cell its :class:`~jupyter_shard.wire.messages.DebugSetup`
while that debugger is on, and takes the ranks' events; nothing here imports UI code.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Protocol

from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.ranks import RankRecord, RankTable
from jupyter_shard.wire.messages import DEBUG_REQUEST, DebugSetup
from jupyter_shard.wire.protocol import Message

__all__ = ["DebugLink", "NotebookDebugger", "set_notebook_debugger"]


class NotebookDebugger(Protocol):
    def setup(self) -> DebugSetup | None: ...

    def on_event(self, rank: int, event: dict[str, Any]) -> None: ...


_notebook: NotebookDebugger | None = None


def set_notebook_debugger(debugger: NotebookDebugger | None) -> None:
    """What knows the frontend's debugger (one per kernel process), or None."""
    global _notebook
    _notebook = debugger


class DebugLink:
    def __init__(self, conn: Connection, ranks: RankTable) -> None:
        self.conn = conn
        self.ranks = ranks
        self.stopped: set[int] = set()  # ranks stopped at a breakpoint now
        self._seq = itertools.count(1)
        self._waiting: dict[tuple[int, int], tuple[threading.Event, list[Message]]] = {}
        self._lock = threading.Lock()
        conn.handle({"debug_response": self._on_response, "debug_event": self._on_event})

    @staticmethod
    def setup() -> DebugSetup | None:
        """What the next cell needs for the notebook's debugger, if it is on."""
        return _notebook.setup() if _notebook is not None else None

    def request(
        self, rank: int, command: str, arguments: dict[str, Any], timeout: float = 10.0
    ) -> dict[str, Any]:
        """Send ``command`` to ``rank`` and return its response (``success``, ``message``, ``body``)."""
        record = self.ranks.get(rank)
        if record is None or record.dead:
            return {"success": False, "message": f"rank {rank} is not running", "body": {}}
        seq = next(self._seq)
        done, box = threading.Event(), list[Message]()
        with self._lock:
            self._waiting[(rank, seq)] = (done, box)
        try:
            self.conn.send([record], *DEBUG_REQUEST({"seq": seq, "command": command, "arguments": arguments}))
            deadline = time.monotonic() + timeout
            while not done.wait(0.05):
                if time.monotonic() > deadline:
                    return {"success": False, "message": f"rank {rank} did not answer {command}", "body": {}}
        finally:
            with self._lock:
                self._waiting.pop((rank, seq), None)
        body = box[0].body
        return {"success": bool(body["success"]), "message": str(body["message"]), "body": dict(body["body"])}

    def _on_response(self, r: RankRecord, msg: Message) -> None:
        with self._lock:
            waiter = self._waiting.get((r.rank, int(msg.body["seq"])))
        if waiter is not None:
            waiter[1].append(msg)
            waiter[0].set()

    def _on_event(self, r: RankRecord, msg: Message) -> None:
        event = {"event": str(msg.body["event"]), "body": dict(msg.body["body"])}
        if event["event"] == "stopped":
            self.stopped.add(r.rank)
        elif event["event"] == "continued":
            self.stopped.discard(r.rank)
        if _notebook is not None:
            _notebook.on_event(r.rank, event)
