"""F1, F2: a rank that exits, segfaults or is SIGKILLed mid-cell fails the cell fast, named."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

CASES = [
    ("import os\nos._exit(3)", "rank 1 exited with code 3"),
    (
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
        "rank 1 was killed by SIGKILL (possibly out of memory",
    ),
    ("import ctypes\nctypes.string_at(0)", "rank 1 was killed by SIGSEGV"),
]


@pytest.mark.parametrize(("crash", "message"), CASES, ids=["exit3", "sigkill", "segfault"])
def test_crash_fails_cell_fast_and_restart_recovers(kernel: Any, crash: str, message: str) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nready = True").ok
    body = "\n".join(f"    {line}" for line in crash.splitlines())
    run = kernel.execute(
        "%%distributed\nimport time, torch, torch.distributed as dist\n"
        f"if shard.rank == 1:\n    time.sleep(0.3)\n{body}\n"
        "dist.all_reduce(torch.ones(1))\ntime.sleep(30)\n"
    )
    assert not run.ok
    text = run.error_text()
    assert text.splitlines()[0].startswith(f"rank 1 failed first: {message}")
    assert run.elapsed < 2.5 + 0.3, f"cell took {run.elapsed:.1f} s"

    status = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    row = next(ln for ln in status.splitlines() if ln.startswith("1 "))
    assert "dead" in row and message.split("rank 1 ")[1][:20] in row

    refused = kernel.execute("%%distributed\n1")
    assert not refused.ok
    assert "Run %dist_restart" in refused.error_text()

    restart = kernel.execute("%dist_restart")
    assert "rank state is lost" in restart.stream()
    again = kernel.execute(
        "%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "dist.all_reduce(t); t.item()"
    )
    assert again.data("execute_result") == [{"text/plain": "2.0"}]
