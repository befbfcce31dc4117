"""jupyter_shard.pool.facts: what a pool says about itself before it starts and after it stops."""

from __future__ import annotations

from jupyter_shard.pool.pool import Pool
from jupyter_shard.spec import LaunchSpec


def test_a_pool_that_never_started_says_so_and_asks_no_rank() -> None:
    pool = Pool(spec=LaunchSpec.create(nproc=3, device="cpu"))
    assert pool.launch_path == "not started" and pool.launcher is None
    assert pool.directory is None and pool.log_dir is None and pool.curve is None and pool.address == ""
    assert pool.dropped == 0
    assert pool.status() == [] and pool.activity() == [] and pool.stacks(timeout=0.1) == {}
