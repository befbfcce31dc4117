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
