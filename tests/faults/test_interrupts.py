"""F5 at 2, 3 and 4 ranks: Jupyter's stop button reaches every rank, state is kept, and a working cell
follows within 5 s (the escalation for blocked ranks: test_desync.py, test_world_sizes.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.faults.conftest import interrupt_after

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_interrupt_python_loop_on_all_ranks_keeps_state(kernel: Any, nproc: int) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(f"%%distributed --nproc {nproc} --device cpu\nkept = 41").ok
    fired = interrupt_after(kernel, 1.0)
    run = kernel.execute("%%distributed\nimport time\nwhile True:\n    time.sleep(0.001)\n")
    fired.join()
    failed_at = time.monotonic()
    assert not run.ok
    assert run.elapsed < 1.0 + 2.0, f"cell took {run.elapsed:.1f} s after the interrupt"
    text = run.error_text()
    assert text.splitlines()[0] == f"interrupted: KeyboardInterrupt on rank 0-{nproc - 1}"
    assert "----> 4     time.sleep(0.001)" in text
    after = kernel.execute(
        "%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "dist.all_reduce(t)\n(kept + 1, t.item())"
    )
    back = time.monotonic() - failed_at
    assert after.data("execute_result") == [{"text/plain": f"(42, {float(nproc)})"}]
    assert back < 5.0, f"back to a working cell {back:.1f} s after the failing cell ended"


def test_an_interrupted_dataloader_cell_reads_at_a_glance(kernel: Any) -> None:
    """DataLoader workers on every rank: the same traceback on both ranks is shown once, without the
    pool's own frames (it was 18,000 characters, rank by rank)."""
    assert kernel.execute("%load_ext jupyter_shard").ok
    setup = (
        "%%distributed --nproc 2 --device cpu\nimport time, torch\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "class Slow(Dataset):\n    def __len__(self): return 10**6\n"
        "    def __getitem__(self, i):\n        time.sleep(0.01); return torch.ones(4)\n"
    )
    assert kernel.execute(setup).ok
    # Interrupt once both ranks are in the loop (their workers started), as a person would: where a
    # fixed delay falls while a loaded machine still starts workers, the two tracebacks differ.
    iterating: set[str] = set()

    def on_output(out: dict[str, Any]) -> None:
        for rank in ("0", "1"):
            if f"[rank {rank}] iterating" in out.get("text", ""):
                iterating.add(rank)
        if len(iterating) == 2 and "sent" not in iterating:
            iterating.add("sent")
            kernel.km.interrupt_kernel()

    run = kernel.execute(
        "%%distributed\nfor i, batch in enumerate(DataLoader(Slow(), batch_size=8, num_workers=2)):\n"
        "    if i == 2:\n        print('iterating', flush=True)",
        on_output=on_output,
    )
    assert "sent" in iterating, run.outputs
    text = run.error_text()
    assert text.splitlines()[0] == "interrupted: KeyboardInterrupt on rank 0-1"
    assert text.count("Traceback (most recent call last)") == 1, text
    assert "----> 2 for i, batch in enumerate(DataLoader" in text
    assert len(text) < 6000, len(text)
    after = kernel.execute("%%distributed\nshard.world_size")
    assert after.data("execute_result") == [{"text/plain": "2"}]
