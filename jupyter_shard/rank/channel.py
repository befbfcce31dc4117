"""The rank's one link to the kernel: a DEALER socket owned by an I/O thread.

The main thread runs user code, so everything that must happen while a cell runs lives here:
flushing buffered output on a timer, answering stack and status requests, and watching the
lifeline (when the kernel dies, the rank and its process group go with it). Only this thread
encodes and sends, so every message leaves in ``seq`` order.
"""

from __future__ import annotations

import os
import queue
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from jupyter_shard.protocol import KERNEL, MAX_FRAME, Message, ProtocolError, Wire

FLUSH_INTERVAL = 0.05

Handler = Callable[[Message], None]


class Channel:
    def __init__(self, address: str, wire: Wire) -> None:
        self.wire = wire
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[str, dict[str, Any], list[bytes]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, wire.sender.encode())
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self._sock.connect(address)
        self.io_handlers: dict[str, Handler] = {}
        self.flushers: list[Callable[[], None]] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jupyter_shard-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, msg_type: str, body: dict[str, Any], buffers: list[bytes] | None = None) -> None:
        """Queue a message; output written before this call is sent before it."""
        for flush in self.flushers:
            flush()
        self.enqueue(msg_type, body, buffers or [])

    def enqueue(self, msg_type: str, body: dict[str, Any], buffers: list[bytes]) -> None:
        self._outbox.put((msg_type, body, buffers))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the I/O thread."""
        for flush in self.flushers:
            flush()
        self._stopped.set()
        self._wake()
        self._thread.join(timeout)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll(int(FLUSH_INTERVAL * 1000)))
            if self._wake_r in events:
                os.read(self._wake_r, 65536)
            for flush in self.flushers:
                flush()
            self._drain_outbox()
            if self._sock in events:
                self._receive()
            if self._stopped.is_set() and self._outbox.empty():
                return

    def _drain_outbox(self) -> None:
        while True:
            try:
                msg_type, body, buffers = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._sock.send_multipart(self.wire.encode(msg_type, body, buffers), copy=False)

    def _receive(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                msg = self.wire.decode(frames, expect_sender=KERNEL)
            except ProtocolError as exc:
                print(f"jupyter_shard: dropped a message from the kernel: {exc}", file=sys.__stderr__)
                continue
            handler = self.io_handlers.get(msg.type)
            if handler is not None:
                handler(msg)
            else:
                self.inbox.put(msg)


def watch_lifeline(fd: int, parent_pid: int) -> None:
    """Kill this rank's whole process group as soon as the kernel that started it is gone."""

    def run() -> None:
        while True:
            readable, _, _ = select.select([fd], [], [], 0.25)
            gone = os.getppid() != parent_pid
            if readable:
                try:
                    gone = gone or os.read(fd, 1) == b""
                except OSError:
                    gone = True
            if gone:
                os.killpg(os.getpgrp(), signal.SIGKILL)
                time.sleep(1)
                os._exit(1)

    threading.Thread(target=run, name="jupyter_shard-lifeline", daemon=True).start()
