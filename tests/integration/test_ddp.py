"""``ddp`` and ``none`` against a single-process reference, and their checkpoints (2 CPU ranks, gloo).

Each rank trains on its half of a fixed global batch; the single-process reference trains on the
whole batch in the same cell. The optimizer is built on the unwrapped model before ``prepare``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_shard import LaunchSpec, Pool
from jupyter_shard.pool.output import ConsoleSink
from tests.integration.training_cells import LOSS_PARITY, SETUP

pytestmark = pytest.mark.timeout(300)


def _pool(tmp: Path, **options: object) -> Pool:
    spec = LaunchSpec.create(nproc=2, device="cpu", **options)  # type: ignore[arg-type]
    return Pool(spec=spec, log_dir=tmp, sink=ConsoleSink(io.StringIO(), io.StringIO()))


@pytest.fixture(
    scope="module",
    params=[("ddp", "32", 1e-5), ("ddp", "bf16-mixed", 2e-2)],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def trained(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Pool, float]]:
    strategy, precision, tolerance = request.param
    with _pool(tmp_path_factory.mktemp("logs"), strategy=strategy, precision=precision) as pool:
        pool.run(SETUP + LOSS_PARITY)
        yield pool, tolerance


def test_losses_match_a_single_process_reference(trained: tuple[Pool, float]) -> None:
    pool, tolerance = trained
    rel = pool.pull("rel")
    assert rel <= tolerance, f"relative loss difference {rel:.3g} over {tolerance}"
    assert pool.pull_all("losses")[0] == pool.pull_all("losses")[1]


def test_checkpoint_survives_a_restart_and_a_save_that_dies(
    trained: tuple[Pool, float], tmp_path: Path
) -> None:
    pool, _ = trained
    ckpt = tmp_path / "model.pt"
    pool.run(f"shard.save({str(ckpt)!r}); before = fixed_loss()")
    before = pool.pull("before")
    # A second save killed mid-write: the process dies inside torch.save, after the file is opened.
    with pytest.raises(Exception, match="exited with code 9"):
        pool.run(
            "import os\n"
            "with torch.no_grad():\n    [p.add_(1.0) for p in model.parameters()]\n"
            "def dying_save(obj, f, *a, **k):\n    f.write(b'partial'); f.flush(); os._exit(9)\n"
            "torch.save = dying_save\n"
            f"shard.save({str(ckpt)!r})"
        )
    assert sorted(p.name for p in ckpt.parent.iterdir() if not p.name.startswith(".")) == ["model.pt"]
    pool.restart()
    pool.run(
        SETUP + f"model, opt = shard.prepare(net, opt)\nshard.load({str(ckpt)!r})\nloaded = fixed_loss()"
    )
    assert pool.pull_all("loaded") == {0: before, 1: before}


@pytest.mark.parametrize("options", [{"comm_hook": "powersgd"}, {"comm_hook": "fp16"}])
def test_ddp_options_train_and_keep_replicas_equal(tmp_path: Path, options: dict[str, object]) -> None:
    import json

    config = tmp_path / "ddp.json"
    config.write_text(json.dumps(options))
    with _pool(tmp_path, strategy="ddp", config=config) as pool:
        pool.run(
            "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
            "net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))\n"
            "opt = torch.optim.SGD(net.parameters(), lr=0.1)\nmodel, opt = shard.prepare(net, opt)\n"
            "for step in range(4):\n"
            "    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + shard.rank))\n"
            "    shard.backward(model(x).pow(2).mean()); shard.step()\n"
            "norm_type = type(model.module[1]).__name__\n"
            "checksum = float(sum(p.double().sum() for p in model.parameters()))"
        )
        sums = pool.pull_all("checksum")
        assert sums[0] == sums[1]
        assert pool.pull("norm_type") == "BatchNorm1d"
        for bad, message in [
            ({"sync_batchnorm": True}, "ddp sync_batchnorm needs CUDA ranks"),
            ({"comm_hook": "bf16"}, "ddp comm_hook 'bf16' needs CUDA ranks with NCCL"),
        ]:
            config.write_text(json.dumps(bad))
            pool.restart()
            with pytest.raises(Exception, match=message):
                pool.run("import torch\nshard.prepare(torch.nn.Linear(2, 2))")


def test_accumulation_and_clipping_match_one_process(tmp_path: Path) -> None:
    """accumulate=2 over two half-batches equals one step on the whole batch; clipping bounds the norm."""
    with _pool(tmp_path, strategy="ddp", accumulate=2, clip_grad_norm=0.05) as pool:
        pool.run(
            SETUP + "ref = copy.deepcopy(net)\n"
            "ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)\n"
            "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
            "x, y = batches[0]\n"
            "nn.functional.mse_loss(ref(x), y).backward()\n"
            "ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)); ref_opt.step()\n"
            "model, opt = shard.prepare(net, opt)\n"
            "mx, my = mine(x), mine(y)\n"
            "for half in (slice(0, 2), slice(2, 4)):\n"
            "    shard.backward(nn.functional.mse_loss(model(mx[half]), my[half])); shard.step()\n"
            "steps = shard.global_step\n"
            "pairs = zip(model.module.parameters(), ref.parameters())\n"
            "diff = max(float((a - b).abs().max()) for a, b in pairs)"
        )
        assert pool.pull("steps") == 1
        assert pool.pull("ref_norm") > 0.05, "the test must actually clip"
        assert pool.pull_all("diff") == {0: pytest.approx(0.0, abs=1e-6), 1: pytest.approx(0.0, abs=1e-6)}
