"""F1, F2: a rank that exits, segfaults, is SIGKILLed or OOM-killed mid-cell fails the cell fast, named."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.pool.escalation import INTERRUPT_GRACE

pytestmark = pytest.mark.timeout(120)

CASES = [
    ("import os\nos._exit(3)", "exited with code 3"),
    (
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
        "was killed by SIGKILL (possibly out of memory",
    ),
    ("import ctypes\nctypes.string_at(0)", "was killed by SIGSEGV"),
]


@pytest.mark.parametrize("nproc", [2, 3, 4])
@pytest.mark.parametrize(("crash", "message"), CASES, ids=["exit3", "sigkill", "segfault"])
def test_crash_fails_cell_fast_and_restart_recovers(
    kernel: Any, crash: str, message: str, nproc: int
) -> None:
    """The last rank dies while the others enter a collective; with 3 or more ranks some survivors
    are blocked with each other, not with the dead rank, and must be released, not left to the
    collective's timeout. The cell says the rule (run %dist_restart) and a working cell follows
    within 5 s."""
    last = nproc - 1
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(f"%%distributed --nproc {nproc} --device cpu\nready = True").ok
    body = "\n".join(f"    {line}" for line in crash.splitlines())
    run = kernel.execute(
        "%%distributed\nimport time, torch, torch.distributed as dist\n"
        f"if shard.rank == {last}:\n    time.sleep(0.3)\n{body}\n"
        "dist.all_reduce(torch.ones(1))\ntime.sleep(30)\n"
    )
    failed_at = time.monotonic()
    assert not run.ok
    text = run.error_text()
    assert text.splitlines()[0].startswith(f"rank {last} failed first: rank {last} {message}")
    assert f"rank {last} died: run %dist_restart for fresh ranks (rank state is lost)" in text, text[:1500]
    # Released by the idle ranks within the first grace, not killed after the second one, and
    # nowhere near the collective's own timeout (the survivors would sleep 30 s after it).
    assert "killed rank" not in text, text[:1500]
    assert run.elapsed < 0.3 + 2 * INTERRUPT_GRACE, f"cell took {run.elapsed:.1f} s"

    status = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    row = next(ln for ln in status.splitlines() if ln.startswith(f"{last} "))
    assert "dead" in row and message[:20] in row

    refused = kernel.execute("%%distributed\n1")
    assert not refused.ok
    assert "Run %dist_restart" in refused.error_text()
    assert refused.elapsed < 1.0, "the next cell says what to do at once (no rebuild waits on the dead)"

    restart = kernel.execute("%dist_restart")
    assert "rank state is lost" in restart.stream()
    again = kernel.execute(
        "%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "dist.all_reduce(t); t.item()"
    )
    assert again.data("execute_result") == [{"text/plain": f"{float(nproc)}"}]
    back = time.monotonic() - failed_at
    assert back < 5.0, f"back to a working cell {back:.1f} s after the failing cell ended"


MEMCG_ROOT = Path("/sys/fs/cgroup/memory")


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A child memory cgroup (cgroup v1) limited to 1.5 GiB, swap included; removed afterwards."""
    group = MEMCG_ROOT / f"jupyter-shard-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here ({exc}): the OOM kill needs one")
    try:
        limit = str(3 << 29)
        (group / "memory.limit_in_bytes").write_text(limit)
        with contextlib.suppress(OSError):  # without swap accounting there is no memsw file
            (group / "memory.memsw.limit_in_bytes").write_text(limit)
        yield group
    finally:
        # Whatever still runs in it (the kernel, until its fixture stops it) goes back to ours.
        ours = Path(f"/proc/{os.getpid()}/cgroup").read_text()
        home = next(line.split(":", 2)[2] for line in ours.splitlines() if ":memory:" in line)
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (MEMCG_ROOT / home.lstrip("/") / "cgroup.procs").write_text(pid)
        deadline = time.monotonic() + 10
        while True:
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_oom_kill_is_named_from_the_cgroup_counter(kernel: Any, memory_cgroup: Path) -> None:
    """A real OOM kill: the kernel and its ranks run in a 1.5 GiB memory cgroup, rank 1 fills it."""
    (memory_cgroup / "cgroup.procs").write_text(str(kernel.pid))  # the ranks it starts inherit it
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nimport torch, time").ok
    run = kernel.execute(
        "%%distributed\nif shard.rank == 1:\n    hog = [torch.ones(1 << 26) for _ in range(64)]\n"
        "time.sleep(30)\n"
    )
    assert not run.ok
    text = run.error_text()
    first = text.splitlines()[0]
    assert first.startswith(
        "rank 1 failed first: rank 1 was killed by SIGKILL by the out-of-memory killer"
    ), first
    assert f"{memory_cgroup}/memory.oom_control, went from 0 to 1" in first, first
    assert "possibly" not in first
