"""The live dashboard and background runs through a real kernel, as a notebook sees them on iopub.

A redraw is one ``update_display_data`` message carrying the dashboard's Plotly figure under
``application/vnd.jupyter-shard.figure+json``; redraws must arrive while the cell runs (not only at
its end), at most 5 a second, and keep arriving after ``--bg`` has returned. When the cell ends the
output holds the figure as ``application/vnd.plotly.v1+json`` with an HTML/SVG fallback.
"""

from __future__ import annotations

import csv
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_shard.notebook.dashboard import LIVE_MIME, PLOTLY_MIME
from jupyter_shard.pool.figures import decode

UI_TYPES = ("stream", "display_data", "update_display_data", "comm_msg")

pytestmark = pytest.mark.timeout(240)

TRAIN = (
    "%%distributed{opts}\n"
    "import time, torch\n"
    "torch.manual_seed(0)\n"
    "w = torch.zeros(4, requires_grad=True)\n"
    "opt = torch.optim.SGD([w], lr=0.1)\n"
    "x, y = torch.randn(64, 4), torch.randn(64)\n"
    "for step in range({steps}):\n"
    "    loss = ((x @ w - y) ** 2).mean()\n"
    "    opt.zero_grad(); loss.backward(); opt.step()\n"
    "    shard.log(loss=loss, lr=0.1)\n"
    "    time.sleep({pause})\n"
    "'trained'\n"
)


@pytest.fixture(scope="module")
def nb(shared_kernel: Any) -> Any:
    run = shared_kernel.execute("%%distributed --nproc 2 --device cpu\nimport os")
    assert run.ok, run.outputs
    return shared_kernel


def _max_per_second(times: list[float]) -> int:
    return max((sum(1 for u in times if t <= u < t + 1.0) for t in times), default=0)


def _redraws(nb: Any, since: float) -> list[tuple[float, dict[str, Any]]]:
    """The dashboard's live redraws read since ``since``: (arrival time, bundle)."""
    return [
        (t, m["content"]["data"])
        for t, m in nb.messages
        if t >= since
        and m["msg_type"] == "update_display_data"
        and isinstance(m["content"]["data"].get(LIVE_MIME, {}).get("figure"), dict)
    ]


