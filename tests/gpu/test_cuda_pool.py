"""GPU ranks: one pinned CUDA device per rank, NCCL all-reduce, CUDA memory in status and shard.memory().

Skipped where no CUDA device is visible; run with ``pytest -m gpu`` on a GPU machine.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from jupyter_shard.spec import visible_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(visible_gpus() == 0, reason="no CUDA device visible"),
]


def test_nccl_pool_pins_one_device_per_rank(tmp_path: Path) -> None:
    from jupyter_shard import Pool
    from jupyter_shard.kernel.output import ConsoleSink

    n = visible_gpus()
    with Pool(
        nproc=n,
        device="cuda",
        strategy="ddp",
        log_dir=tmp_path,
        sink=ConsoleSink(io.StringIO(), io.StringIO()),
    ) as pool:
        result = pool.run(
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1, device=shard.device) * (shard.rank + 1)\n"
            "dist.all_reduce(t)\n"
            "(dist.get_backend(), torch.cuda.current_device(), str(shard.device), t.item())"
        )
        expected_sum = float(sum(range(1, n + 1)))
        for rank, r in result.ranks.items():
            assert r.result == {"text/plain": f"('nccl', {rank}, 'cuda:{rank}', {expected_sum})"}
        pool.run("x = torch.zeros(1024, 1024, device=shard.device); m = shard.memory()")
        memory = pool.pull("m")
        assert memory["cuda_allocated"] >= 4 * 1024 * 1024
        assert all("cuda_allocated" in row.memory for row in pool.status())


def test_ddp_training_step_on_gpu(tmp_path: Path) -> None:
    from jupyter_shard import Pool
    from jupyter_shard.kernel.output import ConsoleSink

    n = visible_gpus()
    with Pool(
        nproc=n,
        device="cuda",
        strategy="ddp",
        log_dir=tmp_path,
        sink=ConsoleSink(io.StringIO(), io.StringIO()),
    ) as pool:
        pool.run(
            "import torch\nmodel = torch.nn.Linear(16, 1)\n"
            "opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
            "model, opt = shard.prepare(model, opt)\n"
            "for _ in range(5):\n"
            "    loss = model(torch.randn(32, 16, device=shard.device)).pow(2).mean()\n"
            "    shard.backward(loss); shard.step(); shard.log(loss=loss)\n"
            "checksum = float(sum(p.sum() for p in model.parameters()))"
        )
        sums = pool.pull_all("checksum")
        assert len(set(sums.values())) == 1


def test_dashboard_shows_cuda_memory_from_heartbeats(tmp_path: Path) -> None:
    import time

    from jupyter_shard import Pool
    from jupyter_shard.kernel.output import ConsoleSink
    from jupyter_shard.notebook.dashboard import render

    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(nproc=1, device="cuda", log_dir=tmp_path, sink=sink) as pool:
        pool.run("import torch\nx = torch.zeros(64, 1024, 1024, device=shard.device)")  # 256 MiB
        time.sleep(2.5)  # two heartbeats
        (row,) = pool.activity()
        assert row.memory["cuda_allocated"] >= 256 * 2**20
        assert row.memory["cuda_total"] >= row.memory["cuda_free"] > 0
        markup = render(pool, compact=False)
        assert "memory per rank: CUDA allocated, MiB" in markup and "cuda 256 / " in markup
