"""A resume at the same world size computes what an uninterrupted pool computes, to the bit, over the
combinations users meet: strategy × precision × gradient accumulation (suspended between micro-steps
where the strategy keeps those gradients, refused with what to do where it does not) with a
learning-rate scheduler and a prepared DataLoader held mid-epoch; and at another world size the
prepared loader reads the rest of the epoch, each sample once.

The combinations are drawn so that every strategy, precision and accumulation appears; set
``JUPYTER_SHARD_SWEEP=all`` to run the whole product (30 combinations: 218 s here, all passing)."""

from __future__ import annotations

import io
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from jupyter_shard import Pool
from jupyter_shard.errors import PoolError
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.pool.suspend import resume, suspend
from jupyter_shard.spec import LaunchSpec

pytestmark = pytest.mark.timeout(600)

# A model, AdamW, a scheduler stepped per optimizer step, a shuffled prepared loader whose iterator
# is held across cells, and dropout (the global generator matters).
SETUP = """
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.Tanh(), nn.Linear(32, 4))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
data = TensorDataset(torch.randn(120, 8) * 50, torch.randn(120, 4), torch.arange(120))
model, opt, loader = shard.prepare(net, opt, DataLoader(data, batch_size=4, shuffle=True))
sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5) if shard.strategy != "deepspeed" else None
loader.sampler.set_epoch(1)
it = iter(loader)
seen = []
def micro():
    x, y, i = next(it)
    seen.extend(i.tolist())
    loss = (model(x.to(shard.device)).float() - y.to(shard.device)).pow(2).mean()
    shard.backward(loss)
    before = shard.global_step
    shard.step()
    if sched is not None and shard.global_step > before:
        sched.step()
    return loss.detach().float().cpu()
"""
NEXT = """
losses = [micro() for _ in range(4)]
noise = torch.randn(3)
scaler = shard.impl.scaler
where = (sched and sched.last_epoch, shard.global_step, scaler and float(scaler.get_scale()))
"""
STRATEGIES = ["ddp", "fsdp", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]
PRECISIONS = ["32", "bf16-mixed", "16-mixed"]
ACCUMULATE = [1, 3]
# every strategy, precision and accumulation at least once, and every pair of precision and accumulation
DRAWN = [
    ("ddp", "16-mixed", 3),
    ("ddp", "bf16-mixed", 1),
    ("fsdp", "16-mixed", 1),
    ("fsdp", "32", 3),
    ("deepspeed-zero1", "bf16-mixed", 3),
    ("deepspeed-zero3", "32", 1),
]
COMBINATIONS = (
    list(itertools.product(STRATEGIES, PRECISIONS, ACCUMULATE))
    if os.environ.get("JUPYTER_SHARD_SWEEP") == "all"
    else DRAWN
)


def _pool(nproc: int, strategy: str, precision: str, accumulate: int) -> Pool:
    name, _, stage = strategy.partition("-zero")
    options: dict[str, Any] = {"zero_stage": int(stage)} if stage else {}
    spec = LaunchSpec.create(
        nproc=nproc, device="cpu", strategy=name, precision=precision, accumulate=accumulate, **options
    )  # type: ignore[arg-type]
    return Pool(spec=spec, sink=ConsoleSink(io.StringIO(), io.StringIO()))


def _before(pool: Pool, accumulate: int, more: int = 0) -> None:
    """Two whole optimizer steps and, with accumulation, one micro-step into the third; then
    ``more`` micro-steps."""
    micro = 2 * accumulate + (1 if accumulate > 1 else 0)
    pool.run(SETUP + f"\nfirst = [micro() for _ in range({micro})]")
    if more:
        pool.run(f"first += [micro() for _ in range({more})]")


def _refuses_mid_step(strategy: str, accumulate: int) -> bool:
    """fsdp and DeepSpeed keep a half-done accumulation's gradients where a suspend cannot."""
    return accumulate > 1 and not strategy.startswith("ddp")


def _after(pool: Pool) -> dict[int, dict[str, Any]]:
    pool.run(NEXT)
    names = ("losses", "noise", "where", "seen")
    values = {r: {k: pool.pull(k, r) for k in names} for r in range(pool.world_size)}
    weights = pool.pull("model", gather=True).state_dict()
    for r in values:
        values[r]["weights"] = weights
    return values


