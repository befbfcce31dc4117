"""jupyter_shard.launchers.commands: the options every torchrun agent is started with."""

from __future__ import annotations

from jupyter_shard.launchers.commands import agent_args as torchrun_args


def test_torchrun_args_shape() -> None:
    args = torchrun_args("2", 3, "h:29400", "rid")
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs == {
        "--nnodes": "2",
        "--nproc-per-node": "3",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "h:29400",
        "--rdzv-id": "rid",
        "--max-restarts": "0",
        "--monitor-interval": "0.1",
    }
