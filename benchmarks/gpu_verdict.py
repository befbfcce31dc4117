"""Whether a GPU check passed: the rule ``make gpu-check``'s exit status follows (standard library
only: it runs with the GPU machine's own Python).

The check passes only when every stage it was asked for ran and succeeded, the test stage reported
at least one test, every test it collected was reported (a test cut for time is named, as a
failure), and every skipped test was skipped for a stated device count: ``needs N CUDA devices, M
visible`` with ``M`` at least 1 (the machine has fewer than that test needs). A check on a machine
where no GPU is visible fails, and says so, unless it is the rehearsal on CPU ranks asked for by
name (``--device cpu``), whose report says that nothing GPU-specific ran.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["GPU_FILES", "problems"]

# The GPU test files in the order they run: what tells most first (DeepSpeed bf16 ZeRO-2/3 and the
# CUDA memory the ranks report, the big model sharded and init_module, the device-side assert and the
# pool's own CUDA handling, then Lightning's strategies).
GPU_FILES = (
    "tests/gpu/test_strategies_gpu.py",
    "tests/gpu/test_bigmodel_gpu.py",
    "tests/gpu/test_cuda_pool.py",
    "tests/gpu/test_frameworks_gpu.py",
)
_DEVICE_COUNT = re.compile(r"needs (\d+) CUDA devices?, (\d+) visible")


def problems(
    statuses: Mapping[str, str],
    wanted: Iterable[str],
    tests: Sequence[Mapping[str, Any]],
    collected: Sequence[str],
    visible: int,
    rehearsal: bool,
) -> list[str]:
    """Why the check does not pass, one line each (none: it passed).

    ``statuses``: each stage's status (``ok``, ``skipped: ran in …`` for an install the caller
    skipped on purpose, ``failed …``, ``timed out …``); ``tests``: the JUnit rows (``test``,
    ``outcome``, ``message``); ``collected``: the test ids pytest collected before the run;
    ``visible``: CUDA devices the check's Python sees."""
    found: list[str] = []
    if visible == 0 and not rehearsal:
        found.append(
            "no GPU is visible to the check's Python, so nothing GPU-specific could run; on a GPU "
            "machine check `nvidia-smi` and CUDA_VISIBLE_DEVICES (a rehearsal on CPU ranks: --device cpu)"
        )
    for name in wanted:
        status = statuses.get(name, "not run")
        if status != "ok" and not (name == "install" and status.startswith("skipped: ran in")):
            found.append(f"the {name} stage did not succeed: {status}")
    if "tests" in wanted:
        if not tests:
            found.append("the test stage reported no test")
        reported = {str(t["test"]) for t in tests}
        cut = [c for c in collected if c not in reported]
        if cut:
            found.append(f"{len(cut)} test(s) cut for time, never run: " + ", ".join(cut))
        for t in tests:
            if t["outcome"] in ("failed", "error"):
                found.append(f"{t['test']} {t['outcome']}: {str(t['message']).splitlines()[0][:200]}")
            elif t["outcome"] == "skipped" and not _skip_for_device_count(str(t["message"]), rehearsal):
                found.append(f"{t['test']} skipped, not for a device count: {str(t['message'])[:200]}")
    return found


def _skip_for_device_count(message: str, rehearsal: bool) -> bool:
    """A skip the machine cannot help: it has fewer GPUs than the test needs (none, in a rehearsal)."""
    match = _DEVICE_COUNT.search(message)
    if match is None:
        return False
    needs, seen = int(match.group(1)), int(match.group(2))
    return needs > seen and (seen >= 1 or rehearsal)


def junit_id(classname: str, name: str) -> str:
    """pytest's node id from a JUnit test case (``tests.gpu.test_x`` + ``test_y[a]``)."""
    return f"{classname.replace('.', '/')}.py::{name}"
