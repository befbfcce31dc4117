"""The dry run against a real 2-rank CPU pool: the predicted per-rank peak of an FSDP FULL_SHARD
training step is within 10% of the peak torch's ``MemTracker`` measures on the real tensors in the
ranks (the benchmark ``python -m benchmarks.dry_run`` does the same for every strategy and model)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from jupyter_shard import Pool
from jupyter_shard.planner.dry_run import dry_run
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.spec import LaunchSpec

pytestmark = pytest.mark.timeout(300)

MODEL = """
import torch
from torch import nn

def build():
    layers = [m for _ in range(4) for m in (nn.Linear(768, 768), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(768, 1))
"""
BATCH = "torch.randn(32, 768)"
MEASURE = f"""
from torch.distributed._tools.mem_tracker import MemTracker
torch.manual_seed(0)
model = build()
opt = torch.optim.AdamW(model.parameters())
model, opt = shard.prepare(model, opt)
batch = {BATCH}
tracker = MemTracker()
tracker.track_external(model, opt, batch)
with tracker:
    for _ in range(2):
        shard.backward(model(batch).float().mean())
        shard.step()
        tracker.reset_mod_stats()
peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
"""


def test_the_predicted_fsdp_peak_is_within_10_percent_of_a_real_pools(tmp_path: Path) -> None:
    space: dict[str, object] = {}
    exec(MODEL, space)
    predicted = dry_run(space["build"], BATCH, 2, device="cpu", strategies=["fsdp FULL_SHARD"])  # type: ignore[arg-type]
    config = tmp_path / "fsdp.json"
    config.write_text(json.dumps({"sharding": "FULL_SHARD"}))
    spec = LaunchSpec.create(nproc=2, device="cpu", strategy="fsdp", config=config)
    with Pool(spec=spec, log_dir=tmp_path / "logs", sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool:
        pool.run(MODEL)
        pool.run(MEASURE)
        measured = max(pool.pull_all("peak").values())
    ratio = predicted["fsdp FULL_SHARD"].peak_bytes / measured
    assert abs(ratio - 1) <= 0.10, f"predicted / measured = {ratio:.3f}"
