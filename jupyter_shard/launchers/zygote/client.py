"""The kernel's side of the zygote, a preloaded process that forks fresh ranks: torch is imported once.

Runs in the process that drives a pool (the notebook kernel, a script); the zygote itself is :mod:`.server`.
The kernel starts the zygote with exec (``python -m`` and the server's module), never by forking itself, so
nothing of the kernel (CUDA state included) reaches a rank. The zygote imports torch - without touching CUDA -
``torch._dynamo``, ZeroMQ, IPython and the rank runtime, then waits on a Unix socket. Each request carries one
rank's environment, working directory and log path, plus the pool's lifeline pipe as a passed file descriptor;
the zygote forks, and the child becomes a new session, takes that environment, reseeds its random generators,
points fds 1 and 2 at its log and runs the rank runtime as a spawned rank would. The zygote reaps its children
and reports each exit status to the kernel, so a rank forked here is polled, signalled and killed like a
spawned one.

A zygote serves one kernel: it ends - killing its children - when the kernel's lifeline to it
closes. Requests whose interpreter environment (``PYTHON*``, ``LD_*``, ``TORCH*``, ``sys.executable``) differs
from the zygote's go to a new zygote. ``JUPYTER_SHARD_ZYGOTE=0`` turns it off: ranks are then
spawned one process each.

Forking is safe only while the zygote holds no CUDA driver state, which exists from ``cuInit`` on;
the zygote checks after its imports (:func:`.server.cuda_driver_state`). If it holds some, the
zygote refuses to fork and says why; the launcher spawns the ranks and ``%dist_status`` shows the reason.
Which devices a rank uses (``CUDA_VISIBLE_DEVICES``) is therefore set in the forked child, before
anything initialises CUDA, and is not part of the interpreter environment a zygote serves.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from jupyter_shard.env import PER_RANK, ZYGOTE_SWITCH, without_pool_variables
from jupyter_shard.errors import PoolError

ENV_SWITCH = ZYGOTE_SWITCH
READY_TIMEOUT = 120.0
MAX_MSG = 1 << 20  # the largest request or answer on the socket between the kernel and a zygote
SERVER = "jupyter_shard.launchers.zygote.server"  # the module the zygote runs, with ``python -m``
# read when the zygote imports torch._dynamo (torch._inductor's config, Triton), not only TORCH*
_COMPILER = (
    "TRITON",
    "INDUCTOR",
    "AOT",
    "CXX",
    "PT2_",
    "UNSAFE_",
    "CUTLASS",
    "CUTEDSL",
    "DUMP_AOTI",
    "LOG_",
    "ENABLE_",
)
_UNSHARED = ("CUDA_VISIBLE_DEVICES",)  # read by CUDA at its initialisation, which happens after the fork


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") not in ("0", "false", "no", "off")


def interpreter_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What of an environment shapes a Python process at start-up (a zygote serves one such key).

    A rank's own launch variables (``RANK``, ``TORCHELASTIC_RUN_ID``, ...) differ per rank and pool and
    are set in the forked rank, so they are not part of it.
    """
    keep = ("PYTHON", "LD_", "MALLOC", "CUDA_", "NCCL_", "GLOO_", "KMP_", "MKL_", "TORCH", *_COMPILER)
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(keep) and k != "PYTHONUNBUFFERED" and k not in PER_RANK and k not in _UNSHARED
        )
    )


class ZygoteUnavailable(PoolError):
    """The zygote ended, refused or could not fork; the launcher spawns ranks instead."""


