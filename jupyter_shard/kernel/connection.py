"""The kernel's side of the wire: send to ranks, receive their messages and dispatch them.

:class:`Receiver` holds what the kernel knows about each rank (:class:`RankRecord`) and turns
incoming messages into updates of that record, of the running cell's :class:`RunResult`, of the
output sink and of the metrics history, through one table of handlers by message type. A message
from an unknown peer, with a bad signature or replayed is dropped and counted, never fatal.
:class:`~jupyter_shard.kernel.pool.Pool` builds the lifecycle and the cell loop on top of it.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from jupyter_shard.kernel import oom
from jupyter_shard.kernel.history import History
from jupyter_shard.kernel.output import RankSink, visible_text
from jupyter_shard.kernel.results import PoolError, RankState, RunResult
from jupyter_shard.launchers import RankHandle
from jupyter_shard.protocol import (
    TEXT_ERRORS,
    Message,
    ProtocolError,
    Wire,
    io_identity,
    parse_identity,
    rank_identity,
)

CAPTURE_LIMIT = 4 * 1024 * 1024


def _last_visible_line(text: str, look_back: int = 64) -> str:
    """The last non-blank line a terminal would show, looking only at the end of ``text``."""
    for line in reversed(text.rsplit("\n", look_back)[-look_back:]):
        shown = visible_text(line.removesuffix("\r"))
        if shown.strip():
            return shown
    return ""


class RankRecord:
    """The kernel's record of one rank process."""

    def __init__(self, handle: RankHandle, log_path: Path) -> None:
        self.handle = handle
        self.rank = handle.rank
        self.identity = rank_identity(handle.rank).encode()
        self.io_identity = io_identity(handle.rank).encode()
        self.io_received = 0
        self.pending_done: Message | None = None
        self.pending_since = 0.0
        self.state = RankState.STARTING
        self.device = ""
        self.log_path = log_path
        self.cell = ""
        self.exit = ""
        # from the rank's heartbeat (every second, sent by its I/O thread)
        self.heartbeat = 0.0
        self.memory: dict[str, int] = {}
        self.step = 0
        self.last_line = ""
        self.killed_by_pool = ""  # why the pool itself killed the rank, if it did
        self.collective = ""  # the torch.distributed call its running cell was in at the last heartbeat
        self.node = 0  # which node it runs on (its agent's), from its ready
        self.job = ""  # the SLURM job it runs in, if any
        # its memory cgroup's oom_kill counter, to tell an OOM kill from another SIGKILL
        self.oom_file = oom.counter_file(handle.pid) if handle.host == socket.gethostname() else None
        self.oom_before = oom.read_count(self.oom_file)


