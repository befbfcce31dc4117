"""F5 and escalation: Jupyter's stop button reaches every rank; a rank that ignores it is killed."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)


def _interrupt_after(kernel: Any, seconds: float) -> threading.Thread:
    def fire() -> None:
        time.sleep(seconds)
        kernel.km.interrupt_kernel()

    thread = threading.Thread(target=fire)
    thread.start()
    return thread


def test_interrupt_python_loop_on_all_ranks_keeps_state(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nkept = 41").ok
    fired = _interrupt_after(kernel, 1.0)
    run = kernel.execute("%%distributed\nimport time\nwhile True:\n    time.sleep(0.001)\n")
    fired.join()
    assert not run.ok
    assert run.elapsed < 1.0 + 2.0, f"cell took {run.elapsed:.1f} s after the interrupt"
    text = run.error_text()
    assert text.splitlines()[0] == "interrupted: KeyboardInterrupt on rank 0-1"
    assert "----> 4     time.sleep(0.001)" in text
    after = kernel.execute("%%distributed\nkept + 1")
    assert after.data("execute_result") == [{"text/plain": "42"}]


def test_rank_stuck_in_collective_is_killed_and_next_cell_restarts(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nkept = 1").ok
    fired = _interrupt_after(kernel, 1.5)
    run = kernel.execute(
        "%%distributed\nimport time, torch, torch.distributed as dist\n"
        "if shard.rank == 0:\n    time.sleep(60)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    fired.join()
    assert not run.ok
    assert run.elapsed < 1.5 + 10.0
    text = run.error_text()
    assert "killed rank 1 (no response to SIGINT within 2 s)" in text
    assert "its stack before it was killed" in text and "all_reduce" in text
    assert "rank 1 was killed by jupyter_shard: still running 2 s after SIGINT" in text
    assert "out of memory" not in text, "the pool's own kill is not an OOM"
    nxt = kernel.execute("%%distributed\n'kept' in dir()")
    assert "restarting the pool (rank 1 was killed); rank state is lost" in nxt.stream("stderr")
    assert nxt.data("execute_result") == [{"text/plain": "False"}]
