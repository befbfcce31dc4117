"""Simulated ranks: many in one process, speaking the wire protocol as real ranks do, without torch.

They exist so that the kernel's side (the pool, the output summary, the dashboard, the status and
the panel) can be tested and measured at 128 to 1,024 ranks on a machine that holds only a few real
ones (a real CPU rank is about 110 MiB). ``python -m jupyter_shard.rank.simulated PLAN`` serves the
ranks its plan names (``--launcher simulated`` starts one such process per 128 ranks): each has its
two sockets to the kernel (``rank-k`` and ``rank-k.io``), says ``ready``, sends a heartbeat every
second, and runs each cell it is sent as plain Python in a namespace of its own, on a thread of its
own (so ranks that sleep, sleep together), with a ``shard`` that knows its ``rank`` and
``world_size`` and whose ``log(**scalars)`` feeds the dashboard. What it prints goes to the kernel
as a real rank's output does (sent every 50 ms, and before the cell's ``done``), and to its log file;
an interrupt raises ``KeyboardInterrupt`` in every cell running.

What they do not do: collectives (there is no process group), IPython syntax (magics, ``!cmd``),
output other than ``print`` (``sys.stdout`` is the process's), pushes and pulls (refused in one
line), debugging, and ``--keep``. The process's main thread alone touches the sockets. What one
rank's process undergoes, its 127 neighbours do too: a SIGINT meant for one interrupts every cell
the process runs, a kill ends them all, and cells that keep the CPU busy slow the heartbeats and
output of all of them.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from array import array
from collections.abc import Callable, Mapping
from pathlib import Path
from types import CodeType
from typing import Any, TextIO

import zmq

from jupyter_shard.env import RankEnv, pop_secrets
from jupyter_shard.wire.messages import (
    DEBUG_RESPONSE,
    DONE,
    HEARTBEAT,
    HISTORY_REPLY,
    METRICS,
    PULL_REPLY,
    PUSH_REPLY,
    READY,
    REGROUP_REPLY,
    RELEASE_REPLY,
    STACKS_REPLY,
    STATUS_REPLY,
    STREAM,
    DebugResponseBody,
    DoneBody,
    HeartbeatBody,
    MetricsBody,
    Outgoing,
    ReadyBody,
    RegroupReply,
    StatusReply,
    StreamBody,
)
from jupyter_shard.wire.protocol import (
    KERNEL,
    TEXT_ERRORS,
    Message,
    ProtocolError,
    Wire,
    io_identity,
    rank_identity,
)

__all__ = ["SimShard", "main"]

HEARTBEAT_INTERVAL = 1.0  # while a cell runs; between cells every IDLE_HEARTBEAT_INTERVAL (as a real rank)
IDLE_HEARTBEAT_INTERVAL = 5.0
KEPT_RECORDS = 50_000  # shard.log records a rank keeps for history(), as a real rank does
FLUSH_INTERVAL = 0.05  # a running cell's output and logged scalars go out this often, as a real rank's
REFUSED = "simulated ranks (--launcher simulated) take no pushes or pulls"


class SimShard:
    """The ``shard`` of a simulated rank: its place in the world, and ``log`` for the dashboard."""

    def __init__(self, rank: int, world_size: int, lock: threading.Lock) -> None:
        self.rank, self.local_rank, self.world_size = rank, rank, world_size
        self.is_main = rank == 0
        self.global_step = 0
        self.lock = lock  # the rank's: the main thread takes what was logged under it
        self.pending: list[tuple[float, float, dict[str, float]]] = []  # logged, not yet sent
        # [step, wall time, values]: what history() asks for, the last KEPT_RECORDS as a real rank's
        self.sent: collections.deque[list[Any]] = collections.deque(maxlen=KEPT_RECORDS)

    def log(self, step: int | None = None, **scalars: float) -> None:
        record = {k: float(v) for k, v in scalars.items()}
        with self.lock:
            self.global_step = int(step) if step is not None else self.global_step + 1
            self.pending.append((float(self.global_step), time.time(), record))

    def print0(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main:
            print(*args, **kwargs)


class SimRank:
    """One simulated rank: its sockets, its namespace and its log."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        env: RankEnv,
        rank: int,
        log: str,
        outbox: queue.SimpleQueue[tuple[zmq.Socket[bytes], list[bytes]]],
        wake: Callable[[], None],
    ) -> None:
        key = bytes.fromhex(env.key)
        self.outbox, self.wake = outbox, wake
        self.lock = threading.Lock()
        self.flushing = threading.RLock()  # a flush's taking and sending, and the count done reports
        self.printed: list[str] = []
        self.thread: threading.Thread | None = None  # the running cell's
        self.rank = rank
        self.shell_wire = Wire(key, rank_identity(rank))
        self.io_wire = Wire(key, io_identity(rank))
        self.shell = _dealer(ctx, env.address, rank_identity(rank))
        self.io = _dealer(ctx, env.address, io_identity(rank))
        self.io_count = 0
        self.shard = SimShard(rank, env.world_size, self.lock)
        self.namespace: dict[str, Any] = {"shard": self.shard, "__name__": "__main__", "print": self.print}
        self.log_path = log
        self.log: TextIO = open(log, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 (its life)
        self.cell_id = self.cell_head = ""
        self.started = 0.0
        self.next_beat = 0.0  # between cells, the next heartbeat (monotonic)
        self.done = False
        self.in_cell = False  # the cell thread runs the user's code now: an interrupt may be raised in it
        self.interrupted = False  # this cell was interrupted already (one SIGINT per rank handle comes)
        self.sleeping = threading.Event()  # set to end the cell's time.sleep early (an interrupt)

    def send_shell(self, message: Outgoing, buffers: list[bytes] | None = None) -> None:
        with self.lock:  # signed and queued in one step: the kernel refuses a seq that goes back
            self.outbox.put((self.shell, self.shell_wire.to_socket(message[0], message[1], buffers or [])))
        self.wake()

    def send_io(self, message: Outgoing, buffers: list[bytes] | None = None) -> int:
        """Queue ``message`` on the I/O socket; how many it has been given (``done``'s ``io_count``)."""
        with self.lock:
            self.io_count += 1
            self.outbox.put((self.io, self.io_wire.to_socket(message[0], message[1], buffers or [])))
            count = self.io_count
        self.wake()
        return count

    def send_io_numbered(self, build: Callable[[int], Outgoing]) -> None:
        """Queue the message ``build(n)`` makes, where it is the n-th the I/O socket is given."""
        with self.lock:
            self.io_count += 1
            message = build(self.io_count)
            self.outbox.put((self.io, self.io_wire.to_socket(message[0], message[1], [])))
        self.wake()

    def print(
        self, *args: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None, flush: bool = False
    ) -> None:
        """The cell's ``print``: to this rank's output (another ``file`` is written as asked)."""
        if file is not None:
            print(*args, sep=sep, end=end, file=file, flush=flush)
            return
        text = (" " if sep is None else sep).join(map(str, args)) + ("\n" if end is None else end)
        with self.lock:
            self.printed.append(text)

    def flush(self) -> None:
        """Send what the cell printed since the last flush, then what it logged."""
        with self.flushing:
            self._flush()

    def _flush(self) -> None:
        with self.lock:
            text, self.printed = "".join(self.printed), []
            pending, self.shard.pending = self.shard.pending, []
        if text:
            self.log.write(text)
            self.log.flush()
            stream = StreamBody(cell_id=self.cell_id, name="stdout")
            self.send_io(STREAM(stream), [text.encode("utf-8", TEXT_ERRORS)])
        if pending:
            self.flush_metrics(pending)

    def heartbeat(self) -> HeartbeatBody:
        executing = bool(self.cell_id)
        return {
            "executing": executing,
            "cell": self.cell_head,
            "running_for": time.time() - self.started if executing else 0.0,
            "memory": {"rss": 0},
            "step": self.shard.global_step,
            "collective": "",
            "group_ranks": [],
            "waiting": "",
        }

    def flush_metrics(self, pending: list[tuple[float, float, dict[str, float]]]) -> None:
        """What ``shard.log`` recorded, one message per set of names (float64 columns)."""
        batches: dict[tuple[str, ...], list[tuple[float, float, dict[str, float]]]] = {}
        for record in pending:
            batches.setdefault(tuple(record[2]), []).append(record)
        for names, records in batches.items():
            columns = [array("d", [r[0] for r in records]), array("d", [r[1] for r in records])]
            columns += [array("d", [r[2][n] for r in records]) for n in names]
            body = MetricsBody(rank=self.rank, names=list(names), count=len(records))
            self.send_io(METRICS(body), [c.tobytes() for c in columns])
        self.shard.sent += [[int(s), t, values] for s, t, values in pending]


class Host:
    """The process: its ranks, one poller over their sockets (the main thread alone uses them), and a
    thread per running cell."""

    def __init__(self, env: RankEnv, plan: list[Mapping[str, Any]]) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.outbox: queue.SimpleQueue[tuple[zmq.Socket[bytes], list[bytes]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.ranks = [
            SimRank(self.ctx, env, int(p["rank"]), str(p["log"]), self.outbox, self._wake) for p in plan
        ]
        self.by_socket: dict[zmq.Socket[bytes], tuple[SimRank, bool]] = {}
        self.poller = zmq.Poller()
        self.poller.register(self._wake_r, zmq.POLLIN)
        for r in self.ranks:
            for sock, is_io in ((r.shell, False), (r.io, True)):
                self.by_socket[sock] = (r, is_io)
                self.poller.register(sock, zmq.POLLIN)
        self._compiled: tuple[str, CodeType | SyntaxError] | None = None
        self._compile_lock = threading.Lock()
        signal.signal(signal.SIGINT, lambda signum, frame: self.interrupt())

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def interrupt(self) -> None:
        """``KeyboardInterrupt`` in every cell running in this process, once per cell (the kernel
        signals each rank's handle, and they all name this process), and an end to its
        ``time.sleep``."""
        for r in self.ranks:
            with r.lock:
                thread = r.thread
                if not r.in_cell or r.interrupted or thread is None or thread.ident is None:
                    continue
                r.interrupted = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
                )
            r.sleeping.set()

    def serve(self) -> None:
        here = socket.gethostname()
        for r in self.ranks:
            ready = ReadyBody(
                rank=r.rank, pid=os.getpid(), host=here, device="cpu", log_path=r.log_path, node=0, job=""
            )
            r.send_shell(READY(ready))
        next_beat = next_flush = time.monotonic()
        while not all(r.done for r in self.ranks) or not self.outbox.empty():
            now = time.monotonic()
            if now >= next_beat:
                for r in self.ranks:
                    if r.cell_id or now >= r.next_beat:
                        r.send_io(HEARTBEAT(r.heartbeat()))
                        r.next_beat = now + IDLE_HEARTBEAT_INTERVAL
                next_beat = now + HEARTBEAT_INTERVAL
            if now >= next_flush:
                for r in self.ranks:
                    if r.thread is not None:
                        r.flush()
                next_flush = now + FLUSH_INTERVAL
            self._send_queued()
            wait = max(1, int((min(next_beat, next_flush) - now) * 1000))
            for sock, _ in self.poller.poll(wait):
                if sock == self._wake_r:
                    os.read(self._wake_r, 65536)
                    continue
                rank, is_io = self.by_socket[sock]
                wire = rank.io_wire if is_io else rank.shell_wire
                try:
                    msg = wire.from_socket(sock.recv_multipart(), expect_sender=KERNEL)
                except ProtocolError as exc:
                    print(f"jupyter_shard: rank {rank.rank} dropped a message: {exc}", file=sys.__stderr__)
                    continue
                (self._io if is_io else self._shell)(rank, msg)
            self._send_queued()

    def _send_queued(self) -> None:
        while True:
            try:
                sock, frames = self.outbox.get_nowait()
            except queue.Empty:
                return
            sock.send_multipart(frames, copy=False)

    def _io(self, rank: SimRank, msg: Message) -> None:
        req_id = str(msg.body.get("req_id", ""))
        if msg.type == "status":
            beat, cell_id = rank.heartbeat(), rank.cell_id
            rank.send_io_numbered(
                lambda count: STATUS_REPLY(
                    StatusReply(req_id=req_id, **beat, io_count=count, cell_id=cell_id)
                )
            )
        elif msg.type == "stacks":
            rank.send_io(STACKS_REPLY({"req_id": req_id, "stacks": []}))
        elif msg.type == "history":
            rank.send_io(HISTORY_REPLY({"req_id": req_id, "records": list(rank.shard.sent)}))
        elif msg.type == "signal" and int(msg.body["signal"]) == signal.SIGINT:
            self.interrupt()
        # "abort" has nothing to act on: there is no process group

    def _shell(self, rank: SimRank, msg: Message) -> None:
        req_id = str(msg.body.get("req_id", ""))
        if msg.type == "execute":
            rank.thread = threading.Thread(target=self._execute, args=(rank, dict(msg.body)), daemon=True)
            rank.thread.start()
        elif msg.type == "push":
            rank.send_shell(PUSH_REPLY({"req_id": req_id, "ok": False, "error": REFUSED}))
        elif msg.type == "pull":
            if not msg.body.get("release"):
                rank.send_shell(PULL_REPLY({"req_id": req_id, "ok": False, "error": REFUSED}))
        elif msg.type == "release":
            rank.send_shell(RELEASE_REPLY({"req_id": req_id, "ok": True, "error": "", "closed": 0}))
        elif msg.type == "regroup":
            regroup = RegroupReply(req_id=req_id, ok=True, error="", prepared=False, seconds=0.0)
            rank.send_shell(REGROUP_REPLY(regroup))
        elif msg.type == "debug_request":
            debug = DebugResponseBody(seq=int(msg.body["seq"]), success=False, message=REFUSED, body={})
            rank.send_shell(DEBUG_RESPONSE(debug))
        elif msg.type == "shutdown":
            rank.done = True

    def _execute(self, rank: SimRank, body: Mapping[str, Any]) -> None:
        """A cell on ``rank``'s own thread: its output, what it logged, then ``done``."""
        code, cell_id = str(body["code"]), str(body["cell_id"])
        started = time.perf_counter()
        rank.cell_id, rank.cell_head, rank.started = cell_id, code.split("\n", 1)[0][:80], time.time()
        error = self._run(rank, code)
        while True:  # an interrupt pending as the cell ended must not lose its done
            try:
                with rank.flushing:  # no other flush between this one and the count done reports
                    rank.flush()
                    with rank.lock:
                        rank.cell_id = rank.cell_head = ""
                        rank.thread = None
                        io_count = rank.io_count
                break
            except KeyboardInterrupt:
                error = error or ("KeyboardInterrupt", "", ["KeyboardInterrupt"])
        name, value, tb_lines = error or ("", "", [])
        done = DoneBody(
            io_count=io_count,
            cell_id=cell_id,
            status="error" if error else "ok",
            ename=name,
            evalue=value,
            traceback=tb_lines,
            duration=time.perf_counter() - started,
            grouped=True,
            ungrouped="",
            lost_context="",
        )
        rank.send_shell(DONE(done))

    def _run(self, rank: SimRank, code: str) -> tuple[str, str, list[str]] | None:
        """The cell's code; its error as ``done`` reports one (``SystemExit`` too, as IPython does).
        An interrupt is raised in the cell only while ``rank.in_cell`` (:meth:`interrupt`), and
        one still pending when the code ends is withdrawn."""
        _current.rank = rank
        rank.sleeping.clear()
        with rank.lock:
            rank.in_cell, rank.interrupted = True, False
        try:
            try:
                exec(self._compile(code), rank.namespace)
            finally:
                rank.in_cell = False
                with rank.lock:  # an interrupt that decided to raise in this cell has done so
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)
        except BaseException as exc:  # the cell's own failure, KeyboardInterrupt and SystemExit included
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # the cell's frames
            return type(exc).__name__, str(exc), traceback.format_exception(type(exc), exc, tb)
        return None

    def _compile(self, code: str) -> CodeType:
        """A cell's code, compiled once for every rank of this process that runs it."""
        with self._compile_lock:
            if self._compiled is None or self._compiled[0] != code:
                try:
                    found: CodeType | SyntaxError = compile(code, "<cell>", "exec")
                except SyntaxError as exc:
                    found = exc
                self._compiled = (code, found)
            found = self._compiled[1]
        if isinstance(found, SyntaxError):
            raise found
        return found


_current = threading.local()  # .rank: the simulated rank whose cell this thread runs
_real_sleep = time.sleep


def _sleep(seconds: float) -> None:
    """``time.sleep`` in this process: in a cell, a wait that an interrupt ends (a real rank's
    sleep ends on SIGINT; an exception raised in a thread waits for it to run Python again)."""
    rank: SimRank | None = getattr(_current, "rank", None)
    if rank is None:
        _real_sleep(seconds)
    else:
        rank.sleeping.wait(max(0.0, float(seconds)))


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], address: str, identity: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    return sock


def _watch_lifeline(fd: int) -> None:
    """End the process when the kernel's lifeline pipe closes (the kernel is gone)."""

    def run() -> None:
        while True:
            select.select([fd], [], [])
            try:
                if os.read(fd, 1) == b"":
                    os._exit(0)
            except OSError:
                os._exit(0)

    threading.Thread(target=run, name="jupyter_shard-lifeline", daemon=True).start()


def main() -> None:
    env = RankEnv.from_env(os.environ)
    pop_secrets(os.environ)
    plan = json.loads(Path(sys.argv[1]).read_text())
    if env.lifeline_fd is not None:
        _watch_lifeline(env.lifeline_fd)
    time.sleep = _sleep  # type: ignore[assignment]  # (this process runs only simulated ranks)
    host = Host(env, plan)
    host.serve()
    time.sleep(0.2)  # the last replies leave before the sockets close
    os._exit(0)


if __name__ == "__main__":
    main()
