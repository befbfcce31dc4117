"""The environment each rank process starts with: torchrun's variables and the pool's own orders.

The pool's orders are a :class:`~jupyter_shard.env.RankEnv`; around them go what any rank process
needs (loopback interfaces for gloo and NCCL, unbuffered output, this package on the path, a share
of the CPU threads, and :data:`NCCL_KEEP_RANKS_ALIVE`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from jupyter_shard._util.net import loopback_interface
from jupyter_shard.env import CHECK_PROTOCOL_VAR, RankEnv, without_pool_variables
from jupyter_shard.launchers import RankLaunch, zygote
from jupyter_shard.spec import LaunchSpec
from jupyter_shard.wire.curve import CurveKeys
from jupyter_shard.wire.protocol import MAX_FRAME

NCCL_KEEP_RANKS_ALIVE: Mapping[str, str] = MappingProxyType(
    {
        # 0: the watchdog only records a collective that passed the process group's timeout (the
        # group's get_error() says TIMEOUT); the collective goes on and completes when the slow rank
        # arrives. torch's default, 3, and torchrun's 1 end the whole rank process instead (and 2
        # aborts the communicators): a checkpoint written by rank 0 while the others wait in
        # barrier() would kill them, even between cells. The pool's own heartbeats say at once who
        # waits where, and its escalation aborts a group that is really stuck (torch documents
        # _abort_process_group for use with this variable at 0).
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        # 0: the heartbeat monitor thread never ends the process. With 1 (the default) it does so when
        # the watchdog makes no progress for TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 min), which a
        # device-side assert or a long CUDA sync can cause, and after any timeout dump.
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        # 0: no flight-recorder dump on a timeout. With 1 (the default) a timeout on any rank makes
        # every rank's monitor dump to files in /tmp and then leave its loop, after which (with
        # monitoring on) it ends the process; the pool's %dist_stacks and heartbeats cover the need.
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        # 1000: after finding a failed or timed-out collective the watchdog sleeps four times this
        # (default 15000 ms: a minute) to let dumps finish, holding the lock every new collective
        # takes; with no dump to wait for, 4 s.
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
        # 0: a CUDA error seen by the watchdog (a device-side assert in the cell) ends the watchdog
        # thread with a log line instead of terminating the rank from it; the cell's own error says
        # what happened, and the rank stays up to answer %dist_status and %dist_stacks until
        # %dist_restart replaces it (a CUDA error of that kind lasts for the life of the process).
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    }
)
"""NCCL settings that keep a rank alive through a slow collective or a CUDA error; the names and
defaults are torch's (``torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp``). A value already in the
kernel's environment wins. They matter only to ranks with an NCCL group; CPU ranks ignore them."""


def rank_launch(
    spec: LaunchSpec,
    rank: int,
    *,
    address: str,
    key: bytes,
    lifeline_fd: int,
    master_port: int,
    curve: CurveKeys | None,
    pool_dir: Path,
    log_dir: Path,
    direct: str | None = None,
) -> RankLaunch:
    """Everything the launcher needs to start ``rank``: its environment, log file and directory."""
    nproc = spec.world_size
    log_path = log_dir / f"rank-{rank}.log"
    agent_started = curve is not None  # no lifeline fd, no FileStore, its own log file
    orders = RankEnv(
        rank=rank,
        local_rank=rank,
        world_size=nproc,
        local_world_size=nproc,
        master_port=master_port,
        key=key.hex(),
        address=address,
        max_frame=MAX_FRAME,
        device=spec.device.value,
        strategy=spec.strategy,
        timeout=spec.timeout,
        options=spec.rank_options(),
        store=str(pool_dir / "store"),
        lifeline_fd=lifeline_fd,
        parent_pid=os.getpid(),
        log=str(log_path),
        curve=curve.client_env() if curve is not None else None,
        rank_logs=str(log_dir) if agent_started else None,
        check_protocol=os.environ.get(CHECK_PROTOCOL_VAR) or None,
        run_id=pool_dir.name,
        error_file=str(log_dir / f"rank-{rank}-error.json"),
        direct=direct,
    )
    env = shared_env(spec.nproc, orders.to_env())
    return RankLaunch(rank=rank, env=env, log_path=log_path, cwd=Path.cwd(), pool_dir=pool_dir)


def shared_env(per_host: int, orders: dict[str, str] | None = None) -> dict[str, str]:
    """A rank's environment: this process's, less its pool variables, with what every rank of a pool
    of ``per_host`` ranks on a machine shares, and its ``orders`` (a rank's own)."""
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    env = without_pool_variables(os.environ)
    env.update(
        {
            "GLOO_SOCKET_IFNAME": loopback_interface(),
            "NCCL_SOCKET_IFNAME": loopback_interface(),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p),
        }
    )
    env.update(orders or {})
    for name, value in NCCL_KEEP_RANKS_ALIVE.items():
        env.setdefault(name, value)
    # Rich (Lightning's default progress bar) redraws live only on a terminal; a cell shows its
    # redraws as one live line per rank, as it does tqdm's.
    env.setdefault("TTY_COMPATIBLE", "1")
    env.setdefault("TTY_INTERACTIVE", "1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // per_host)))
    return env


def warm_zygote(spec: LaunchSpec) -> None:
    """Start now the zygote that the next start of this local pool forks its ranks from. A kernel
    that attached to a kept pool has none, and its first restart would otherwise wait (about 2 s on
    CPU) for one to import torch."""
    if spec.launcher == "local" and zygote.enabled():
        zygote.zygote_for(shared_env(spec.nproc))
