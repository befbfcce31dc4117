"""Helpers for fault tests: rank pids from a kernel, and waiting for processes to vanish."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psutil


def rank_pids(kernel: Any) -> list[int]:
    run = kernel.execute("%%distributed\nimport os\nprint('pid', os.getpid())")
    assert run.ok, run.outputs
    return [int(p) for p in re.findall(r"\] pid (\d+)", run.stream())]


def alive(pids: list[int]) -> list[int]:
    living = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.append(pid)
        except psutil.NoSuchProcess:
            pass
    return living


def wait_gone(pids: list[int], within: float) -> float:
    """Seconds until every pid is gone; fails if some outlive ``within``."""
    started = time.monotonic()
    while alive(pids):
        if time.monotonic() - started > within:
            raise AssertionError(f"still alive after {within} s: {alive(pids)}")
        time.sleep(0.05)
    return time.monotonic() - started


def interrupt_after(kernel: Any, seconds: float) -> threading.Thread:
    """Press Jupyter's interrupt (a kernel SIGINT) ``seconds`` from now; join the thread after."""

    def fire() -> None:
        time.sleep(seconds)
        kernel.km.interrupt_kernel()

    thread = threading.Thread(target=fire)
    thread.start()
    return thread


# A cell that needs a working group and the state set before: ``kept = 41`` and torch imported.
NEXT = "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('kept', kept + 1, 'sum', t.item())"


def back_to_work(kernel: Any, nproc: int, failed_at: float, pids: list[int]) -> None:
    """The next cell rebuilds the group with every rank's state, within 5 s of the failing cell."""
    nxt = kernel.execute(NEXT)
    back = time.monotonic() - failed_at
    assert nxt.ok, nxt.error_text()
    for rank in range(nproc):
        assert f"[rank {rank}] kept 42 sum {float(nproc)}" in nxt.stream(), nxt.stream()
    assert "rank state is kept" in nxt.stream()
    assert back < 5.0, f"back to a working cell {back:.1f} s after the failing cell ended"
    assert sorted(rank_pids(kernel)) == sorted(pids), "the ranks were kept, not respawned"
