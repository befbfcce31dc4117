"""Strategies on GPUs: NCCL, bf16, CUDA memory. Skipped where no CUDA device is visible."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from jupyter_shard.spec import visible_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(visible_gpus() == 0, reason="no CUDA device visible"),
]

TRAIN = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = shard.prepare(model, opt)
x = torch.randn(32, 1024, device=shard.device)
for _ in range(3):
    loss = model(x).float().pow(2).mean()
    shard.backward(loss); shard.step()
out_dtype = str(model(x).dtype)
mem = shard.memory()
"""


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("ddp", {}), ("fsdp", {}), ("deepspeed", {"zero_stage": 2}), ("deepspeed", {"zero_stage": 3})],
    ids=["ddp", "fsdp", "zero2", "zero3"],
)
def test_bf16_training_on_gpu_reports_cuda_memory(
    tmp_path: Path, strategy: str, extra: dict[str, int]
) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    from jupyter_shard import LaunchSpec, Pool
    from jupyter_shard.kernel.output import ConsoleSink

    spec = LaunchSpec.create(
        nproc=visible_gpus(), device="cuda", strategy=strategy, precision="bf16-mixed", **extra
    )
    with Pool(spec=spec, log_dir=tmp_path, sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool:
        pool.run(TRAIN)
        assert pool.pull("out_dtype") == "torch.bfloat16"
        mem = pool.pull("mem")
        assert mem["cuda_allocated"] > 0 and mem["cuda_peak"] >= mem["cuda_allocated"]
        assert mem["parameters"] > 0
