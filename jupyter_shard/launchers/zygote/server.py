"""The zygote: a preloaded process that forks fresh ranks, run with ``python -m`` by :mod:`.client`.

Runs in the zygote process, never in the kernel. It imports torch - without touching CUDA - ``torch._dynamo``,
ZeroMQ, IPython and the rank runtime, then waits on a Unix socket. For each request the zygote forks, and the
child becomes a new session, takes the rank's environment, reseeds its random generators, points fds 1 and 2
at its log and runs the rank runtime as a spawned rank would. The zygote reaps its children and reports each
exit status to the kernel; it ends, killing its children, when the kernel's lifeline to it closes (all but the
ranks of a kept pool, which the kernel names).

Forking is safe only while the zygote holds no CUDA driver state, which exists from ``cuInit`` on:
``torch.cuda.is_initialized()`` sees only torch's own initialisation, so after its imports the zygote
also asks each ``libcuda`` it has mapped whether ``cuInit`` ran (:mod:`.cuda_driver`; ``import torch``
maps the library on a GPU machine without initialising it, and that zygote forks). If one did, the
zygote refuses to fork and answers every request with why, until the kernel lets it go.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
from typing import Any

from jupyter_shard.env import LIFELINE_FD, PARENT_PID
from jupyter_shard.launchers.zygote import cuda_driver
from jupyter_shard.launchers.zygote.client import MAX_MSG


def cuda_driver_state(maps_path: str = cuda_driver.MAPS) -> str:
    """Why forking this process would hand CUDA driver state to its children ("" when it would not)."""
    import torch

    return "torch initialised CUDA" if torch.cuda.is_initialized() else cuda_driver.initialised(maps_path)


def _preload() -> str:
    """Import what every rank needs; why forking now would be unsafe ("" when it is safe)."""
    import cloudpickle  # noqa: F401
    import IPython.core.interactiveshell  # noqa: F401
    import torch._dynamo  # a rank's first optimizer imports it: about 1 s of CPU per rank
    import torch.distributed  # noqa: F401
    import zmq  # noqa: F401

    import jupyter_shard.rank.runtime
    import jupyter_shard.rank.shard
    import jupyter_shard.rank.shell  # noqa: F401

    held = cuda_driver_state()
    return f"it holds CUDA driver state after its imports ({held})" if held else ""


def _serve(sock: socket.socket, lifeline: int) -> None:
    children: set[int] = set()
    kept: set[int] = set()  # ranks of a kept pool (--keep): they outlive the kernel, and this zygote
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        readable, _, _ = select.select([sock.fileno(), lifeline, wake_r], [], [], 1.0)
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(sock, children)
        if lifeline in readable and os.read(lifeline, 1) == b"":
            _end(children - kept)
        if sock.fileno() in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 1)
            except OSError:
                _end(children - kept)
            if not data:
                _end(children - kept)
            request = json.loads(data)
            if "keep" in request:  # not a fork: children to leave alive when the kernel goes, or not
                pids = {int(p) for p in request["keep"]}
                kept = kept | pids if request.get("on", True) else kept - pids
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, fds[0] if fds else -1, sock, lifeline, (wake_r, wake_w))
            for fd in fds:
                os.close(fd)
            children.add(pid)
            sock.send(json.dumps({"token": request["token"], "forked": pid}).encode())


def _refuse(sock: socket.socket, lifeline: int, reason: str) -> None:
    """Answer every request with why this zygote will not fork, until the kernel lets it go (ending
    at once could reset the socket under a request in flight, and the reason would be lost)."""
    refusal = json.dumps({"refused": reason}).encode()
    sock.send(refusal)
    while True:
        readable, _, _ = select.select([sock.fileno(), lifeline], [], [])
        if lifeline in readable and os.read(lifeline, 1) == b"":
            return
        if sock.fileno() in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 1)
            except OSError:
                return
            for fd in fds:
                os.close(fd)
            if not data:
                return
            sock.send(refusal)


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with contextlib.suppress(OSError):
                sock.send(json.dumps({"exit": pid, "code": code}).encode())


def _end(children: set[int]) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    os._exit(0)


def _child(
    request: dict[str, Any], lifeline: int, sock: socket.socket, own_lifeline: int, wake: tuple[int, int]
) -> None:
    """In the forked child: become a fresh rank process, then run the rank runtime."""
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        sock.close()
        for fd in (own_lifeline, *wake):
            os.close(fd)
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        env = {str(k): str(v) for k, v in request["env"].items()}
        env[LIFELINE_FD] = str(lifeline)
        env[PARENT_PID] = str(os.getppid())
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        sys.argv = [""]
        _fresh_state(env)
        from jupyter_shard.rank.runtime import main

        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _fresh_state(env: dict[str, str]) -> None:
    """What a new interpreter would have that a fork shares with its siblings."""
    import random

    import torch

    random.seed()
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(None)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo.config, "default_debug_dir_root"):  # set from its import's cwd
        dynamo.config.debug_dir_root = dynamo.config.default_debug_dir_root()
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)  # noqa: SIM115


def main() -> None:
    fd, lifeline = int(sys.argv[1]), int(sys.argv[2])
    sock = socket.socket(fileno=fd)
    refusal = _preload()
    if refusal:  # children forked now would share the driver's state: the kernel spawns them instead
        _refuse(sock, lifeline, refusal)
        return
    _serve(sock, lifeline)


if __name__ == "__main__":
    main()
