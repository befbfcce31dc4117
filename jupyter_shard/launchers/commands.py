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
    "AGENT_MODULE",
    "EXPORT_RDZV_PORT",
    "agent_args",
    "agent_command",
    "rendezvous_args",
    "torchrun_line",
]

EXPORT_RDZV_PORT = 29500  # the port an exported script's header suggests for a hand-started rendezvous
AGENT_MODULE = "jupyter_shard.launchers.node_agent"  # torch.distributed.run, its store bound to one address


def rendezvous_args(nodes: str, nproc: int, node_rank: str, head: str, port: str, run_id: str) -> list[str]:
    """torch.distributed.run's options for node ``node_rank`` of ``nodes`` meeting at ``head:port``.

    The rendezvous is torch's static one: every node is told its index, node 0 hosts a TCPStore and the
    others connect to it. Nothing in it is pickled (c10d's dynamic rendezvous pickles its state into
    the store, where anyone who reaches the port can replace it with code every agent then runs)."""
    return [
        "--nnodes",
        nodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "static",
        "--node-rank",
        node_rank,
        "--master-addr",
        head,
        "--master-port",
        port,
        "--rdzv-id",
        run_id,
    ]


def agent_args(nodes: str, nproc: int, node_rank: str, head: str, port: str, run_id: str) -> list[str]:
    """The options of an agent a pool starts: a lost rank is not restarted, and is seen at once."""
    return [
        *rendezvous_args(nodes, nproc, node_rank, head, port, run_id),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
    ]


def agent_command(options: list[str]) -> list[str]:
    """The node agent a pool starts: torch.distributed.run in this interpreter, running rank runtimes,
    through :data:`AGENT_MODULE`, which binds node 0's store to the head address alone."""
    return [sys.executable, "-m", AGENT_MODULE, *options, "-m", "jupyter_shard.rank"]


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
    """``torchrun --nnodes N ... target`` with the placeholders NODE (this node's index, 0 on the first
    node), HEAD (the first node's address) and RUN (any name the nodes share) for the person to fill."""
    args = rendezvous_args(nodes, nproc, "NODE", "HEAD", str(EXPORT_RDZV_PORT), "RUN")
    return f"torchrun {' '.join(args[:6])}{wrap}{' '.join(args[6:])} {target}"
