"""The live dashboard in JupyterLab (issue 4): a training cell that calls ``shard.log`` shows its
loss chart growing while it runs, and keeps a static copy once it ends.

The dashboard's markup is the contract read here: ``div.jshard-dashboard`` holding
``table.jshard-status`` (a ``tr[data-rank]`` per rank) and one ``svg.jshard-chart[data-metric]`` per
logged scalar plus ``memory``, each with a ``polyline.jshard-trace[data-rank][data-points]`` per rank
(and ``data-rank="mean"``); ``data-points`` counts the rank's whole series so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.ui.conftest import OpenNotebook
from tests.ui.notebook import Notebook

pytestmark = pytest.mark.timeout(300)

NOTEBOOK = "04_dashboard_and_picker.ipynb"
STEPS = 120  # `steps` in the notebook's training cell: points per rank once it ends
MID_RUN_POINTS = 10  # enough points for the mid-run screenshot to show a line

# What the training cell's output area shows of the dashboard, read in one go in the page.
_SNAPSHOT = """
const cell = codeCells()[arg];
const out = cell.querySelector('.jp-OutputArea');
const chart = out.querySelector('.jshard-dashboard svg.jshard-chart[data-metric="loss"]');
const points = {};
for (const trace of chart ? chart.querySelectorAll('polyline.jshard-trace') : []) {
    points[trace.getAttribute('data-rank')] = Number(trace.getAttribute('data-points'));
}
return {
    prompt: promptOf(cell),
    points: points,
    status_ranks: Array.from(out.querySelectorAll('table.jshard-status tr[data-rank]'))
        .map((row) => row.getAttribute('data-rank')),
    memory_chart: !!out.querySelector('.jshard-dashboard svg.jshard-chart[data-metric="memory"]'),
    in_widget: !!(chart && chart.closest('.widget-html')),
};
"""


@dataclass
class DashboardView:
    prompt: str
    points: dict[str, int]  # data-points of each loss trace, by data-rank
    status_ranks: list[str]
    memory_chart: bool
    in_widget: bool  # inside a live ipywidgets HTML view (not the static copy)

    @property
    def rank_points(self) -> int:
        """The longest rank series in the loss chart (0 without one)."""
        return max((n for rank, n in self.points.items() if rank != "mean"), default=0)

    @property
    def running(self) -> bool:
        return self.prompt == "[*]:"


def _view(nb: Notebook, cell: int, until: str, what: str) -> DashboardView:
    """The dashboard under ``cell`` once the page condition ``until`` holds for it (``view`` in scope)."""
    raw: dict[str, Any] = nb.wait_for(
        f"const view = (() => {{ {_SNAPSHOT} }})(); return ({until}) ? view : false;", arg=cell, what=what
    )
    return DashboardView(**raw)


def test_loss_chart_grows_while_training_runs(open_nb: OpenNotebook) -> None:
    nb = open_nb(NOTEBOOK)
    train = nb.find_code_cell("shard.log(loss=loss)")
    nb.run_all()

    has_points = f"Object.entries(view.points).some(([r, n]) => r !== 'mean' && n >= {MID_RUN_POINTS})"
    mid = _view(
        nb, train, f"{has_points} || view.prompt !== '[*]:'", f"{MID_RUN_POINTS} loss points under the cell"
    )
    nb.screenshot("mid-run", show=nb.code_cell(train).locator(".jp-OutputArea"))
    assert mid.running, f"the training cell ended before its dashboard showed loss points: {mid}"
    assert mid.rank_points >= MID_RUN_POINTS > 0
    assert mid.in_widget, "the dashboard under a running cell is not a live widget"
    assert mid.status_ranks == ["0", "1"], mid.status_ranks

    nb.wait_finished(train)
    final = _view(
        nb, train, "view.points['0'] !== undefined && !view.in_widget", "the dashboard's static copy"
    )
    nb.screenshot("finished", show=nb.code_cell(train).locator(".jp-OutputArea"))
    assert final.rank_points > mid.rank_points
    assert {rank: n for rank, n in final.points.items() if rank != "mean"} == {"0": STEPS, "1": STEPS}
    assert "mean" in final.points
    assert final.status_ranks == ["0", "1"], final.status_ranks
    assert final.memory_chart, "no memory chart"
    html = [o for o in nb.outputs(train) if "jshard-dashboard" in o.get("data", {}).get("text/html", "")]
    assert html, "the finished cell keeps no text/html copy of the dashboard"
    assert not any("application/vnd.jupyter.widget-view+json" in o["data"] for o in html)
    assert f"[rank 0] {STEPS} steps on 2 ranks" in nb.output_text(train)

    nb.wait_all_settled()
    nb.screenshot("picker", show=nb.code_cell(nb.find_code_cell("%dist_picker")))
    assert not nb.error_outputs(), nb.error_outputs()
    assert all(p.removeprefix("[").removesuffix("]:").isdigit() for p in nb.prompts()), nb.prompts()
    (logged,) = [
        o for o in nb.outputs(nb.find_code_cell("history()")) if o["output_type"] == "execute_result"
    ]
    assert logged["data"]["text/plain"] == str(2 * STEPS), "jupyter_shard.history() lost records"