class ZygoteClient:
    """The kernel's handle on one zygote: fork requests out, pids and exit statuses back."""

    def __init__(self, env: dict[str, str], key: tuple[tuple[str, str], ...]) -> None:
        self.key = key
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lifeline_r, self._lifeline_w = os.pipe()
        self._output = tempfile.TemporaryFile()  # noqa: SIM115 (kept open: the zygote writes to it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", SERVER, str(theirs.fileno()), str(self._lifeline_r)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(theirs.fileno(), self._lifeline_r),
        )
        theirs.close()
        os.close(self._lifeline_r)
        self._lock = threading.Lock()
        self._pids: dict[str, int] = {}
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition(self._lock)
        self._error = ""
        self.refusal = ""  # why the zygote would not fork (it holds CUDA driver state), once it said
        self._reader = threading.Thread(target=self._read, name="jupyter_shard-zygote", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """No system call: the zygote's end closes its socket, which the reader thread notices."""
        return not self._error

    def fork(self, env: dict[str, str], cwd: Path, log_path: Path, lifeline_fd: int) -> int:
        """Fork one rank; its pid (the child's own session and process group)."""
        token = os.urandom(8).hex()
        request = json.dumps({"token": token, "env": env, "cwd": str(cwd), "log": str(log_path)}).encode()
        if len(request) > MAX_MSG:
            raise RuntimeError("the rank's environment is too large for the zygote")
        try:
            socket.send_fds(self._sock, [request], [lifeline_fd])
        except OSError as exc:
            raise ZygoteUnavailable(self.refusal or f"the zygote is gone ({exc}): {self.output()}") from None
        deadline = time.monotonic() + READY_TIMEOUT
        with self._changed:
            while token not in self._pids:
                if self.refusal:
                    raise ZygoteUnavailable(self.refusal)
                if self._error or self.proc.poll() is not None:
                    raise ZygoteUnavailable(
                        f"the zygote ended ({self._error or self.proc.returncode}): {self.output()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ZygoteUnavailable(f"the zygote did not fork a rank within {READY_TIMEOUT:.0f} s")
                self._changed.wait(min(left, 0.5))
            return self._pids.pop(token)

    def keep(self, pids: list[int], on: bool = True) -> None:
        """Leave these children alive when the kernel goes (a kept pool's ranks), or no longer."""
        try:
            self._sock.send(json.dumps({"keep": pids, "on": on}).encode())
        except OSError as exc:
            raise ZygoteUnavailable(f"the zygote is gone ({exc}): {self.output()}") from None

    def output(self, limit: int = 2000) -> str:
        """The end of what the zygote printed (its traceback, when its preload failed)."""
        try:
            self._output.seek(0, os.SEEK_END)
            size = self._output.tell()
            self._output.seek(max(0, size - limit))
            return self._output.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while pid not in self._exits:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    break
                self._changed.wait(min(left, 0.5))
            return self._exits.get(pid)

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MSG)
            except OSError as exc:
                data, self._error = b"", str(exc)
            if not data:
                with self._changed:
                    self._error = self._error or "its socket closed"
                    self._changed.notify_all()
                return
            msg = json.loads(data)
            with self._changed:
                if "refused" in msg:
                    self.refusal = f"the zygote refused to fork: {msg['refused']}"
                elif "forked" in msg:
                    self._pids[str(msg["token"])] = int(msg["forked"])
                elif "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                self._changed.notify_all()

    def close(self) -> None:
        """End the zygote (its children too)."""
        with contextlib.suppress(OSError):
            os.close(self._lifeline_w)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._sock.close()
        self._output.close()


_zygotes: dict[tuple[tuple[str, str], ...], ZygoteClient] = {}
_failed: dict[tuple[tuple[str, str], ...], str] = {}  # environments whose zygote could not fork: why
_zygotes_lock = threading.Lock()


def failure(env: dict[str, str]) -> str:
    """Why this environment's zygote could not fork ranks before ("" if it never failed)."""
    with _zygotes_lock:
        return _failed.get(interpreter_key(env), "")


def zygote_for(env: dict[str, str]) -> ZygoteClient | None:
    """The running zygote for this interpreter environment, started when there is none; None for
    an environment whose zygote failed before (its ranks are spawned: :func:`failure` says why)."""
    key = interpreter_key(env)
    with _zygotes_lock:
        if key in _failed:
            return None
        current = _zygotes.get(key)
        if current is not None and current.alive():
            return current
        if current is not None:
            current.close()
        fresh = _zygotes[key] = ZygoteClient(_zygote_env(env), key)
        return fresh


def _zygote_env(env: dict[str, str]) -> dict[str, str]:
    """The zygote's own environment: the rank's, minus what belongs to one pool or one rank."""
    return without_pool_variables(env)


def mark_failed(client: ZygoteClient, reason: str) -> None:
    """Spawn ranks for this environment from now on (its zygote could not fork them, for ``reason``)."""
    with _zygotes_lock:
        _failed[client.key] = reason
        if _zygotes.get(client.key) is client:
            del _zygotes[client.key]
    client.close()


def close_idle() -> int:
    """End the zygotes that have no ranks alive (a pool still running keeps its own); how many."""
    import psutil

    with _zygotes_lock:
        idle = []
        for key, client in list(_zygotes.items()):
            try:
                busy = any(
                    c.status() != psutil.STATUS_ZOMBIE for c in psutil.Process(client.proc.pid).children()
                )
            except psutil.Error:
                busy = False
            if not busy:
                idle.append(_zygotes.pop(key))
    for client in idle:
        client.close()
    return len(idle)


def close_all() -> None:
    with _zygotes_lock:
        for client in _zygotes.values():
            client.close()
        _zygotes.clear()
