"""A rank's two links to the kernel, one per thread, so that a no-op cell costs one wake-up each way.

- :class:`ShellSocket` (identity ``rank-k``) belongs to the main thread: it receives cells, pushes
  and pulls and sends their replies directly. A rank on the kernel's machine does that over its
  direct link, a Unix stream (:mod:`jupyter_shard.pool.links`), so no thread hands a message on
  between the kernel's main thread and the rank's; a rank elsewhere over the ZeroMQ socket.
- :class:`Channel` (identity ``rank-k.io``) belongs to an I/O thread: it sends output (flushed on a
  timer, so a cell blocked in native code still streams), metrics, a heartbeat every second (memory,
  what runs), and answers stack and status requests while a cell runs.

Each socket signs with its own :class:`Wire`, so each has its own growing ``seq``. ``done`` carries
how many messages the I/O thread had been given (``io_count``), and the kernel waits for those
before it finishes the cell: output is never reported after the cell it belongs to.

The I/O thread must outlive anything the main thread's device does: after a device-side assert
every CUDA call raises, the heartbeat's memory probe and a metrics flush among them. Each part of
its loop (a flusher, the heartbeat, a send, a request handler) is therefore guarded on its own: a
failure is reported once (:meth:`Channel.report`: the traceback to the rank's log, one line to the
kernel) and the loop goes on, so the rank keeps answering instead of looking stuck.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from jupyter_shard.wire.curve import secure_client
from jupyter_shard.wire.messages import STREAM, Outgoing
from jupyter_shard.wire.protocol import (
    KERNEL,
    MAX_FRAME,
    TEXT_ERRORS,
    Message,
    ProtocolError,
    StreamReader,
    Wire,
    size_stream,
    stream_record,
    write_stream,
)

FLUSH_INTERVAL = 0.05
READ_SIZE = 1 << 18  # one read from the direct link at most
HEARTBEAT_INTERVAL = 1.0  # while a cell runs (the kernel calls a rank stuck after 5 s without one)
IDLE_HEARTBEAT_INTERVAL = 5.0  # between cells: at 1,024 ranks a beat a second each was 7% of a core

Handler = Callable[[Message], None]


Curve = str | None  # the pool's Curve client keys (ranks that dial back over TCP), or None


def _connect(
    ctx: zmq.Context[zmq.Socket[bytes]], address: str, identity: str, curve: Curve = None
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    if curve:
        secure_client(sock, curve)
        # TCP keeps no watch on a peer that vanished without closing: ZMTP heartbeats do.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
    sock.connect(address)
    return sock


def _decode(wire: Wire, frames: list[bytes]) -> Message | None:
    try:
        return wire.from_socket(frames, expect_sender=KERNEL)
    except ProtocolError as exc:
        print(f"jupyter_shard: dropped a message from the kernel: {exc}", file=sys.__stderr__)
        return None


class ShellSocket:
    """Main-thread requests and replies: over the direct link once it is up, else the socket.

    Before the link is up (and on a rank elsewhere) the kernel writes to the socket; once a message
    on the link has been authenticated, the kernel writes only to the link. So a message waiting on
    the socket is always older than any on the link, and is read first.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        key: bytes,
        identity: str,
        curve: Curve = None,
    ) -> None:
        self.wire = Wire(key, identity)
        self.identity = identity
        self._sock = _connect(ctx, address, identity, curve)
        self._direct: socket.socket | None = None
        self._reader = StreamReader()
        self._buffer = bytearray(READ_SIZE)
        self._read: collections.deque[list[bytes]] = collections.deque()  # records read, not yet taken
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def connect_direct(self, path: str) -> None:
        """Open the direct link to the kernel's ``path`` and name this rank on it; before any send."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            size_stream(sock)
            sock.connect(path)
            sock.sendall(b"".join(stream_record([self.identity.encode()])))
        except OSError as exc:
            sock.close()
            why = f"jupyter_shard: no direct link to the kernel ({exc}); using the socket"
            print(why, file=sys.__stderr__)
            return
        self._direct = sock
        self._poller.register(sock, zmq.POLLIN)

    def monitor(self) -> zmq.Socket[bytes]:
        """A socket of connection events (connected, disconnected) for :func:`watch_kernel`."""
        return self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)

    def recv(self) -> Message:
        while True:
            msg = self.poll_recv(-1)
            if msg is not None:
                return msg

    def poll_recv(self, timeout_ms: int) -> Message | None:
        """The next message if one comes within ``timeout_ms`` (-1: no limit; a wait SIGINT can end)."""
        if self._direct is None:
            if not self._sock.poll(timeout_ms):
                return None
            return _decode(self.wire, self._sock.recv_multipart())
        ready: dict[Any, int] = {}  # the socket, and the link by its file descriptor
        if self._read:  # records already read from the link: the socket is asked without waiting
            on_socket = bool(int(self._sock.get(zmq.EVENTS)) & zmq.POLLIN)
        else:
            ready = dict(self._poller.poll(timeout_ms))
            if not ready:
                return None
            on_socket = self._sock in ready
        if on_socket:  # an older message, sent before the link was up
            with contextlib.suppress(zmq.Again):
                return _decode(self.wire, self._sock.recv_multipart(zmq.NOBLOCK))
        if not self._read and self._direct.fileno() in ready:  # blocking: read only when ready
            self._read_direct()
        return _decode(self.wire, self._read.popleft()) if self._read else None

    def _read_direct(self) -> None:
        assert self._direct is not None
        view = memoryview(self._buffer)
        try:
            n = self._direct.recv_into(view)
            if n == 0:
                raise ConnectionError("the kernel closed it")
            self._read.extend(self._reader.feed(view[:n]))
        except (OSError, ProtocolError) as exc:  # the kernel is gone, or closed the link
            self._drop_direct(exc)

    def _drop_direct(self, exc: Exception) -> None:
        if self._direct is None:
            return
        why = f"jupyter_shard: the direct link to the kernel closed ({exc}); using the socket"
        print(why, file=sys.__stderr__)
        self._poller.unregister(self._direct)
        self._direct.close()
        self._direct = None

    def send(self, msg_type: str, body: Mapping[str, Any], buffers: list[bytes] | None = None) -> None:
        """Send now; ``send(*DONE(body))`` has mypy check the body (:mod:`jupyter_shard.wire.messages`)."""
        frames = self.wire.to_socket(msg_type, body, buffers or [])
        if self._direct is not None:
            try:
                write_stream(self._direct, collections.deque(stream_record(frames)))  # blocking: all
                return
            except OSError as exc:
                self._drop_direct(exc)
        self._sock.send_multipart(frames, copy=False)


class Channel:
    """The I/O thread's socket, its outbox, and request handlers that run on that thread."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        key: bytes,
        identity: str,
        curve: Curve = None,
    ) -> None:
        self.wire = Wire(key, identity)
        self._outbox: queue.SimpleQueue[tuple[str, Mapping[str, Any], list[bytes]]] = queue.SimpleQueue()
        self._count = 0
        self._count_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._sock = _connect(ctx, address, identity, curve)
        self.io_handlers: dict[str, Handler] = {}  # built by ``messages.handler_table("rank.io", ...)``
        self.flushers: list[Callable[[], None]] = []
        self.heartbeat: Callable[[], Outgoing] | None = None  # the periodic heartbeat message
        self.busy: Callable[[], bool] = lambda: False  # a cell runs: beat every second
        self.tick: Callable[[], None] | None = None  # called on every turn of the I/O loop (~20/s)
        self._reported: set[str] = set()  # the parts whose failure has been reported
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jupyter_shard-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def flush(self) -> int:
        """Queue all buffered output; returns how many messages have been queued so far (``done``'s
        ``io_count``: the kernel counts what it receives). A flusher that fails is reported, and
        the others still run, so a cell's ``done`` always goes out."""
        for flush in list(self.flushers):
            try:
                flush()
            except Exception as exc:
                self.report(f"flushing {getattr(flush, '__qualname__', 'output')}", exc)
        return self._count

    def send(self, msg_type: str, body: Mapping[str, Any], buffers: list[bytes] | None = None) -> None:
        """Queue a message after any output written before this call."""
        self.flush()
        self.enqueue(msg_type, body, buffers or [])

    def enqueue(self, msg_type: str, body: Mapping[str, Any], buffers: list[bytes]) -> None:
        """Queue a message now; ``enqueue(*STREAM(body), buffers)`` has mypy check the body."""
        with self._count_lock:
            self._count += 1
            self._outbox.put((msg_type, body, buffers))
        self._wake()

    def enqueue_numbered(self, message: Callable[[int], Outgoing]) -> None:
        """Queue the message ``message(n)`` builds, where it is the n-th this socket was given."""
        with self._count_lock:
            self._count += 1
            msg_type, body = message(self._count)
            self._outbox.put((msg_type, body, []))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def report(self, what: str, exc: BaseException) -> None:
        """Say once per ``what`` that it failed: the traceback to the rank's log, a line to the kernel.

        Safe from any thread; what reports must not itself depend on the part that failed, so the
        line is queued as a message of its own rather than written to ``sys.stderr``.
        """
        if what in self._reported:
            return
        self._reported.add(what)
        line = f"jupyter_shard: {what} failed on this rank ({type(exc).__name__}: {exc}); "
        line += "its I/O thread goes on, and says this once"
        if "CUDA error" in str(exc):  # torch's words for a CUDA runtime error
            line += ". A CUDA error such as a device-side assert stays for the life of the process: "
            line += "%dist_restart gives fresh ranks"
        with contextlib.suppress(Exception):
            traceback.print_exception(exc, file=sys.__stderr__)
            print(line, file=sys.__stderr__, flush=True)
        with contextlib.suppress(Exception):
            data = (line + "\n").encode("utf-8", TEXT_ERRORS)
            self.enqueue(*STREAM({"cell_id": "", "name": "stderr"}), [data])

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the I/O thread."""
        self.flush()
        self._stopped.set()
        self._wake()
        self._thread.join(timeout)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat, beat_busy = 0.0, False
        while True:
            try:
                events = dict(poller.poll(int(FLUSH_INTERVAL * 1000)))
                if self._wake_r in events:
                    os.read(self._wake_r, 65536)
                self.flush()
                if self.tick is not None:
                    self.tick()
                busy, now = self.busy(), time.monotonic()
                if busy and not beat_busy:  # a cell began: beat within a second, as while it runs
                    next_beat = min(next_beat, now + HEARTBEAT_INTERVAL)
                beat_busy = busy
                if self.heartbeat is not None and now >= next_beat:
                    next_beat = now + (HEARTBEAT_INTERVAL if busy else IDLE_HEARTBEAT_INTERVAL)
                    self._beat(self.heartbeat)
                self._drain_outbox()
                if self._sock in events:
                    self._receive()
            except Exception as exc:  # the loop itself (the socket): never a busy loop of failures
                self.report("the I/O loop", exc)
                time.sleep(FLUSH_INTERVAL)
            if self._stopped.is_set() and self._outbox.empty():
                return

    def _beat(self, heartbeat: Callable[[], Outgoing]) -> None:
        try:
            msg_type, body = heartbeat()
        except Exception as exc:
            self.report("the heartbeat", exc)
            return
        self.enqueue(msg_type, body, [])

    def _drain_outbox(self) -> None:
        while True:
            try:
                msg_type, body, buffers = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                frames = self.wire.to_socket(msg_type, body, buffers)
            except Exception as exc:  # a body that does not serialise: that message is lost
                self.report(f"sending a {msg_type!r} message", exc)
                continue
            self._sock.send_multipart(frames, copy=False)

    def _receive(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = _decode(self.wire, frames)
            if msg is None:
                continue
            handler = self.io_handlers.get(msg.type)
            if handler is None:
                print(f"jupyter_shard: the I/O thread ignored a {msg.type!r} message", file=sys.__stderr__)
                continue
            try:
                handler(msg)
            except Exception as exc:
                self.report(f"answering a {msg.type!r} request", exc)
