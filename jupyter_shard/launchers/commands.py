"""The command lines of the multi-node launchers, built once from a spec.

The torchrun and SLURM launchers run these commands, and ``%dist_export`` writes the same ones into
the header of an exported script and into its sbatch file, so a pool and its exported script ask
torch and SLURM for the same things. Everything here is pure: it builds lists and strings from a
:class:`~jupyter_shard.spec.LaunchSpec` and starts nothing.
"""

from __future__ import annotations

import os
import sys

from jupyter_shard.spec import LaunchSpec

__all__ = [
    "EXPORT_RDZV_PORT",
    "agent_args",
    "agent_command",
    "rendezvous_args",
    "torchrun_line",
]

EXPORT_RDZV_PORT = 29500  # the port an exported script's header suggests for a hand-started rendezvous


def rendezvous_args(nodes: str, nproc: int, endpoint: str, rdzv_id: str) -> list[str]:
    """torch.distributed.run's options for one agent of ``nodes`` meeting through c10d on ``endpoint``."""
    return [
        "--nnodes",
        nodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
    ]


def agent_args(nodes: str, nproc: int, endpoint: str, rdzv_id: str) -> list[str]:
    """The options of an agent a pool starts: a lost rank is not restarted, and is seen at once."""
    return [
        *rendezvous_args(nodes, nproc, endpoint, rdzv_id),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
    ]


def agent_command(options: list[str]) -> list[str]:
    """The node agent a pool starts: this interpreter's torch.distributed.run, running rank runtimes."""
    return [sys.executable, "-m", "torch.distributed.run", *options, "-m", "jupyter_shard.rank"]


def torchrun_line(spec: LaunchSpec, target: str, wrap: str = " ") -> str:
    """``torchrun ... target`` as a person runs it on each node (HEAD: the first node's address);
    ``wrap`` goes between the rendezvous options and the rest (a shell line continuation)."""
    if spec.nodes == 1:
        # a local pool on chosen GPUs (--gpus 0,2): the script runs on the same devices
        chosen = spec.gpus and spec.rank_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        devices = f"CUDA_VISIBLE_DEVICES={chosen} " if chosen else ""
        return f"{devices}torchrun --nproc-per-node {spec.nproc} {target}"
    return multi_node_torchrun_line(str(spec.nodes), spec.nproc, target, wrap)


def multi_node_torchrun_line(nodes: str, nproc: int, target: str, wrap: str = " ") -> str:
    """``torchrun --nnodes N ... target`` with the placeholders HEAD and RUN for the person to fill."""
    args = rendezvous_args(nodes, nproc, f"HEAD:{EXPORT_RDZV_PORT}", "RUN")
    return f"torchrun {' '.join(args[:6])}{wrap}{' '.join(args[6:])} {target}"