class Receiver:
    """Sending to ranks and dispatching what they send; the pool's state that messages update."""

    sink: RankSink
    history: History
    on_notice: Callable[[str], None] | None

    def __init__(self, sink: RankSink) -> None:
        self.sink = sink
        self.history = History()
        self.on_notice = None
        self.dropped = 0  # frames rejected on the pool socket (unknown peer, bad signature, replay)
        self._ranks: dict[int, RankRecord] = {}
        self._sock: zmq.Socket[bytes] | None = None
        self._wire: Wire | None = None
        self._replies: dict[str, dict[int, Message]] = {}
        self._run: RunResult | None = None
        self._io_lock = threading.RLock()  # the socket is shared by run() and e.g. stacks()

    def _check_exit(self, r: RankRecord, result: RunResult | None) -> bool:
        code = r.handle.poll()
        if code is None or r.state is RankState.DEAD:
            return False
        self._pump(0.05)
        r.state, r.exit = RankState.DEAD, (r.killed_by_pool or r.handle.exit_reason(code))
        if not r.killed_by_pool and code == -signal.SIGKILL:
            by_oom = oom.explain_sigkill(r.oom_file, r.oom_before)
            r.exit = f"was killed by SIGKILL {by_oom}" if by_oom else r.exit
        if result is not None and r.rank in result.ranks and result.ranks[r.rank].status == "pending":
            failure = result.ranks[r.rank]
            failure.status, failure.evalue, failure.failed_at = (
                "dead",
                f"rank {r.rank} {r.exit}",
                time.monotonic(),
            )
            failure.traceback = [f"rank {r.rank} {r.exit} while running the cell; its log: {r.log_path}"]
            return True
        return False

    def _live(self) -> list[RankRecord]:
        return [r for r in self._ranks.values() if r.state is not RankState.DEAD and r.handle.poll() is None]

    def _send(
        self,
        targets: Sequence[RankRecord],
        msg_type: str,
        body: dict[str, Any],
        buffers: Sequence[bytes] = (),
    ) -> None:
        """Sign once, send to every target: each rank checks ``seq`` against its own history."""
        assert self._sock is not None and self._wire is not None
        frames = self._wire.to_socket(msg_type, body, buffers)
        io = msg_type in _IO_REQUESTS
        with self._io_lock:
            for r in targets:
                try:
                    self._sock.send_multipart([r.io_identity if io else r.identity, *frames])
                except zmq.ZMQError as exc:
                    raise PoolError(f"rank {r.rank} is not connected ({exc}); run %dist_restart") from None

    def _request(
        self,
        msg_type: str,
        body: dict[str, Any],
        targets: list[RankRecord],
        *,
        buffers: Sequence[bytes] = (),
        timeout: float,
    ) -> dict[int, Message]:
        req_id = uuid.uuid4().hex
        self._replies[req_id] = {}
        try:
            self._send(targets, msg_type, {**body, "req_id": req_id}, buffers)
            deadline = time.monotonic() + timeout
            while len(self._replies[req_id]) < len(targets) and time.monotonic() < deadline:
                self._pump(0.02)
                if any(self._check_exit(r, None) or r.state is RankState.DEAD for r in targets):
                    break
            return self._replies[req_id]
        finally:
            del self._replies[req_id]

    def _pump(self, timeout: float) -> None:
        """Receive and dispatch every waiting message; wait up to ``timeout`` for the first."""
        sock, wire = self._sock, self._wire
        if sock is None or wire is None:
            return
        wait_ms = int(timeout * 1000)
        with self._io_lock:
            while sock.poll(wait_ms, zmq.POLLIN):
                wait_ms = 0
                self._dispatch(wire, sock.recv_multipart(copy=True))

    def _dispatch(self, wire: Wire, frames: list[bytes]) -> None:
        rank, is_io = parse_identity(frames[0])
        r = self._ranks.get(rank)
        try:
            if r is None:
                raise ProtocolError(f"message from an unknown peer {frames[0][:40]!r}")
            msg = wire.from_socket(frames[1:], expect_sender=frames[0].decode())
        except ProtocolError as exc:
            self.dropped += 1
            print(f"jupyter_shard: dropped a message on the pool socket: {exc}", file=sys.__stderr__)
            return
        r.handle.heard()
        handler = _HANDLERS.get(msg.type)
        if handler is not None:
            handler(self, r, msg)
        if is_io:
            r.io_received += 1
            if r.pending_done is not None and r.io_received >= r.pending_done.body["io_count"]:
                self._finish(r, r.pending_done)

    def _drop_malformed(self, r: RankRecord, what: str) -> None:
        """A signed message whose content does not have the shape its type promises: counted, logged."""
        self.dropped += 1
        print(f"jupyter_shard: dropped malformed {what} from rank {r.rank}", file=sys.__stderr__)

    def _notice(self, text: str) -> None:
        if self.on_notice is not None:
            self.on_notice(text)
        else:
            self.sink.notice(f"jupyter_shard: {text}")

    # -- message handlers (dispatched through _HANDLERS) -----------------------------------------

    def _on_ready(self, r: RankRecord, msg: Message) -> None:
        r.state, r.device = RankState.IDLE, str(msg.body["device"])
        r.heartbeat = time.monotonic()
        r.handle.bind(int(msg.body["pid"]), str(msg.body["host"]), int(msg.body.get("node", 0)))
        r.node = int(msg.body.get("node", 0))
        r.job = str(msg.body.get("job", ""))

    def _on_heartbeat(self, r: RankRecord, msg: Message) -> None:
        r.heartbeat = time.monotonic()
        r.memory = {str(k): int(v) for k, v in msg.body["memory"].items()}
        r.step = int(msg.body["step"])
        r.collective = str(msg.body.get("collective", ""))
        self.history.add_memory(r.rank, time.time(), r.memory)

    def _on_startup_failed(self, r: RankRecord, msg: Message) -> None:
        r.exit = str(msg.body["traceback"])

    def _on_stream(self, r: RankRecord, msg: Message) -> None:
        name = str(msg.body["name"])
        try:
            (data,) = msg.buffers
            text = data.decode("utf-8", TEXT_ERRORS)
        except ValueError:  # not one buffer, or not UTF-8
            self._drop_malformed(r, "output")
            return
        self.sink.stream(r.rank, name, text)
        last = _last_visible_line(text)
        if last:
            r.last_line = last[:200]
        if self._run is not None and r.rank in self._run.ranks:
            res = self._run.ranks[r.rank]
            if name == "stderr" and len(res.stderr) < CAPTURE_LIMIT:
                res.stderr += text
            elif name == "stdout" and len(res.stdout) < CAPTURE_LIMIT:
                res.stdout += text

    def _on_display(self, r: RankRecord, msg: Message) -> None:
        self.sink.display(r.rank, dict(msg.body["data"]), dict(msg.body["metadata"]))

    def _on_result(self, r: RankRecord, msg: Message) -> None:
        if self._run is not None and r.rank in self._run.ranks:
            self._run.ranks[r.rank].result = dict(msg.body["data"])

    def _on_done(self, r: RankRecord, msg: Message) -> None:
        if r.io_received < int(msg.body["io_count"]):
            r.pending_done = msg  # its output is still in flight on the I/O socket
            r.pending_since = time.monotonic()
            return
        self._finish(r, msg)

    def _finish(self, r: RankRecord, msg: Message) -> None:
        r.pending_done = None
        body = msg.body
        ok = body["status"] == "ok"
        r.state, r.cell = (RankState.IDLE if ok else RankState.FAILED), ""
        if self._run is None or body["cell_id"] != self._run.cell_id or r.rank not in self._run.ranks:
            return
        res = self._run.ranks[r.rank]
        res.duration = float(body["duration"])
        if ok:
            res.status = "ok"
            return
        res.status = "interrupted" if body["ename"] == "KeyboardInterrupt" else "error"
        res.ename, res.evalue = str(body["ename"]), str(body["evalue"])
        res.traceback = [str(line) for line in body["traceback"]]
        res.failed_at = time.monotonic()

    def _on_metrics(self, r: RankRecord, msg: Message) -> None:
        names, count = [str(n) for n in msg.body["names"]], int(msg.body["count"])
        if len(msg.buffers) != 2 + len(names) or any(len(b) != 8 * count for b in msg.buffers):
            self._drop_malformed(r, "metrics")
            return
        steps, times, *values = (array("d", bytes(b)) for b in msg.buffers)
        self.history.extend_columns(r.rank, steps, times, dict(zip(names, values, strict=True)))

    def _on_reply(self, r: RankRecord, msg: Message) -> None:
        bucket = self._replies.get(str(msg.body.get("req_id")))
        if bucket is not None:
            bucket[r.rank] = msg


_IO_REQUESTS = frozenset({"stacks", "status", "signal"})

_HANDLERS: dict[str, Callable[[Receiver, RankRecord, Message], None]] = {
    "ready": Receiver._on_ready,
    "heartbeat": Receiver._on_heartbeat,
    "startup_failed": Receiver._on_startup_failed,
    "stream": Receiver._on_stream,
    "display": Receiver._on_display,
    "result": Receiver._on_result,
    "done": Receiver._on_done,
    "metrics": Receiver._on_metrics,
    "push_reply": Receiver._on_reply,
    "pull_reply": Receiver._on_reply,
    "stacks_reply": Receiver._on_reply,
    "status_reply": Receiver._on_reply,
    "release_reply": Receiver._on_reply,
    "regroup_reply": Receiver._on_reply,
}
