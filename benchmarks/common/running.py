"""Which other test or benchmark runs share the cores with this one (they skew timings)."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

# A benchmark as ``python -m benchmarks.dispatch`` runs it, or by path (``benchmarks/dispatch.py`` of
# an older checkout, ``benchmarks/gpu_check.py``).
_SCRIPT = re.compile(rb"^benchmarks\.(\w+)$|benchmarks/(\w+)(?:/__main__)?\.py$")


def _ours() -> set[int]:
    """This process, its ancestors (a ``run_all``, ``timeout`` or shell that started it) and its
    descendants (ranks, engines and kernels it started)."""
    mine, pid = set(), os.getpid()
    while pid > 1:
        mine.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    with contextlib.suppress(ImportError, OSError):
        import psutil

        mine.update(p.pid for p in psutil.Process().children(recursive=True))
    return mine


def other_runs() -> set[str]:
    """Benchmarks of this folder (by name) and pytest runs in processes not this run's."""
    mine, found = _ours(), set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in mine:
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            found.update((m[1] or m[2]).decode(errors="replace") for a in argv if (m := _SCRIPT.search(a)))
            if any(Path(a.decode(errors="replace")).name == "pytest" or a == b"pytest" for a in argv):
                found.add("pytest")
    return found
