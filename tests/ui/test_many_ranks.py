"""Sixteen CPU ranks in JupyterLab (64 in ``benchmarks.many_ranks --browser 64``) read like two: a
printing loop opens on its summary (one line per step, with the ranks and the spread of the loss),
every line stays one tab away, a cell where every rank raises its own message shows one traceback with
the messages under it, the dashboard draws a band and a few ranks, not a line each, and the status and
the side panel sum the ranks up.

The notebook is written here, into the server's copy of ``notebooks/``; screenshots of the summary,
every line, the grouped error, the dashboard, the status and the side panel are kept as artifacts.
"""

from __future__ import annotations

import os
import re

import nbformat
import pytest

from tests.ui.conftest import OpenNotebook
from tests.ui.notebook import SECOND
from tests.ui.test_extension import RANK_OUTPUT_MIME, open_panel

pytestmark = pytest.mark.timeout(420)

RANKS = int(os.environ.get("JUPYTER_SHARD_UI_RANKS", "16"))  # 64 in benchmarks.many_ranks --browser
LAST = RANKS - 1
STEPS = 30
NOTEBOOK = "many_ranks.ipynb"
CELLS = [
    "%load_ext jupyter_shard",
    f"%%distributed --nproc {RANKS}\nimport torch.distributed as dist\nrank = dist.get_rank()\n"
    f"for step in range({STEPS}):\n    print(f'step {{step}} loss {{0.5 + rank / 1000:.3f}}')",
    "%%distributed\nraise ValueError(f'bad {rank}')",
    "%%distributed\nimport time\nfor step in range(40):\n"
    "    shard.log(loss=1 / (step + 1) + rank / 100, step=step)\n    time.sleep(0.02)",
    "%dist_dashboard",
    "%dist_status",
    "%dist_shutdown",
]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _write_notebook(root: object) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root) + "/" + NOTEBOOK)


def test_sixteen_ranks_print_a_summary_and_fail_in_one_block(
    open_nb: OpenNotebook, lab_server: object
) -> None:
    _write_notebook(lab_server.root_dir)  # type: ignore[attr-defined]
    nb = open_nb(NOTEBOOK)
    nb.run_cell(0)
    nb.wait_finished(0)
    open_panel(nb)  # the comm opens: rank lines come as the extension's display
    nb.wait_panel_says("no pool", timeout=15 * SECOND, what="the panel before the first %%distributed cell")

    nb.run_cell(1)
    nb.wait_finished(1, timeout=300 * SECOND)
    cell = nb.code_cell(1)
    current = cell.locator(".jp-ShardRankOutput-tab.jp-mod-current")
    assert current.inner_text() == "summary"  # from 9 ranks: the summary first
    tabs = cell.locator(".jp-ShardRankOutput-tab")  # different outputs: one tab choosing among them
    assert tabs.all_inner_texts() == ["summary", "all ranks", "by rank", "diff"]
    body = cell.locator(".jp-ShardRankOutput-body")
    lines = body.inner_text().strip().splitlines()
    assert len(lines) == STEPS, lines[:5]
    assert lines[0] == f"[rank 0-{LAST}] step 0 loss 0.500 (rank 0; loss 0.500–{0.5 + LAST / 1000:.3f})"
    assert lines[-1].startswith(f"[rank 0-{LAST}] step {STEPS - 1} loss 0.500")
    bundles = [o for o in nb.outputs(1) if RANK_OUTPUT_MIME in o.get("data", {})]
    assert len(bundles) == 1
    assert len(bundles[0]["data"]["text/plain"].splitlines()) == STEPS  # what a saved notebook shows
    nb.screenshot("summary", show=cell)
    cell.locator(".jp-ShardRankOutput-tab", has_text="all ranks").click()
    assert len(body.inner_text().strip().splitlines()) == RANKS * STEPS  # every line, one click away
    nb.screenshot("all-lines", show=cell)
    cell.locator(".jp-ShardRankOutput-tab", has_text="by rank").click()
    cell.get_by_label("ranks").select_option(label="rank 5")
    assert body.inner_text().strip().splitlines()[:2] == ["step 0 loss 0.505", "step 1 loss 0.505"]
    nb.screenshot("by-rank", show=cell)
    cell.locator(".jp-ShardRankOutput-tab", has_text="summary").click()  # remembered for later cells

    # the side panel: from 9 ranks a row per state (all ranks idle: one row), within its width (the
    # rest of a row on hover)
    nb.wait_panel_ranks("idle", RANKS, timeout=15 * SECOND, what=f"the panel to show {RANKS} idle ranks")
    assert nb.page.locator("#jupyter-shard-panel tbody tr").count() == 1
    widths = nb.page.evaluate(
        "(() => { const p = document.querySelector('#jupyter-shard-panel');"
        " return [p.scrollWidth, p.clientWidth]; })()"
    )
    assert widths[0] <= widths[1], f"the panel's table is wider than the panel: {widths}"
    first = nb.page.locator("#jupyter-shard-panel tbody tr").first
    assert first.get_attribute("title").startswith(f"ranks 0-{LAST} ({RANKS}): idle\nheartbeat at most ")

    nb.run_cell(2)
    nb.wait_finished(2, timeout=120 * SECOND)
    errors = [o for o in nb.outputs(2) if o["output_type"] == "error"]
    assert len(errors) == 1
    text = _ANSI.sub("", "\n".join(errors[0]["traceback"]))
    assert text.count("──── rank ") == 1, text
    assert f"──── rank 0-{LAST}: ValueError, {RANKS} different messages ────" in text
    assert "[rank 0] ValueError: bad 0" in text and f"[rank {LAST}] ValueError: bad {LAST}" in text
    assert f"… {RANKS - 4} more different messages, on rank 3-{LAST - 1}" in text
    assert len(text.splitlines()) < 25, len(text.splitlines())
    nb.screenshot("grouped-error", show=nb.code_cell(2))

    # the dashboard: the loss as a band with its mean and a few strays, a legend of groups, not a rank each
    nb.run_cell(3)
    nb.wait_finished(3, timeout=120 * SECOND)
    nb.run_cell(4)
    nb.wait_finished(4)
    nb.wait_for(
        "return document.querySelectorAll('.jp-ShardFigure.js-plotly-plot .legend .traces').length > 0;",
        arg=None,
        timeout=30 * SECOND,
        what="the dashboard's figure drawn with its legend",
    )
    legend = nb.page.evaluate(
        "(i) => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell')[i]"
        ".querySelectorAll('.jp-ShardFigure.js-plotly-plot .legend .traces')).map((t) => t.textContent)",
        4,
    )
    assert 0 < len(legend) <= 8 and not any(t.strip() == "rank 9" for t in legend), legend
    nb.screenshot("dashboard", show=nb.code_cell(4).locator(".jp-OutputArea"))

    # the status: a summary line first, then a row per rank on one line each
    nb.run_cell(5)
    nb.wait_finished(5)
    status = nb.code_cell(5).locator(".jp-OutputArea").inner_text().strip().splitlines()
    assert f"{RANKS} ranks: {RANKS} idle" in status and len(status) <= RANKS + 8, status
    nb.screenshot("status", show=nb.code_cell(5))
    nb.screenshot("panel", show=nb.page.locator("#jupyter-shard-panel"))

    nb.run_cell(6)
    nb.wait_finished(6)
