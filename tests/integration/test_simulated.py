"""The kernel's side at hundreds of ranks, with simulated ranks (``--launcher simulated``: many per
process, the wire protocol without torch). A real kernel runs them as a notebook would: the output
of a printing loop is a summary, an error raised everywhere is one block, ``%dist_status`` a row per
rank, the dashboard a band with a few strays; nothing printed is lost from the ranks' logs; an
interrupt reaches every running cell; a push is refused in one line; and no process is left."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_shard import Pool, PoolError
from jupyter_shard.launchers.simulated import PER_PROCESS, register

pytestmark = pytest.mark.timeout(300)

RANKS = 256
STEPS = 30
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _saved(run: Any) -> list[dict[str, Any]]:
    """A cell's outputs as a notebook ends up holding them: each display updated in place."""
    outputs: list[dict[str, Any]] = []
    by_display: dict[str, int] = {}
    for out in run.outputs:
        display_id = out.get("transient", {}).get("display_id")
        if out["type"] == "update_display_data":
            if display_id in by_display:
                outputs[by_display[display_id]] = {**outputs[by_display[display_id]], "data": out["data"]}
            continue
        if display_id:
            by_display[display_id] = len(outputs)
        outputs.append(out)
    return outputs


def _text(run: Any) -> str:
    """What a cell shows as text (streams, errors, displays' text), as nbclient would save it."""
    parts = []
    for out in _saved(run):
        if out["type"] == "stream":
            parts.append(out["text"])
        elif out["type"] == "error":
            parts.append("\n".join(out["traceback"]) + "\n")
        elif out["type"] in ("display_data", "execute_result"):
            parts.append(str(out["data"].get("text/plain", "")) + "\n")
    return _ANSI.sub("", "".join(parts))


def _sim_processes(kernel_pid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(kernel_pid).children(recursive=True)
        if "jupyter_shard.rank.simulated" in " ".join(p.cmdline())
    ]


def test_256_simulated_ranks_read_like_two_in_a_notebook(kernel: Any, log_dir: Path) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    started = kernel.execute("from jupyter_shard.launchers.simulated import register\nregister()")
    assert started.ok
    first = kernel.execute(
        f"%%distributed --nproc {RANKS} --launcher simulated --strategy none --device cpu\nx = 1"
    )
    assert first.ok, _text(first)[-2000:]
    assert len(_sim_processes(kernel.pid)) == RANKS // PER_PROCESS

    printing = kernel.execute(
        f"%%distributed\nfor step in range({STEPS}):\n"
        "    print(f'step {step} loss {0.5 + shard.rank / 1000 - step / 100:.3f}')"
    )
    assert printing.ok
    shown = _text(printing).splitlines()
    assert len(shown) <= 2 * STEPS + 10, shown[:40]  # one line per step, not one per rank and step
    assert any(f"rank 0-{RANKS - 1}" in line for line in shown), shown[:5]
    assert "step 29 loss" in "\n".join(shown)
    saved = len(json.dumps(_saved(printing)))
    assert saved < 200_000, saved

    failing = kernel.execute("%%distributed\nraise ValueError(f'bad {shard.rank}')")
    assert not failing.ok
    error = _text(failing)
    assert error.count("──── rank ") == 1, error[:3000]
    assert f"rank 0-{RANKS - 1}: ValueError, {RANKS} different messages" in error
    assert len(error.splitlines()) <= 40, error

    status = _text(kernel.execute("%dist_status")).splitlines()
    rows = [line for line in status if re.match(r"^\d+\s+\d+\s+\S+\s+cpu\s", line)]
    assert len(rows) == RANKS and max(map(len, status)) <= 120, status[:5]

    logging = kernel.execute(
        "%%distributed\nimport time\nfor step in range(40):\n"
        "    shard.log(loss=1.0 / (step + 1) + shard.rank / 1e4, step=step)\n    time.sleep(0.05)"
    )
    assert logging.ok
    figures = [o["data"] for o in _saved(logging) if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figures, [o["type"] for o in logging.outputs]
    traces = figures[-1]["application/vnd.plotly.v1+json"]["data"]
    assert 3 <= len(traces) <= 20, len(traces)  # band, mean and a few strays, not 256 lines
    named = [t.get("name", "") for t in traces if t.get("name", "").startswith("rank ")]
    assert len(named) <= 2 * 3, named  # the strays only (at most 3 a chart), never every rank

    logs = sorted(log_dir.rglob("rank-*.log"))
    assert len(logs) >= RANKS
    sample = next(p for p in logs if p.name == f"rank-{RANKS - 1}.log").read_text()
    assert sample.count("step ") == STEPS and "step 29 loss" in sample  # every line on disk

    pids = [p.pid for p in _sim_processes(kernel.pid)]
    assert kernel.execute("%dist_shutdown").ok
    deadline = time.monotonic() + 10
    while any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids
    ):
        assert time.monotonic() < deadline, "a simulated rank process outlived %dist_shutdown"
        time.sleep(0.1)


def test_an_interrupt_ends_every_simulated_cell_even_asleep_and_a_push_is_refused_in_one_line() -> None:
    """A cell asleep for 30 s on 6 ranks of one process ends on one interrupt, each rank saying
    KeyboardInterrupt, and the ranks answer the next cell; ``sys.exit`` in a cell is its error, as
    in IPython; every ``shard.log`` record reaches the history; a push is refused in one line."""
    from jupyter_shard import history

    register()
    pool = Pool(nproc=6, device="cpu", strategy="none", launcher="simulated")
    try:
        pool.start()
        began = time.monotonic()
        background = pool.run_background("import time\ntime.sleep(30)")
        time.sleep(0.5)
        pool.interrupt()
        with pytest.raises(BaseException, match="KeyboardInterrupt") as stopped:
            background.wait(timeout=20)
        assert "rank 0-5" in str(stopped.value)
        assert time.monotonic() - began < 15  # the 30-s sleep did not run out
        with pytest.raises(BaseException, match="SystemExit"):
            pool.run("import sys\nsys.exit(3)")
        assert pool.run("for i in range(500):\n    shard.log(x=i, step=i)").ok
        assert len(history()) == 6 * 500
        with pytest.raises(PoolError, match="simulated ranks") as refused:
            pool.push(z=1)
        assert "\n" not in str(refused.value).strip()
    finally:
        pool.shutdown()
