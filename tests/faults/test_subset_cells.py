"""A collective in a cell that runs on some ranks only (``%%rank``, ``--ranks``): the other ranks are
idle and can never join it. The cell ends within a few seconds naming who waits where and who is not
running the cell; the next cell gets a working group by itself, every rank's state kept."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.faults.conftest import NEXT, back_to_work, rank_pids

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("magic", ["%%rank 0", "%%distributed --ranks 0"])
def test_collective_in_a_subset_cell_ends_fast_and_the_group_is_rebuilt(
    kernel: Any, nproc: int, magic: str
) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    setup = f"%%distributed --nproc {nproc} --device cpu\nimport torch, torch.distributed as dist\nkept = 41"
    assert kernel.execute(setup).ok
    pids = rank_pids(kernel)
    run = kernel.execute(f"{magic}\nt = torch.ones(1)\ndist.all_reduce(t)\n")
    failed_at = time.monotonic()
    assert not run.ok
    assert run.elapsed < 10.0, f"the cell took {run.elapsed:.1f} s"
    others = "1" if nproc == 2 else "1-2"
    verb = "is" if nproc == 2 else "are"
    said = run.stream() + run.error_text()
    assert f"rank 0 is waiting in all_reduce while rank {others} {verb} not running this cell" in said, said
    assert "Timed out" not in said and "killed" not in said
    assert "the next cell first rebuilds the group (rank state is kept)" in run.error_text()

    back_to_work(kernel, nproc, failed_at, pids)
    again = kernel.execute(NEXT)
    assert again.ok and "rebuilt" not in again.stream()


def test_a_subset_cell_without_a_collective_is_left_alone(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nimport time\nkept = 41").ok
    run = kernel.execute("%%rank 1\ntime.sleep(4)\nkept + 1")
    assert run.ok, run.error_text()
    assert run.data("execute_result") == [{"text/plain": "42"}]


def test_a_collective_on_a_subgroup_of_the_cells_ranks_completes(kernel: Any) -> None:
    """Rank 0 waits 2.5 s (heartbeats show it in all_reduce) for rank 1 on a group of ranks 0-1, in a
    cell on ranks 0-1 of 3: a collective that can complete, left to do so."""
    assert kernel.execute("%load_ext jupyter_shard").ok
    setup = (
        "%%distributed --nproc 3 --device cpu\nimport time, torch, torch.distributed as dist\n"
        "pair = dist.new_group([0, 1])"
    )
    assert kernel.execute(setup).ok
    run = kernel.execute(
        "%%rank 0,1\nif shard.rank == 1:\n    time.sleep(2.5)\n"
        "t = torch.ones(1)\ndist.all_reduce(t, group=pair)\nprint('sum', t.item())"
    )
    assert run.ok, run.error_text()
    assert "[rank 0] sum 2.0" in run.stream() and "[rank 1] sum 2.0" in run.stream()
    assert "not running this cell" not in run.stream()