@pytest.mark.parametrize(("strategy", "precision", "accumulate"), COMBINATIONS)
def test_a_resume_goes_on_as_if_never_suspended(
    strategy: str, precision: str, accumulate: int, tmp_path: Path
) -> None:
    refuses = _refuses_mid_step(strategy, accumulate)
    with _pool(2, strategy, precision, accumulate) as reference:
        _before(reference, accumulate, more=2 if refuses else 0)
        expected = _after(reference)
    directory = tmp_path / "run"
    with _pool(2, strategy, precision, accumulate) as pool:
        _before(pool, accumulate)
        if refuses:  # refused with what to do, the ranks keep their state; then at the boundary
            with pytest.raises(
                PoolError, match=r"between micro-steps \(1 of --accumulate 3 taken\).* take the remaining 2"
            ):
                suspend(pool, directory)
            assert pool.started and not directory.exists()
            pool.run("first += [micro() for _ in range(2)]")
        suspend(pool, directory)
    pool, report = resume(directory)
    with pool:
        assert report.lost == {}, report.lost
        got = _after(pool)
    for rank in (0, 1):
        for name in ("losses", "noise"):
            assert all(
                torch.equal(a, b) for a, b in zip(got[rank][name], expected[rank][name], strict=True)
            ), (rank, name, got[rank][name], expected[rank][name])
        assert got[rank]["where"] == expected[rank]["where"]
        assert got[rank]["seen"] == expected[rank]["seen"]
    for key, value in expected[0]["weights"].items():
        assert torch.equal(got[0]["weights"][key], value), key


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (4, 1)])
def test_at_another_world_size_the_epoch_goes_on_with_the_samples_not_yet_read(
    old: int, new: int, tmp_path: Path
) -> None:
    """Each rank reads 5 batches of 4, the pool is suspended and resumed at ``new`` ranks, which read
    the rest of the epoch: together they read the 120 samples once each (padding aside)."""
    directory = tmp_path / "run"
    with _pool(old, "ddp", "32", 1) as pool:
        pool.run(SETUP + "\nfirst = [micro() for _ in range(5)]")
        before = [i for r in range(old) for i in pool.pull("seen", r)]
        suspend(pool, directory)
    pool, report = resume(directory, {"nproc": new})
    with pool:
        summary = report.summary()
        assert "it, loader: split again over" in summary, summary
        assert "seen" in report.differed and "first" in report.differed  # each rank held its own
        pool.run(REST)
        later = [i for r in range(new) for i in pool.pull("seen", r)]
        steps = {len(pool.pull("after", r)) for r in range(new)}
    assert len(steps) == 1, "the new ranks took different numbers of steps"
    assert not set(before) & set(later), "a sample read before the suspend was read again"
    assert set(before) | set(later) == set(range(120))
    assert len(later) - len(set(later)) < new


REST = """
seen = []
after = []
while True:
    try:
        after.append(micro())
    except StopIteration:
        break
"""


def test_a_suspend_between_micro_steps_resumes_only_at_its_own_world_size(tmp_path: Path) -> None:
    """Its gradients were summed over 2 ranks' data: a resume at 3 is refused before the running
    pool is let go, and one at 2 goes on."""
    directory = tmp_path / "run"
    with _pool(2, "ddp", "32", 3) as pool:
        _before(pool, 3)
        suspend(pool, directory)
    with _pool(2, "none", "32", 1) as running:
        running.run("x = 7")
        with pytest.raises(
            PoolError, match=r"between micro-steps .* resume it at 2 ranks .* nothing was changed"
        ):
            resume(directory, {"nproc": 3}, pool=running)
        assert running.started and running.pull("x", 0) == 7
    pool, _ = resume(directory)
    with pool:
        assert pool.run("shard.progress").value == {"text/plain": "(2, 7)"}


def test_the_history_comes_back_once_however_often_a_pool_is_suspended_and_resumed(tmp_path: Path) -> None:
    """The kernel resumes into the same pool object: its history is replaced by the suspend's, not
    added to (each cycle doubled it: 5 million records and a 484 MB manifest after 8 cycles)."""
    pool = _pool(2, "none", "32", 1)
    try:
        pool.run("for s in range(5): shard.log(loss=float(s))")
        for _ in range(3):
            suspend(pool, tmp_path / "run")
            pool, _ = resume(tmp_path / "run", pool=pool)
            assert len(pool.history.records()) == 10
    finally:
        pool.shutdown()
