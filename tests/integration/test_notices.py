"""What the pool says about a cell comes before that cell's rank output, every time: a restart for a
changed option and a rebuild of the group after a desync, 10 runs each."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)


def _before(run: Any, notice: str) -> bool:
    texts = [str(o.get("text") or o.get("data", {}).get("text/plain", "")) for o in run.outputs]
    said = next(i for i, t in enumerate(texts) if notice in t)
    output = next(i for i, t in enumerate(texts) if "[rank " in t)
    return said < output


def test_restart_and_rebuild_notices_precede_the_rank_output(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nx = 1").ok
    order = []
    for i in range(10):
        run = kernel.execute(f"%%distributed --nproc {3 if i % 2 == 0 else 2}\nprint('out', shard.rank)")
        assert run.ok, run.error_text()
        order.append(_before(run, "restarting pool"))
    setup = "%%distributed\nimport torch, torch.distributed as dist"
    assert kernel.execute(setup).ok
    for _ in range(10):
        assert not kernel.execute("%%rank 0\ndist.all_reduce(torch.ones(1))").ok
        run = kernel.execute("%%distributed\nprint('after', shard.rank)")
        assert run.ok, run.error_text()
        order.append(_before(run, "rebuilt the process group"))
    assert order == [True] * 20
