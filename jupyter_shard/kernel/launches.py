"""The environment each rank process starts with: torchrun's variables and the pool's own orders.

The pool's orders are a :class:`~jupyter_shard.env.RankEnv`; around them go what any rank process
needs (loopback interfaces for gloo and NCCL, unbuffered output, this package on the path, a share
of the CPU threads).
"""

from __future__ import annotations

import os
from pathlib import Path

from jupyter_shard._curve import CurveKeys
from jupyter_shard._net import loopback_interface
from jupyter_shard.env import CHECK_PROTOCOL_VAR, RankEnv, without_pool_variables
from jupyter_shard.launchers import RankLaunch
from jupyter_shard.protocol import MAX_FRAME
from jupyter_shard.spec import LaunchSpec


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
) -> RankLaunch:
    """Everything the launcher needs to start ``rank``: its environment, log file and directory."""
    nproc = spec.world_size
    log_path = log_dir / f"rank-{rank}.log"
    package_root = str(Path(__file__).resolve().parent.parent.parent)
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
    )
    env = without_pool_variables(os.environ)
    env.update(
        {
            "GLOO_SOCKET_IFNAME": loopback_interface(),
            "NCCL_SOCKET_IFNAME": loopback_interface(),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p),
        }
    )
    env.update(orders.to_env())
    per_host = spec.nproc  # ranks sharing this rank's machine
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as torchrun sets it
    # Rich (Lightning's default progress bar) redraws live only on a terminal; a cell shows its
    # redraws as one live line per rank, as it does tqdm's.
    env.setdefault("TTY_COMPATIBLE", "1")
    env.setdefault("TTY_INTERACTIVE", "1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // per_host)))
    return RankLaunch(rank=rank, env=env, log_path=log_path, cwd=Path.cwd())
