"""The machine a benchmark ran on and how loaded it was: every section describes both, since other
processes sharing the cores (a test suite, another benchmark) inflate the tails and the starts."""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.common.running import other_runs

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"  # where run_all.py and a script's default --results write


def load_average() -> str:
    """The 1, 5 and 15-minute load averages as /proc/loadavg gives them."""
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "unknown"


def format_loads(loads: tuple[float, ...]) -> str:
    return " ".join(f"{v:.2f}" for v in loads)


def cpu() -> str:
    """The CPU model and how many logical cores it has."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical cores"
    return f"{os.cpu_count()} logical cores"


def git_revision() -> str:
    """The short revision, said to have uncommitted changes when tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


class LoadWatch:
    """For the length of a ``with`` block: the load averages before and after, the 1-minute load every
    few seconds, the other test or benchmark runs seen meanwhile (``other_runs``) and the seconds taken."""

    def __init__(self, every: float = 5.0) -> None:
        self.loads: list[float] = []
        self.others: set[str] = set()
        self.before = self.after = (0.0, 0.0, 0.0)
        self.seconds = 0.0
        self._every = every
        self._began = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="load-watch", daemon=True)

    def start(self) -> LoadWatch:
        self.before, self._began = os.getloadavg(), time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.after, self.seconds = os.getloadavg(), time.monotonic() - self._began

    def __enter__(self) -> LoadWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _watch(self) -> None:
        while True:
            with contextlib.suppress(OSError, ValueError):
                self.loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
            self.others |= other_runs()
            if self._stop.wait(self._every):
                return

    def describe(self) -> str:
        if not self.loads:
            return "not sampled"
        return (
            f"{min(self.loads):.2f} / {statistics.median(self.loads):.2f} / {max(self.loads):.2f} "
            f"(min / median / max of {len(self.loads)} samples)"
        )
