"""The environment each rank process starts with: torchrun's variables and the pool's own orders."""

from __future__ import annotations

import json
import os
from pathlib import Path

from jupyter_shard._curve import CURVE_ENV, CurveKeys
from jupyter_shard._net import loopback_interface
from jupyter_shard.launchers import RankLaunch
from jupyter_shard.protocol import KEY_ENV, MAX_FRAME
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_SHARD_")}
    nproc = spec.world_size
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": loopback_interface(),
            "NCCL_SOCKET_IFNAME": loopback_interface(),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p),
            KEY_ENV: key.hex(),
            "JUPYTER_SHARD_ADDRESS": address,
            "JUPYTER_SHARD_STORE": str(pool_dir / "store"),
            "JUPYTER_SHARD_MAX_FRAME": str(MAX_FRAME),  # one message limit on both ends
            "JUPYTER_SHARD_LIFELINE_FD": str(lifeline_fd),
            "JUPYTER_SHARD_PARENT_PID": str(os.getpid()),
            "JUPYTER_SHARD_DEVICE": spec.device.value,
            "JUPYTER_SHARD_STRATEGY": spec.strategy,
            "JUPYTER_SHARD_OPTIONS": json.dumps(spec.rank_options()),
            "JUPYTER_SHARD_TIMEOUT": str(spec.timeout),
            "JUPYTER_SHARD_LOG": str(log_dir / f"rank-{rank}.log"),
        }
    )
    if curve is not None:  # started by an agent: no lifeline fd, no FileStore, its own log file
        env[CURVE_ENV] = curve.client_env()
        env["JUPYTER_SHARD_RANK_LOGS"] = str(log_dir)
    per_host = spec.nproc  # ranks sharing this rank's machine
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // per_host)))
    return RankLaunch(rank=rank, env=env, log_path=log_dir / f"rank-{rank}.log", cwd=Path.cwd())
