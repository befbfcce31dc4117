"""Timing a system without leaving anything behind: interleaved sample loops, Ctrl-C turned into a
clean stop, leftover processes killed by pid, and a real kernel driven over its own sockets as a
frontend does (the notebook-path samples)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import zmq
from jupyter_client.manager import KernelManager

from benchmarks.dispatch.results import CELL_TIMEOUT, Results
from jupyter_shard.launchers import zygote


class Interrupts:
    """Turns SIGINT and SIGTERM into KeyboardInterrupt and remembers that one came.

    ipyparallel's blocking ``execute`` swallows KeyboardInterrupt and ``Pool.run`` turns it into an
    interrupted cell: :meth:`check` re-raises after such a call, so the ``finally`` blocks stop
    everything. Later signals are ignored so the cleanup is not cut short.
    """

    def __init__(self) -> None:
        self.seen = False
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self.seen:
            return
        self.seen = True
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt


INTERRUPTS = Interrupts()


def time_loops(fns: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Samples of each function; several are interleaved, so drift on the machine hits them all.
    A function with a ``before`` attribute has it called, untimed, before each of its samples."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            INTERRUPTS.check()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            before = getattr(fn, "before", None)
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
            INTERRUPTS.check()
    return samples


def stop_leftovers(what: str, into: Results, grace: float = 3.0) -> None:
    """Kill, by pid, any descendant of this process still alive after a system was stopped."""
    alive = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(alive, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            into.leftovers.append(f"{what}: pid {proc.pid} ({' '.join(proc.cmdline()[:4])})")
            proc.kill()
    psutil.wait_procs(alive, timeout=5.0)


@contextlib.contextmanager
def zygote_switch(on: bool) -> Iterator[None]:
    """Ranks of pools started inside come from the zygote (on) or one spawned process each (off)."""
    old = os.environ.get(zygote.ENV_SWITCH)
    os.environ[zygote.ENV_SWITCH] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(zygote.ENV_SWITCH, None)
        else:
            os.environ[zygote.ENV_SWITCH] = old


# -- a kernel driven over its own sockets ---------------------------------------------------------------


class KernelProbe:
    """A real kernel subprocess, spoken to as a frontend does: execute_request out, iopub in."""

    def __init__(self, env: dict[str, str], argv: list[str] | None = None, ready_timeout: float = 120.0):
        self.km = KernelManager(kernel_name="python3")
        spec = self.km.kernel_spec
        assert spec is not None
        spec.argv = argv or [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        if argv:
            spec.interrupt_mode = "message"
        self.km.start_kernel(env={**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1", **env})
        self.session = self.km.session
        self.shell = self.km.connect_shell()
        self.iopub = self.km.connect_iopub()
        self._wait_ready(ready_timeout)

    def _recv(self, sock: zmq.Socket[bytes], timeout: float) -> dict[str, Any]:
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no message from the kernel within {timeout:.0f} s")
        _, frames = self.session.feed_identities(sock.recv_multipart())
        msg: dict[str, Any] = self.session.deserialize(frames)
        return msg

    def _wait_ready(self, timeout: float) -> None:
        """Until a kernel_info request is answered on shell and its status seen on iopub (subscribed)."""
        deadline = time.monotonic() + timeout
        sent: set[str] = set()
        while time.monotonic() < deadline:
            if not self.km.is_alive():
                raise RuntimeError("the kernel died while starting")
            sent.add(self.session.send(self.shell, "kernel_info_request", {})["header"]["msg_id"])
            with contextlib.suppress(TimeoutError):
                while True:
                    msg = self._recv(self.iopub, 0.5)
                    if msg["parent_header"].get("msg_id") in sent:
                        while self.shell.poll(0):
                            self.shell.recv_multipart()
                        return
        raise TimeoutError(f"the kernel did not answer within {timeout:.0f} s")

    def execute(self, code: str, timeout: float = CELL_TIMEOUT) -> float:
        """Run one cell; seconds from sending the request to its idle status. Raises if it failed."""
        msg = self.session.msg(
            "execute_request",
            {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
        )
        msg_id = msg["header"]["msg_id"]
        errors: list[str] = []
        t0 = time.perf_counter()
        self.session.send(self.shell, msg)
        while True:
            reply = self._recv(self.iopub, timeout)
            if reply["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = reply["msg_type"], reply["content"]
            if kind == "status" and content["execution_state"] == "idle":
                elapsed = time.perf_counter() - t0
                break
            if kind == "error":
                errors.append(f"{content['ename']}: {content['evalue']}")
        while True:
            answer = self._recv(self.shell, timeout)
            if answer["parent_header"].get("msg_id") == msg_id:
                break
        status = answer["content"]["status"]
        if status != "ok":
            detail = errors or [f"{answer['content'].get('ename')}: {answer['content'].get('evalue')}"]
            raise RuntimeError(
                f"cell {code.strip().splitlines()[0]!r} failed in the kernel: {'; '.join(detail)}"
            )
        return elapsed

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=False)
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)
        self.shell.close(linger=0)
        self.iopub.close(linger=0)
