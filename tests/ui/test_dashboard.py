"""The live dashboard in JupyterLab: a training cell that calls ``shard.log`` shows its Plotly figure
growing while it runs, with hover values, legend toggles, zoom and a log switch that survive redraws,
and the saved notebook shows the same interactive figure without a kernel.

The figure is read from the page: the dashboard's output holds a ``.jp-ShardFigure`` (the extension's
renderer, a Plotly graph div) whose traces carry ``uid`` ``loss-<rank>`` / ``loss-mean`` /
``memory-<rank>-<field>`` and ``meta.points`` (the rank's whole series so far, however few are drawn);
the status table is its ``table`` trace; ``data-draws`` counts the figures it has drawn.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.ui import server as lab
from tests.ui.conftest import OpenNotebook
from tests.ui.notebook import Notebook

PLOTLY_MIME = "application/vnd.plotly.v1+json"
FIGURE_MIME = "application/vnd.jupyter-shard.figure+json"

pytestmark = pytest.mark.timeout(300)

NOTEBOOK = "04_dashboard_and_picker.ipynb"
STEPS = 120  # `steps` in the notebook's training cell: points per rank once it ends
MID_RUN_POINTS = 10  # enough points for the mid-run screenshot to show a line

# What the training cell's output area shows of the dashboard, read in one go in the page.
_SNAPSHOT = """
const cell = codeCells()[arg];
const gd = cell.querySelector('.jp-OutputArea .jp-ShardFigure.js-plotly-plot');
const traces = gd && gd._fullData ? gd._fullData : [];
const points = {};
for (const t of traces) {
    if (t.uid && t.uid.startsWith('loss-')) { points[t.uid.slice(5)] = t.meta.points; }
}
const table = traces.find((t) => t.type === 'table');
const model = panel(arg2).content.widgets.filter((c) => c.model.type === 'code')[arg].model;
const mime = 'application/vnd.jupyter-shard.figure+json';
const figureOutput = model.outputs.toJSON().find((o) => o.data && o.data[mime]);
return {
    prompt: promptOf(cell),
    points: points,
    status_ranks: table ? table.cells.values[0].map(String) : [],
    memory_chart: traces.some((t) => t.uid && t.uid.startsWith('memory-')),
    live: !!figureOutput && typeof figureOutput.data[mime].figure === 'object',
    draws: gd ? Number(gd.dataset.draws || 0) : 0,
};
"""


@dataclass
class DashboardView:
    prompt: str
    points: dict[str, int]  # meta.points of each loss trace, by rank ("mean" too)
    status_ranks: list[str]
    memory_chart: bool
    live: bool  # the output still holds the live figure (not yet the saved Plotly figure)
    draws: int

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
        f"const arg2 = {json.dumps(nb.path)}; const view = (() => {{ {_SNAPSHOT} }})();"
        f" return ({until}) ? view : false;",
        arg=cell,
        what=what,
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
    assert mid.live, "the dashboard under a running cell is not the live figure"
    assert mid.status_ranks == ["0", "1"], mid.status_ranks

    nb.wait_finished(train)
    final = _view(nb, train, "view.points['0'] !== undefined && !view.live", "the dashboard's saved figure")
    nb.screenshot("finished", show=nb.code_cell(train).locator(".jp-OutputArea"))
    assert final.rank_points > mid.rank_points
    assert {rank: n for rank, n in final.points.items() if rank != "mean"} == {"0": STEPS, "1": STEPS}
    assert "mean" in final.points
    assert final.status_ranks == ["0", "1"], final.status_ranks
    assert final.memory_chart, "no memory chart"
    saved = [o for o in nb.outputs(train) if PLOTLY_MIME in o.get("data", {})]
    assert saved, "the finished cell keeps no Plotly figure"
    assert saved[0]["data"]["text/html"].startswith('<div class="jshard-dashboard"'), "no HTML fallback"
    assert not any("application/vnd.jupyter.widget-view+json" in o["data"] for o in saved)
    assert f"[rank 0] {STEPS} steps on 2 ranks" in nb.output_text(train)

    nb.wait_all_settled()
    nb.screenshot("picker", show=nb.code_cell(nb.find_code_cell("%dist_picker")))
    assert not nb.error_outputs(), nb.error_outputs()
    assert all(p.removeprefix("[").removesuffix("]:").isdigit() for p in nb.prompts()), nb.prompts()
    (logged,) = [
        o for o in nb.outputs(nb.find_code_cell("history()")) if o["output_type"] == "execute_result"
    ]
    assert logged["data"]["text/plain"] == str(2 * STEPS), "jupyter_shard.history() lost records"


INTERACTIVE = "dashboard_interactive.ipynb"
# Logs until the test creates STOP: as long as the interactions take, no longer.
TRAIN_UNTIL_STOPPED = """%%distributed --nproc 2 --device cpu
import os, time
step = 0
while not os.path.exists({stop!r}) and step < 4000:
    step += 1
    shard.log(loss=1.0 / step + 0.5 * shard.rank)
    time.sleep(0.05)