def _loss_traces(figure: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The loss chart's traces by name (``rank 0``, ``rank 1``, ``mean``)."""
    data = decode(figure)["data"]
    return {t["name"]: t for t in data if t.get("uid", "").startswith("loss-")}


def test_dashboard_updates_arrive_while_a_ten_second_cell_runs(nb: Any) -> None:
    kernel = psutil.Process(nb.pid)
    cpu_before = sum(kernel.cpu_times()[:2])
    started = time.monotonic()
    run = nb.execute(TRAIN.format(opts="", steps=500, pause=0.02), timeout=120)
    ended = time.monotonic()
    cpu = (sum(kernel.cpu_times()[:2]) - cpu_before) / (ended - started)
    assert run.ok, run.outputs
    assert run.elapsed > 10.0
    redraws = _redraws(nb, started)
    updates = [t for t, _ in redraws]
    assert len(updates) > 20, f"only {len(updates)} redraws during a {run.elapsed:.0f} s cell"
    assert updates[0] < started + 3.0, "no update in the first seconds: the dashboard only drew at the end"
    assert sum(1 for t in updates if t < ended - 5.0) > 10
    assert _max_per_second(updates) <= 6, "more than 5 redraws a second (one message each)"
    ui = [t for t, m in nb.messages if t >= started and m["msg_type"] in UI_TYPES]
    assert _max_per_second(ui) <= 20, "more than 20 UI messages in a second"
    assert cpu < 0.10, f"the kernel used {cpu:.0%} of a core while 2 ranks logged 50 steps a second"
    loss = _loss_traces(redraws[-1][1][LIVE_MIME]["figure"])
    assert set(loss) == {"rank 0", "rank 1", "mean"}
    assert all(0 < loss[r]["meta"]["points"] <= 500 for r in ("rank 0", "rank 1"))
    final = [o for o in run.outputs if o["type"] == "update_display_data"][-1]["data"]
    assert set(final) == {LIVE_MIME, PLOTLY_MIME, "text/html", "text/plain"}
    assert final[LIVE_MIME] == {"figure": PLOTLY_MIME}, "the saved output points the renderer at Plotly's"
    assert "application/vnd.jupyter.widget-view+json" not in final, "the saved output must be static"
    saved = _loss_traces(final[PLOTLY_MIME])
    assert [saved[r]["meta"]["points"] for r in ("rank 0", "rank 1")] == [500, 500]
    steps = [float(s) for s in range(1, 501)]
    assert saved["rank 0"]["x"] == steps and saved["rank 1"]["x"] == steps, "every logged step, each rank"
    assert saved["mean"]["x"] == steps
    assert saved["rank 0"]["y"][-1] == pytest.approx(
        float(final["text/plain"].split("loss ")[1].split(",")[0]), rel=1e-3
    )
    assert '<svg class="jshard-chart" data-metric="loss"' in final["text/html"]
    assert final["text/plain"].splitlines()[1].startswith("rank 0: idle, step 500, loss ")
    assert run.data("execute_result") == [{"text/plain": "'trained'"}]


def test_no_dashboard_option_shows_none(nb: Any) -> None:
    started = time.monotonic()
    run = nb.execute(TRAIN.format(opts=" --no-dashboard", steps=20, pause=0.01))
    assert run.ok, run.outputs
    assert not nb.comm_updates(started)
    assert not [o for o in run.outputs if o["type"] in ("display_data", "update_display_data")]


def test_background_run_returns_at_once_and_keeps_updating(nb: Any) -> None:
    started = time.monotonic()
    run = nb.execute(TRAIN.format(opts=" --bg", steps=300, pause=0.02))  # 6 s: updates to count under load
    returned = time.monotonic()
    assert run.ok, run.outputs
    assert run.elapsed < 1.0
    assert "running in the background" in run.stream()
    plain = nb.execute("sum(range(10))")
    assert plain.ok and plain.elapsed < 1.0 and plain.data("execute_result") == [{"text/plain": "45"}]
    refused = nb.execute("%%distributed\n1")
    assert not refused.ok
    assert re.search(
        r"cannot run a cell: the background run of cell \[\d+\] \(running for \d\.\d s\)",
        refused.error["evalue"],
    )
    assert "%dist_wait waits for it, %dist_interrupt stops it" in refused.error["evalue"]
    waited = nb.execute("%dist_wait", timeout=60)
    assert waited.ok, waited.outputs
    assert waited.data("execute_result") == [{"text/plain": "'trained'"}]
    updates = [t for t, _ in _redraws(nb, started)]
    assert sum(1 for t in updates if t > returned) > 5, "the dashboard stopped updating after --bg returned"
    assert _max_per_second(updates) <= 6
    # the run's own end report goes under the --bg cell
    bg_id = run.reply["parent_header"]["msg_id"]
    reports = [
        m["content"]["text"]
        for _, m in nb.messages
        if m["parent_header"].get("msg_id") == bg_id and m["msg_type"] == "stream"
    ]
    assert any("the background run finished in" in text for text in reports), reports


def test_background_error_is_shown_under_its_cell(nb: Any) -> None:
    run = nb.execute(
        "%%distributed --bg\nimport time\ntime.sleep(0.5)\nif shard.rank == 1:\n    raise KeyError('x')\n"
    )
    assert run.ok
    msg_id = run.reply["parent_header"]["msg_id"]
    deadline = time.monotonic() + 15
    errors: list[dict[str, Any]] = []
    while not errors and time.monotonic() < deadline:
        nb.drain(0.5)
        errors = [
            m["content"]
            for _, m in nb.messages
            if m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "error"
        ]
    assert errors, "the background error was not shown"
    assert errors[0]["ename"] == "DistributedError"
    assert errors[0]["traceback"][0] == "rank 1 failed first: KeyError: 'x'"
    waited = nb.execute("%dist_wait")
    assert not waited.ok and waited.error["evalue"].startswith("rank 1 failed first: KeyError")


def test_dist_interrupt_stops_a_background_run(nb: Any) -> None:
    run = nb.execute("%%distributed --bg\nimport time\nwhile True:\n    time.sleep(0.05)\n")
    assert run.ok
    time.sleep(0.5)
    stop = nb.execute("%dist_interrupt", timeout=15)
    assert stop.ok and stop.elapsed < 10.0
    assert "stopped the background run of cell" in stop.stream()
    assert nb.execute("%%distributed\n'free'").data("execute_result") == [{"text/plain": "'free'"}]


def test_dist_dashboard_follows_the_pool_and_has_an_interrupt_button(nb: Any) -> None:
    run = nb.execute("%dist_dashboard")
    assert run.ok, run.outputs
    button, bundle = run.data()
    assert "application/vnd.jupyter.widget-view+json" in button  # the Interrupt button
    assert isinstance(bundle[LIVE_MIME]["figure"], dict)
    assert '<div class="jshard-dashboard"' in bundle["text/html"]
    assert '<table class="jshard-status"' in bundle["text/html"]
    started = time.monotonic()
    bg = nb.execute(TRAIN.format(opts=" --bg --no-dashboard", steps=60, pause=0.03))
    assert bg.ok
    nb.execute("%dist_wait", timeout=60)
    nb.drain(1.5)
    assert len(_redraws(nb, started)) >= 3, "the %dist_dashboard output did not follow the background run"


def test_history_is_kept_in_the_kernel_and_written_as_csv(nb: Any, tmp_path: Path) -> None:
    target = tmp_path / "metrics.csv"
    run = nb.execute(
        "import jupyter_shard\n"
        "h = jupyter_shard.history()\n"
        f"h.to_csv({str(target)!r})\n"
        "records = list(h)\n"
        "(len(records) > 0, sorted({r['rank'] for r in records}), sorted(h.metrics))"
    )
    assert run.ok, run.outputs
    assert run.data("execute_result") == [{"text/plain": "(True, [0, 1], ['loss', 'lr'])"}]
    plot = nb.execute("fig = h.plot('loss', smooth=0.5)\ntype(fig).__name__, [t.name for t in fig.data]")
    assert plot.data("execute_result") == [{"text/plain": "('Figure', ['rank 0', 'rank 1', 'mean'])"}]
    with target.open() as fh:
        rows = list(csv.DictReader(fh))
    assert rows[0].keys() == {"rank", "step", "time", "loss", "lr"}
    assert {r["rank"] for r in rows} == {"0", "1"}
    assert all(float(r["lr"]) == 0.1 for r in rows)


def test_picker_counts_a_kernel_model_and_its_line_becomes_the_default(nb: Any) -> None:
    run = nb.execute("import torch\nmodel = torch.nn.Linear(1000, 1000)\n%dist_picker model")
    assert run.ok, run.outputs
    (bundle,) = run.data("execute_result")
    assert "application/vnd.jupyter.widget-view+json" in bundle
    check = nb.execute(
        "p = _\n"
        "psi, n = 1000 * 1000 + 1000, 2\n"
        "by = {e.plan.label: e.device_bytes for e in p.estimates}\n"
        "# fp32 Adam on CPU ranks: params 4, grads 4, optimizer 8 bytes per parameter\n"
        "print(by['DDP'] == 16 * psi, by['ZeRO-2'] == 4 * psi + 12 * psi // n, p.line)"
    )
    assert check.ok, check.outputs
    assert check.stream() == "True True %%distributed --strategy ddp --nproc 2 --device cpu\n"
    nb.execute("p.use_as_default()")
    used = nb.execute("%%distributed\nshard.strategy, shard.world_size")
    assert used.data("execute_result") == [{"text/plain": "('ddp', 2)"}]
    bad = nb.execute("%dist_picker nonsense")
    assert "no variable 'nonsense' in the notebook" in bad.stream("stderr")
