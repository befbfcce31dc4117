"""``%dist_picker ... --find-batch --confirm`` on a real 2-rank CPU pool (gloo, fsdp FULL_SHARD): every
rank reports a measured peak of its own next to the predicted one, and afterwards the ranks'
namespaces, their prepared model and their live modules are as they were before."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard import Pool
from jupyter_shard.notebook.picker_confirm import confirm_line
from jupyter_shard.notebook.picker_dry_run_view import report
from jupyter_shard.planner.dry_run import dry_run
from jupyter_shard.planner.estimate import HEADROOM
from jupyter_shard.planner.free_memory import MemorySnapshot
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.spec import LaunchSpec

pytestmark = pytest.mark.timeout(300)

BUILD = """
import torch
from torch import nn

def build():
    layers = [m for _ in range(3) for m in (nn.Linear(256, 256), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(256, 1))
"""
# the user's own state on the ranks, which --confirm must leave alone
USER = """
net = build()
prepared, opt = shard.prepare(net, torch.optim.AdamW(net.parameters()))
shard.backward(prepared(torch.randn(2, 256)).mean())
shard.step()
model = "mine"
"""
SNAPSHOT = """
__import__("gc").collect()
(
    sorted(get_ipython().user_ns),
    shard.prepared_model is prepared,
    shard.global_step,
    model,
    sum(type(o) is torch.nn.Linear for o in __import__("gc").get_objects()),
)
"""
BATCH = "torch.randn(8, 256)"


def snapshot(pool: Pool, count: int) -> dict[int, Any]:
    pool.run(SNAPSHOT, exec_count=count)
    return pool.last_values()


def test_find_batch_confirm_measures_every_rank_and_leaves_the_ranks_as_they_were(tmp_path: Path) -> None:
    kernel: dict[str, Any] = {}
    exec(BUILD, kernel)
    # free memory for a batch of about 48: the search then finds one between 32 and 64
    peak = dry_run(kernel["build"], "torch.randn(48, 256)", 2, "cpu", ["fsdp FULL_SHARD"])["fsdp FULL_SHARD"]
    memory = MemorySnapshot((), int(2 * peak.peak_bytes / float(HEADROOM)), "")
    config = tmp_path / "fsdp.json"
    config.write_text(json.dumps({"sharding": "FULL_SHARD"}))
    spec = LaunchSpec.create(nproc=2, device="cpu", strategy="fsdp", config=config)
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(spec=spec, log_dir=tmp_path / "logs", sink=sink) as pool:
        pool.run(BUILD + USER)
        before = snapshot(pool, 100)
        line = f"build --batch '{BATCH}' --find-batch --confirm"
        outcome, confirmation = confirm_line(line, kernel, pool, memory=memory)
        after = snapshot(pool, 101)

    assert outcome.largest_batch is not None
    name, found, predicted = outcome.largest_batch
    assert name == "fsdp FULL_SHARD" == confirmation.plan and 32 <= found <= 64
    assert [a.size for a in confirmation.attempts] == [found] and confirmation.confirmed == found
    steps = confirmation.attempts[0].ranks
    assert [s.rank for s in steps] == [0, 1]
    for step in steps:  # a real measurement of each rank, near the prediction, not a copy of it
        assert isinstance(step.peak, int) and step.free is None and "MemTracker" in step.how
        assert predicted is not None and abs(step.peak / predicted - 1) <= 0.25, (step.peak, predicted)
    text = report(outcome, "", confirmation)
    assert "Confirmed on the live pool (2 ranks, fsdp FULL_SHARD)" in text
    assert "rank 0: measured" in text and "rank 1: measured" in text and f"Batch {found} confirmed" in text

    for rank in (0, 1):
        names_before, *state_before = before[rank]
        names_after, *state_after = after[rank]
        # only the snapshot cells' own history: the input of the second, the output of the first
        assert set(names_after) - set(names_before) == {"_i101", "_100"}
        assert set(names_before) <= set(names_after)
        assert state_after == state_before == [True, 1, "mine", state_before[-1]]
