"""Suspend and resume on CPU ranks: the next steps after a resume at the same world size are the ones
an uninterrupted pool takes, to the bit (ddp, fsdp); at another world size the gathered parameters
are the suspended ones and training goes on; the magics in a real kernel."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from jupyter_shard import Pool
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.pool.suspend import resume, suspend
from jupyter_shard.spec import LaunchSpec

pytestmark = pytest.mark.timeout(300)

# A model with a non-persistent buffer, AdamW, a scheduler that refers to the optimizer, per-rank
# data, a generator (cannot be kept) and logged metrics; three steps before the suspend.
SETUP = """
import torch, torch.nn as nn
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.register_buffer("scale", torch.arange(1.0, 5.0), persistent=False)
    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale
net = Net()
opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
model, opt = shard.prepare(net, opt)
sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5) if shard.strategy != "deepspeed" else None
g = torch.Generator().manual_seed(shard.rank)
data = [torch.randn(4, 8, generator=g) for _ in range(8)]
def train(i):
    loss = model(data[i]).pow(2).mean()
    shard.backward(loss)
    shard.step()
    if sched is not None:
        sched.step()
    shard.log(loss=loss)
    return loss.detach()
pending = (x for x in range(3))
for i in range(3):
    train(i)
"""
# The steps after the suspend: losses, a draw from the rank's generator, the scheduler's place.
NEXT = (
    "l3 = train(3); l4 = train(4); noise = torch.randn(3)\n"
    "where = (sched and sched.last_epoch, shard.global_step)"
)


def _pool(nproc: int, strategy: str) -> Pool:
    name, _, stage = strategy.partition("-zero")
    options = {"zero_stage": int(stage)} if stage else {}
    spec = LaunchSpec.create(nproc=nproc, device="cpu", strategy=name, **options)  # type: ignore[arg-type]
    return Pool(spec=spec, sink=ConsoleSink(io.StringIO(), io.StringIO()))


def _after(pool: Pool) -> dict[int, dict[str, Any]]:
    pool.run(NEXT)
    return {r: {k: pool.pull(k, r) for k in ("l3", "l4", "noise", "where")} for r in range(pool.world_size)}


@pytest.fixture(scope="module", params=["ddp", "fsdp", "deepspeed-zero3"])
def suspended(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(strategy, directory, what an uninterrupted pool computes next, the gathered weights)."""
    strategy = request.param
    directory = tmp_path_factory.mktemp("suspend") / "run"
    with _pool(2, strategy) as reference:
        reference.run(SETUP)
        weights = reference.pull("model", gather=True).state_dict()
        expected = _after(reference)
    with _pool(2, strategy) as pool:
        pool.run(SETUP)
        report = suspend(pool, directory)
        assert not pool.started  # the ranks ended
    yield strategy, directory, expected, weights, report


def test_suspend_reports_what_it_kept_and_what_it_could_not(suspended: Any) -> None:
    strategy, directory, _, _, report = suspended
    assert report.prepared and report.world_size == 2 and report.strategy == strategy.partition("-")[0]
    assert {"net", "model", "opt", "sched", "data", "train", "Net", "torch", "nn", "g"} <= set(report.kept)
    assert set(report.lost) == {"pending"} and "generator" in report.lost["pending"]
    assert "not kept: pending" in report.summary()
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and len(manifest["history"]) == 6  # 3 steps × 2 ranks
    assert sorted(p.name for p in directory.parent.iterdir()) == ["run"]  # no temporary left


def test_resume_at_the_same_world_size_continues_bit_for_bit(suspended: Any) -> None:
    _, directory, expected, _, _ = suspended
    pool, report = resume(directory)
    with pool:
        assert report.world_size == report.saved_world_size == 2 and report.lost == {}
        assert len(pool.history.records()) == 6  # the dashboard's history carries on
        got = _after(pool)
        same = "(sched is None or sched.optimizer is opt) and opt is shard.prepared_optimizer"
        assert pool.run(same).value == {"text/plain": "True"}
    for rank in (0, 1):
        for name in ("l3", "l4", "noise"):
            assert torch.equal(got[rank][name], expected[rank][name]), (rank, name)
        assert got[rank]["where"] == expected[rank]["where"]
        assert got[rank]["where"][1] == 5


def test_resume_at_another_world_size_has_the_suspended_weights_and_trains(suspended: Any) -> None:
    _, directory, _, weights, _ = suspended
    pool, report = resume(directory, {"nproc": 3})
    with pool:
        assert report.world_size == 3 and report.saved_world_size == 2
        assert "resharded" in report.summary()
        gathered = pool.pull("model", gather=True).state_dict()
        assert gathered.keys() == weights.keys()
        for key in weights:
            assert torch.equal(gathered[key], weights[key]), key
        pool.run(NEXT)  # every rank has rank 0's data and the optimizer's state for its shard
        assert pool.pull("where", 2)[1] == 5
        assert torch.isfinite(pool.pull("l4", 2))


def test_a_namespace_without_a_prepared_model_is_kept_too(tmp_path: Path) -> None:
    with _pool(2, "none") as pool:
        pool.run("import numpy as np\nxs = np.arange(3) * (shard.rank + 1)\nclass P:\n    v = 7\np = P()")
        report = suspend(pool, tmp_path / "plain")
    assert not report.prepared and {"np", "xs", "P", "p"} <= set(report.kept)
    pool, _ = resume(tmp_path / "plain")
    with pool:
        assert pool.pull("xs", 1).tolist() == [0, 2, 4]  # each rank its own namespace
        assert pool.run("p.v + P.v").value == {"text/plain": "14"}


def test_magics_suspend_and_resume_in_a_kernel(kernel: Any, tmp_path: Path) -> None:
    directory = tmp_path / "nb"
    assert kernel.execute("%load_ext jupyter_shard").ok
    run = kernel.execute(f"%%distributed --nproc 2 --strategy ddp\n{SETUP}")
    assert run.ok, run.error_text()
    run = kernel.execute(f"%dist_suspend {directory}")
    assert run.ok, run.error_text()
    assert f"suspended 2 ranks (ddp) to {directory}" in run.stream()
    assert "not kept: pending" in run.stream()
    run = kernel.execute(f"%dist_resume {directory} --nproc 3")
    assert run.ok, run.error_text()
    assert f"resumed {directory} on 3 ranks" in run.stream()
    run = kernel.execute("%%distributed\nprint(shard.world_size, shard.global_step, sched.last_epoch)")
    assert run.ok, run.error_text()
    assert sorted(line for line in run.stream().splitlines() if line.startswith("[rank")) == [
        f"[rank {r}] 3 3 3" for r in range(3)
    ]
    run = kernel.execute("%dist_resume --ranks 0")
    assert "UsageError: %dist_resume takes the pool's options" in str(run.outputs)