shard.print0("stopped")
"""

# The graph div of the dashboard under code cell `arg.cell`, and helpers on it.
_GD = """
const gd = codeCells()[arg.cell].querySelector('.jp-OutputArea .jp-ShardFigure.js-plotly-plot');
const trace = (uid) => gd._fullData.find((t) => t.uid === uid);
const pixel = (x, y) => {  // page coordinates of a point of the loss chart (axes x, y)
    const rect = gd.getBoundingClientRect(), xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
    return [rect.left + xa._offset + xa.l2p(x), rect.top + ya._offset + ya.l2p(y)];
};
"""


def _gd(nb: Notebook, cell: int, body: str, **arg: Any) -> Any:
    return nb.page.evaluate(f"(arg) => {{ {_js_helpers()} {_GD} {body} }}", {"cell": cell, **arg})


def _wait_gd(nb: Notebook, cell: int, body: str, what: str, **arg: Any) -> Any:
    return nb.wait_for(
        f"{_GD} if (!gd || !gd._fullData) return false; {body}", arg={"cell": cell, **arg}, what=what
    )


def _js_helpers() -> str:
    from tests.ui import notebook

    return notebook._JS_HELPERS


def _draws(nb: Notebook, cell: int) -> int:
    return int(_gd(nb, cell, "return Number(gd.dataset.draws || 0);"))


def _click_until(nb: Notebook, cell: int, selector: str, text: str, done: str, what: str) -> None:
    """Click the figure's ``selector`` element showing ``text`` until ``done`` holds. Plotly rebuilds
    the legend and buttons on every redraw, several a second: a click whose press and release land
    on either side of one reaches no element (seen under a loaded CPU), so it is clicked once more."""
    for attempt in range(3):
        nb.code_cell(cell).locator(selector, has_text=text).first.click()
        try:
            nb.wait_for(
                f"{_GD} if (!gd || !gd._fullData) return false; {done}", arg={"cell": cell}, timeout=5_000
            )
            return
        except AssertionError:
            if attempt == 2:
                raise AssertionError(f"three clicks and still not: {what}") from None


def _after_redraws(nb: Notebook, cell: int, count: int = 3) -> None:
    """Wait until the figure has been redrawn ``count`` more times with new data."""
    seen = _draws(nb, cell)
    _wait_gd(nb, cell, "return Number(gd.dataset.draws) >= arg.n;", f"{count} redraws", n=seen + count)


def test_hover_legend_zoom_and_log_switch_survive_redraws_and_the_saved_figure_opens_without_kernel(
    open_nb: OpenNotebook, lab_server: lab.LabServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    stop = tmp_path / "stop"
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [
        nbformat.v4.new_code_cell("%load_ext jupyter_shard"),
        nbformat.v4.new_code_cell(TRAIN_UNTIL_STOPPED.format(stop=str(stop))),
    ]
    nbformat.write(notebook, lab_server.root_dir / INTERACTIVE)
    nb = open_nb(INTERACTIVE)
    train = 1
    nb.run_all()
    _wait_gd(nb, train, "return (trace('loss-0')?.meta.points ?? 0) >= 40;", "40 loss points on rank 0")
    nb.screenshot("live", show=nb.code_cell(train).locator(".jp-OutputArea"))

    # a legend click hides rank 1 in every chart, and it stays hidden as new data is drawn
    _click_until(
        nb,
        train,
        ".jp-ShardFigure .legend .traces",
        "rank 1",
        "return trace('loss-1').visible === 'legendonly';",
        "rank 1 hidden by the legend click",
    )
    _after_redraws(nb, train)
    hidden = _gd(
        nb,
        train,
        "return gd._fullData.filter((t) => t.legendgroup === 'rank 1').map((t) => [t.uid, t.visible]);",
    )
    assert hidden and all(visible == "legendonly" for _, visible in hidden), hidden
    assert {uid.split("-")[0] for uid, _ in hidden} == {"loss", "memory"}
    shown = _gd(nb, train, "return trace('loss-0').visible;")
    assert shown is True

    # a box zoom on the loss chart stays while the series keeps growing
    x0, x1, top, bottom = _gd(
        nb,
        train,
        "const ya = gd._fullLayout.yaxis, top = gd.getBoundingClientRect().top + ya._offset;"
        "return [pixel(10, 0)[0], pixel(30, 0)[0], top + 2, top + ya._length - 2];",
    )
    nb.page.mouse.move(x0, top)
    nb.page.mouse.down()
    nb.page.mouse.move((x0 + x1) / 2, (top + bottom) / 2, steps=5)
    nb.page.mouse.move(x1, bottom, steps=5)
    nb.page.mouse.up()
    zoomed = _gd(nb, train, "return [gd._fullLayout.xaxis.range.slice(), trace('loss-0').meta.points];")
    (low, high), points = zoomed
    assert 5 < low < high < 45 < points, zoomed  # the axis moves as data arrives: about steps 10..30
    _after_redraws(nb, train)
    kept = _gd(nb, train, "return [gd._fullLayout.xaxis.range.slice(), trace('loss-0').meta.points];")
    assert kept[0] == zoomed[0], "a redraw reset the zoom"
    assert kept[1] > zoomed[1], "no new points were drawn meanwhile"
    nb.screenshot("zoomed-rank-1-hidden", show=nb.code_cell(train).locator(".jp-OutputArea"))

    # hovering rank 0's point in the middle of the zoomed steps reads its value
    step = round((low + high) / 2)
    _hover_reads(nb, train, step=step, value=1.0 / step)

    # the linear/log switch of the loss chart stays on log across redraws
    _click_until(
        nb,
        train,
        ".jp-ShardFigure .updatemenu-button",
        "log",
        "return gd._fullLayout.yaxis.type === 'log';",
        "the loss chart on a log scale",
    )
    _after_redraws(nb, train)
    assert _gd(nb, train, "return gd._fullLayout.yaxis.type;") == "log"
    assert _gd(nb, train, "return gd._fullLayout.yaxis2.type;") == "linear", "only the loss chart switched"

    # the cell ends: the output becomes the saved Plotly figure, drawn in place (choices kept)
    stop.touch()
    nb.wait_finished(train)
    _wait_gd(nb, train, "return Number(gd.dataset.draws) > 0;", "the final figure")
    outputs = [o for o in nb.outputs(train) if PLOTLY_MIME in o.get("data", {})]
    assert len(outputs) == 1 and outputs[0]["data"][FIGURE_MIME] == {"figure": PLOTLY_MIME}
    assert _gd(nb, train, "return trace('loss-1').visible;") == "legendonly"
    nb.screenshot("finished", show=nb.code_cell(train).locator(".jp-OutputArea"))
    nb.page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    nb.wait_for(
        "return !panel(arg).context.model.dirty;",
        arg=nb.path,
        timeout=30_000,
        what="the notebook to be saved",
    )
    saved = nbformat.read(lab_server.root_dir / INTERACTIVE, as_version=4)
    (figure,) = [o for o in saved.cells[train].outputs if PLOTLY_MIME in o.get("data", {})]
    assert {"text/html", "text/plain", FIGURE_MIME} <= set(figure.data)
    ranks = {t["name"] for t in figure.data[PLOTLY_MIME]["data"] if t.get("uid", "").startswith("loss-")}
    assert ranks == {"rank 0", "rank 1", "mean"}

    # reopened in a fresh workspace with its kernel shut down: the chart is interactive
    lab_server.shutdown_kernels()
    reopened = open_nb(INTERACTIVE)
    lab_server.shutdown_kernels()
    reopened.wait_for(
        "return !panel(arg).sessionContext.session?.kernel;",
        arg=INTERACTIVE,
        what="no kernel for the notebook",
    )
    _wait_gd(reopened, train, "return !!trace('loss-0') && !!trace('loss-mean');", "the saved figure")
    _hover_reads(reopened, train, step=20, value=1.0 / 20)
    reopened.screenshot("reopened-without-kernel", show=reopened.code_cell(train).locator(".jp-OutputArea"))

    # and in Notebook 7, served by the same server
    if importlib.util.find_spec("notebook") is not None:
        open_nb7: OpenNotebook = request.getfixturevalue("open_nb7")
        nb7 = open_nb7(INTERACTIVE)
        lab_server.shutdown_kernels()
        _wait_gd(nb7, train, "return !!trace('loss-0') && !!trace('loss-mean');", "the figure in Notebook 7")
        _hover_reads(nb7, train, step=20, value=1.0 / 20)
        nb7.screenshot("notebook7-without-kernel", show=nb7.code_cell(train).locator(".jp-OutputArea"))


def _hover_reads(nb: Notebook, cell: int, step: int, value: float) -> None:
    """Move the mouse onto rank 0's loss point at ``step`` and read Plotly's hover label."""
    expected = (f"rank 0 · step {step}loss {value:.6g}",)  # the label's two lines, as text
    text = ""
    for _ in range(5):  # the page may still be laying the output out: aim again
        x, y = _gd(nb, cell, "return pixel(arg.step, arg.value);", step=step, value=value)
        nb.page.mouse.move(x - 30, y - 30)
        nb.page.mouse.move(x, y, steps=4)
        label = nb.code_cell(cell).locator(".jp-ShardFigure .hoverlayer .hovertext").first
        label.wait_for(timeout=10_000)
        # Plotly throttles hover events: the label first shown may be for a point passed on the way,
        # and the one for where the mouse stopped follows within its throttle (50 ms) on a busy page
        for _ in range(20):
            text = label.text_content() or ""
            if text in expected:
                return
            nb.page.wait_for_timeout(100)
    raise AssertionError(f"hovering rank 0 at step {step} shows {text!r}, not {expected[0]!r}")
