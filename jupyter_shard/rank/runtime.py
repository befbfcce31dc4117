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
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import zmq

from jupyter_shard.env import RankEnv, pop_secrets
from jupyter_shard.rank.channel import Channel, ShellSocket
from jupyter_shard.rank.io_replies import serve_io
from jupyter_shard.rank.keep import watch_kernel, watch_owner
from jupyter_shard.rank.output import RankStream
from jupyter_shard.rank.runner import CellState, Runner
from jupyter_shard.wire.protocol import io_identity, rank_identity


def _log_path(env: RankEnv) -> str:
    """The rank's log file: named by the pool, or (started by an agent) in the pool's log directory."""
    return env.log or os.path.join(env.rank_logs or ".", f"rank-{env.rank}.log")


def _log_to_own_file(path: str) -> None:
    """A rank started by an agent writes its output (native too) to its own log, as local ranks do."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    env = RankEnv.from_env(os.environ)
    pop_secrets(os.environ)
    key, curve, rank = bytes.fromhex(env.key), env.curve, env.rank  # curve: ranks that dial back over TCP
    if curve:
        _log_to_own_file(_log_path(env))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    channel = Channel(ctx, env.address, key, io_identity(rank), curve)
    shell_sock = ShellSocket(ctx, env.address, key, rank_identity(rank), curve)
    if env.direct:
        shell_sock.connect_direct(env.direct)
    if env.lifeline_fd is not None:  # started here: live while the kernel does, or a kept pool's lease
        watch_owner(env.lifeline_fd, env.parent_pid or os.getppid(), shell_sock.monitor(), rank)
    else:  # started by an agent: live while the agent and the kernel connection do
        watch_kernel(shell_sock.monitor(), os.getppid(), rank)
    state = CellState()
    log = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace")
    lock = threading.Lock()
    sys.stdout = RankStream("stdout", log, channel.enqueue, lambda: state.cell_id, lock)
    sys.stderr = RankStream("stderr", log, channel.enqueue, lambda: state.cell_id, lock)
    channel.flushers.extend([sys.stdout.flush, sys.stderr.flush])
    serve_io(channel, state)
    channel.start()
    sys.argv = [""]
    try:
        runner = _start_up(env, channel, shell_sock, state)
    except BaseException:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        channel.close()
        shell_sock.send("startup_failed", {"rank": rank, "traceback": tb})
        time.sleep(0.2)
        os._exit(1)
    runner.loop()


def _start_up(env: RankEnv, channel: Channel, shell_sock: ShellSocket, state: CellState) -> Runner:
    from jupyter_shard.rank import shard as shard_module
    from jupyter_shard.rank.device import select_device
    from jupyter_shard.rank.group import PoolGroup
    from jupyter_shard.rank.integrations import install as install_integrations
    from jupyter_shard.rank.shell import RankShell
    from jupyter_shard.rank.stdin import RankStdin

    rank, local_rank, world_size = env.rank, env.local_rank, env.world_size
    device, backend = select_device(rank, local_rank, env.device)
    # A CUDA rank's group is bound to its GPU: NCCL starts (and fails) here, not in the first collective.
    device_id = device if device.type == "cuda" else None
    group = PoolGroup(backend, device.type, rank, world_size, env.timeout, device_id=device_id)
    state.group = group
    if env.store is not None:
        group.build_on_file(env.store)
    else:  # started by torchrun: node 0 agent's store (static rendezvous), a prefix per process group
        from torch.distributed.rendezvous import rendezvous

        timeout = timedelta(seconds=env.timeout)
        store, _, _ = next(rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        group.agent_store = store
        group.build_on_prefix("jupyter_shard/group-0/")
    group.install()
    install_integrations(device.type)
    helper = shard_module.Shard(
        rank, local_rank, world_size, device, env.strategy, channel.enqueue, dict(env.options)
    )
    shard_module.set_current(helper)
    group.on_rebuilt = helper.group_rebuilt
    channel.flushers.append(helper.flush_metrics)
    shell = RankShell.create(channel, {"shard": helper, "__name__": "__main__"})
    shell_sock.send(
        "ready",
        {
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": str(device),
            "log_path": _log_path(env),
            "node": env.node_index,
            "job": os.environ.get("SLURM_JOB_ID", ""),
        },
    )
    shell.rank = rank
    runner = Runner(rank, channel, shell_sock, state, shell, group)
    RankStdin(rank, shell_sock, channel, state, runner.while_waiting).install()
    return runner
