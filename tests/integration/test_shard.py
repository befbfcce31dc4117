"""``shard`` inside ranks: DDP training keeps replicas equal, the optimizer is rebuilt, metrics reach
the kernel, dataloaders are split, checkpoints are atomic and restore state."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from jupyter_shard import Pool, PoolError
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.strategies.base import StrategyBase

pytestmark = pytest.mark.timeout(180)

TRAIN = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
model, opt, loader = shard.prepare(model, opt, loader)
torch.manual_seed(100 + shard.rank)   # different data order per rank from here on
for epoch in range(2):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        shard.backward(loss)
        shard.step()
        shard.log(loss=loss)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(nproc=2, device="cpu", strategy="ddp", log_dir=tmp_path_factory.mktemp("logs"), sink=sink) as p:
        p.run(TRAIN)
        yield p


def test_prepare_wraps_in_ddp_and_rebuilds_the_optimizer(pool: Pool) -> None:
    result = pool.run(
        "(type(model).__name__, type(opt).__name__, opt.defaults['lr'], opt.defaults['momentum'],"
        " all(p is q for p, q in zip(opt.param_groups[0]['params'], model.parameters())),"
        " isinstance(loader.sampler, torch.utils.data.DistributedSampler), len(loader))"
    )
    assert result.value == {"text/plain": "('DistributedDataParallel', 'SGD', 0.05, 0.9, True, True, 4)"}


def test_replicas_stay_identical_after_training(pool: Pool) -> None:
    pool.run("checksum = float(sum(p.detach().double().sum() for p in model.parameters()))")
    sums = pool.pull_all("checksum")
    assert sums[0] == sums[1]
    moved = pool.run("first = next(iter(loader)); first[0].sum().item()")
    per_rank = {k: r.result for k, r in moved.ranks.items()}
    assert per_rank[0] != per_rank[1], "each rank should see its own shard of the data"


def test_metrics_reach_the_kernel(pool: Pool) -> None:
    records = [r for r in pool.history if "loss" in r]
    assert {r["rank"] for r in records} == {0, 1}
    assert len([r for r in records if r["rank"] == 0]) == 8
    assert all(isinstance(r["loss"], float) for r in records)
    steps = [r["step"] for r in records if r["rank"] == 1]
    assert steps == list(range(1, 9))


def test_helpers_print0_memory_barrier(pool: Pool) -> None:
    result = pool.run("shard.print0('only rank 0'); shard.barrier(); m = shard.memory(); sorted(m)")
    assert result.ranks[0].stdout == "only rank 0\n" and result.ranks[1].stdout == ""
    assert result.value == {"text/plain": "['gradients', 'optimizer', 'parameters', 'rss']"}
    memory = pool.pull("m")
    parameters = (4 * 8 + 8 + 8 * 1 + 1) * 4
    assert memory["parameters"] == parameters
    assert memory["optimizer"] == parameters, "SGD with momentum keeps one buffer per parameter"


def test_save_is_atomic_and_load_restores(pool: Pool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "model.pt"
    pool.run(f"shard.save({str(path)!r}); saved = [p.detach().clone() for p in model.parameters()]")
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"], "no temporary files left behind"
    pool.run("with torch.no_grad():\n    for p in model.parameters(): p.add_(1.0)")
    pool.run(
        f"shard.load({str(path)!r})\n"
        "restored = all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))"
    )
    assert pool.pull_all("restored") == {0: True, 1: True}


def test_gather_and_consolidate_give_a_plain_module(pool: Pool, tmp_path: Path) -> None:
    import torch
    from torch import nn

    from jupyter_shard import consolidate

    plain = pool.pull("model", gather=True)
    assert isinstance(plain, nn.Sequential)
    batch = torch.randn(5, 4)
    pool.push(batch=batch)
    expected = pool.run("model(batch).detach()").value
    assert expected is not None
    got = plain(batch).detach()
    assert expected["text/plain"] == repr(got)

    ckpt = tmp_path / "ddp.pt"
    pool.run(f"shard.save({str(ckpt)!r})")
    out = consolidate(ckpt, tmp_path / "full.pt")
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    fresh.load_state_dict(torch.load(out))
    assert torch.equal(fresh(batch), got)
    with pytest.raises(PoolError, match=r"--gather applies to the model returned by shard\.prepare"):
        pool.pull("opt", gather=True)


class HalfStep(StrategyBase):
    """A custom strategy as a user would write one: plain training with the step scaled by a factor."""

    name = "halfstep"
    accepts = frozenset({"factor"})

    def step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        for group in optimizer.param_groups:
            group["lr"] *= self.options["factor"]
        super().step(optimizer, model)


def test_strategy_registered_in_the_kernel_runs_on_the_ranks(tmp_path: Path) -> None:
    import cloudpickle

    from jupyter_shard import register_strategy
    from jupyter_shard.strategies import _registered

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as for classes defined in a notebook
    register_strategy("halfstep", HalfStep, factor=0.5)
    try:
        sink = ConsoleSink(io.StringIO(), io.StringIO())
        with Pool(nproc=2, device="cpu", strategy="halfstep", log_dir=tmp_path, sink=sink) as p:
            result = p.run(
                "import torch\nm = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(m.parameters(), lr=1.0)\n"
                "m, opt = shard.prepare(m, opt)\nshard.backward(m(torch.ones(1, 2)).sum()); shard.step()\n"
                "(type(shard.impl).__name__, opt.param_groups[0]['lr'])"
            )
            assert result.value == {"text/plain": "('HalfStep', 0.5)"}
    finally:
        _registered.pop("halfstep")


def test_strategy_installed_through_an_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site package declaring ``[jupyter_shard.strategies]`` is a valid --strategy in kernel and ranks."""
    site = tmp_path / "site"
    (site / "site_strategy-1.0.dist-info").mkdir(parents=True)
    (site / "site_strategy-1.0.dist-info" / "METADATA").write_text("Name: site-strategy\nVersion: 1.0\n")
    (site / "site_strategy-1.0.dist-info" / "entry_points.txt").write_text(
        "[jupyter_shard.strategies]\nsitewide = site_strategy:SiteStrategy\n"
    )
    (site / "site_strategy.py").write_text(
        "from jupyter_shard.strategies.base import StrategyBase\n"
        "class SiteStrategy(StrategyBase):\n    name = 'sitewide'\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    from jupyter_shard import LaunchSpec
    from jupyter_shard.strategies import available_strategies

    assert "sitewide" in available_strategies()
    spec = LaunchSpec.create(nproc=2, device="cpu", strategy="sitewide")
    with Pool(spec=spec, log_dir=tmp_path / "logs", sink=ConsoleSink(io.StringIO(), io.StringIO())) as p:
        result = p.run("import torch\nshard.prepare(torch.nn.Linear(2, 2))\ntype(shard.impl).__name__")
        assert result.value == {"text/plain": "'SiteStrategy'"}
