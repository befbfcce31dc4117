"""jupyter_shard.launchers.commands: the options every torchrun agent is started with."""

from __future__ import annotations

import pytest

from jupyter_shard.launchers.commands import agent_args as torchrun_args
from jupyter_shard.launchers.commands import torchrun_line
from jupyter_shard.spec import LaunchSpec


def test_torchrun_args_shape() -> None:
    args = torchrun_args("2", 3, "1", "h", "29400", "rid")
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs == {
        "--nnodes": "2",
        "--nproc-per-node": "3",
        "--rdzv-backend": "static",  # c10d's dynamic rendezvous pickles its state into the store
        "--node-rank": "1",
        "--master-addr": "h",
        "--master-port": "29400",
        "--rdzv-id": "rid",
        "--max-restarts": "0",
        "--monitor-interval": "0.1",
    }


def test_torchrun_line_keeps_the_chosen_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = LaunchSpec.create(gpus="0,2", gpu_count=4)
    assert torchrun_line(spec, "x.py") == "CUDA_VISIBLE_DEVICES=0,2 torchrun --nproc-per-node 2 x.py"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the notebook's own visible set
    assert torchrun_line(spec, "x.py").startswith("CUDA_VISIBLE_DEVICES=4,6 torchrun")
    assert torchrun_line(LaunchSpec.create(gpus=2, gpu_count=4), "x.py") == "torchrun --nproc-per-node 2 x.py"
