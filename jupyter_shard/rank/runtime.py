"""The life of a rank process: start up, join the process group, then run cells until told to stop.

Start-up reads its orders from the environment the launcher set (the pool key is removed from
``os.environ`` as soon as it is read, so cells and the processes they start do not see it; the
process's initial environment in ``/proc/<pid>/environ`` still holds it, readable only by the same
user and root, as the 0700 pool directory is), connects to the kernel, joins the default process group
through a FileStore in the pool's private directory, and says ``ready``. A failure at any point is
reported with its traceback and the process exits, so a pool start never waits on a dead rank.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import zmq

from jupyter_shard._curve import CURVE_ENV
from jupyter_shard.protocol import KEY_ENV, Message, io_identity, rank_identity
from jupyter_shard.rank.channel import Channel, ShellSocket, watch_kernel, watch_lifeline
from jupyter_shard.rank.handlers import CellState, Runner, agent_store
from jupyter_shard.rank.output import RankStream

ENV_PREFIX = "JUPYTER_SHARD_"


def _env(name: str) -> str:
    return os.environ[ENV_PREFIX + name]


def _log_path(rank: int) -> str:
    """The rank's log file: named by the pool, or (started by an agent) in the pool's log directory."""
    own = os.environ.get(ENV_PREFIX + "LOG")
    return own or os.path.join(_env("RANK_LOGS"), f"rank-{rank}.log")


def _log_to_own_file(path: str) -> None:
    """A rank started by an agent writes its output (native too) to its own log, as local ranks do."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    key = bytes.fromhex(os.environ.pop(KEY_ENV))
    curve = os.environ.pop(CURVE_ENV, None)  # set for ranks that dial back over TCP
    rank = int(os.environ["RANK"])
    if curve:
        _log_to_own_file(_log_path(rank))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    channel = Channel(ctx, _env("ADDRESS"), key, io_identity(rank), curve)
    shell_sock = ShellSocket(ctx, _env("ADDRESS"), key, rank_identity(rank), curve)
    if ENV_PREFIX + "LIFELINE_FD" in os.environ:
        watch_lifeline(int(_env("LIFELINE_FD")), int(_env("PARENT_PID")))
    else:  # started by an agent: live while the agent and the kernel connection do
        watch_kernel(shell_sock.monitor(), os.getppid())
    state = CellState()
    log = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace")
    lock = threading.Lock()
    sys.stdout = RankStream("stdout", log, channel.enqueue, lambda: state.cell_id, lock)
    sys.stderr = RankStream("stderr", log, channel.enqueue, lambda: state.cell_id, lock)
    channel.flushers.extend([sys.stdout.flush, sys.stderr.flush])
    channel.io_handlers["stacks"] = lambda msg: _reply_stacks(channel, msg)
    channel.io_handlers["status"] = lambda msg: _reply_status(channel, msg, state)
    channel.io_handlers["signal"] = _signal_self
    channel.heartbeat = lambda: _status_body(state)
    channel.start()
    sys.argv = [""]
    try:
        runner = _start_up(rank, channel, shell_sock, state)
    except BaseException:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        channel.close()
        shell_sock.send("startup_failed", {"rank": rank, "traceback": tb})
        time.sleep(0.2)
        os._exit(1)
    runner.loop()


def _start_up(rank: int, channel: Channel, shell_sock: ShellSocket, state: CellState) -> Runner:
    import torch
    import torch.distributed as dist

    from jupyter_shard.rank import shard as shard_module
    from jupyter_shard.rank.shell import RankShell

    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if _env("DEVICE") == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise RuntimeError(
                f"rank {rank} needs CUDA device {local_rank} but {torch.cuda.device_count()} are visible"
            )
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=float(_env("TIMEOUT")))
    if ENV_PREFIX + "STORE" in os.environ:
        dist.init_process_group(
            backend, init_method="file://" + _env("STORE"), rank=rank, world_size=world_size, timeout=timeout
        )
    else:  # started by torchrun: its store (c10d rendezvous), a prefix per process group
        from torch._C._distributed_c10d import PrefixStore
        from torch.distributed.rendezvous import rendezvous

        store, _, _ = next(rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        agent_store.append(store)
        dist.init_process_group(
            backend,
            store=PrefixStore("jupyter_shard/group-0/", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    options = json.loads(os.environ.get(ENV_PREFIX + "OPTIONS", "{}"))
    helper = shard_module.Shard(
        rank, local_rank, world_size, device, _env("STRATEGY"), channel.enqueue, options
    )
    shard_module.set_current(helper)
    channel.flushers.append(helper.flush_metrics)
    shell = RankShell.create(channel, {"shard": helper, "__name__": "__main__"})
    shell_sock.send(
        "ready",
        {
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": str(device),
            "log_path": _log_path(rank),
            "node": int(os.environ.get(ENV_PREFIX + "NODE") or os.environ.get("GROUP_RANK") or 0),
            "job": os.environ.get("SLURM_JOB_ID", ""),
        },
    )
    return Runner(rank, channel, shell_sock, state, shell, backend, timeout.total_seconds())


def _signal_self(msg: Message) -> None:
    """A signal from the kernel for a rank it cannot signal itself (started by an agent elsewhere)."""
    sig = int(msg.body["signal"])
    if sig == signal.SIGKILL and os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)  # the rank leads its group: its children go too
    elif sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        os.kill(os.getpid(), sig)


def _reply_stacks(channel: Channel, msg: Message) -> None:
    main_id = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        if name.startswith("jupyter_shard-"):
            continue
        lines = traceback.format_stack(frame)
        stacks.append({"thread": "MainThread" if ident == main_id else name, "stack": "".join(lines)})
    channel.enqueue("stacks_reply", {"req_id": msg.body["req_id"], "stacks": stacks}, [])


def _status_body(state: CellState) -> dict[str, Any]:
    from jupyter_shard.rank.shard import current, memory_report

    helper = current()
    return {
        "executing": state.executing,
        "cell": state.cell_head,
        "running_for": time.time() - state.started if state.executing else 0.0,
        "memory": memory_report(helper.device if helper else None),
        "step": helper.global_step if helper else 0,
        "collective": current_collective() if state.executing else "",
    }


_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def current_collective() -> str:
    """The ``torch.distributed`` call the main thread is in (``all_reduce``, ``barrier``…), else ""."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    outermost = ""
    while frame is not None:  # innermost to outermost: the last c10d frame seen is the public call
        if frame.f_code.co_filename.endswith(_C10D):
            outermost = frame.f_code.co_name
        frame = frame.f_back
    return outermost


def _reply_status(channel: Channel, msg: Message, state: CellState) -> None:
    channel.enqueue("status_reply", {"req_id": msg.body["req_id"], **_status_body(state)}, [])
