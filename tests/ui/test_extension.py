"""The jupyter_shard JupyterLab extension in a real JupyterLab: side panel, status bar, insert-cell.

The quickstart's last cell shuts the pool down, so after Run All the panel says "no pool"; running
the hello cell again starts 2 ranks, which the panel (polling the kernel's ``jupyter_shard`` comm)
shows idle. The picker's "Insert as new cell" button goes through the extension into the notebook.
"""

from __future__ import annotations

import pytest

from tests.ui.conftest import OpenNotebook
from tests.ui.notebook import SECOND, Notebook

pytestmark = pytest.mark.timeout(300)

PANEL = "#jupyter-shard-panel"
RANK_OUTPUT_MIME = "application/vnd.jupyter-shard.rank-output+json"


def open_panel(nb: Notebook) -> None:
    """Click the "Distributed" tab of the right sidebar."""
    nb.page.locator('.jp-SideBar .lm-TabBar-tab[data-id="jupyter-shard-panel"]').click()
    nb.page.locator(PANEL).wait_for(state="visible", timeout=10 * SECOND)


def test_side_panel_shows_the_pool_and_picker_inserts_a_cell(open_nb: OpenNotebook) -> None:
    nb = open_nb("00_quickstart.ipynb")
    nb.run_all()
    nb.wait_all_settled()
    assert not nb.error_outputs(), nb.error_outputs()

    open_panel(nb)
    state = nb.page.locator(f"{PANEL} .jp-ShardPanel-state")
    nb.wait_panel_says("no pool", timeout=10 * SECOND, what="the panel to say 'no pool' after %dist_shutdown")

    hello = nb.find_code_cell("all_reduce(t)")
    nb.run_cell(hello)
    nb.wait_finished(hello)
    nb.wait_panel_ranks(
        "idle", 2, timeout=15 * SECOND, what="the panel to show 2 idle ranks (it polls every 2 s)"
    )
    assert nb.page.locator(f"{PANEL} .jp-ShardPanel-header").inner_text() == "2 CPU ranks · ddp"
    assert state.inner_text() == "idle"
    ranks = nb.page.locator(f"{PANEL} tbody tr")
    assert [ranks.nth(k).locator("td").first.inner_text() for k in range(2)] == ["0", "1"]
    status_item = nb.page.locator(".jp-ShardStatus")
    assert status_item.is_visible()
    assert status_item.inner_text() == "2 CPU ranks · ddp · idle"
    nb.screenshot("side-panel", show=nb.code_cell(hello))

    # The comm is open, so the hello cell's lines came as one rank-output display: tabs, with the
    # `[rank k]` lines in "all ranks" (where a 2-rank cell opens) and as the saved text/plain fallback.
    bundles = [o for o in nb.outputs(hello) if RANK_OUTPUT_MIME in o.get("data", {})]
    assert len(bundles) == 1, nb.outputs(hello)
    assert "[rank 1] rank 1 of 2 on cpu: all_reduce sum = 3" in bundles[0]["data"]["text/plain"]
    tabs = nb.code_cell(hello).locator(".jp-ShardRankOutput-tab")
    assert tabs.all_inner_texts() == ["summary", "all ranks", "rank 0", "rank 1", "diff"]
    assert "[rank 0] rank 0 of 2 on cpu: all_reduce sum = 3" in nb.output_text(hello)
    # the summary: the line both ranks printed, once, with the range of the number that differs
    tabs.nth(0).click()
    assert nb.code_cell(hello).locator(".jp-ShardRankOutput-body").inner_text().strip() == (
        "[rank 0-1] rank 0 of 2 on cpu: all_reduce sum = 3 (rank 0; rank 0–1)"
    )
    tabs.nth(1).click()  # and back: the next cells open on every line, as chosen here
    tabs.nth(3).click()
    assert nb.output_text(hello).strip().endswith("rank 1 of 2 on cpu: all_reduce sum = 3")
    nb.screenshot("rank-tabs", show=nb.code_cell(hello))

    # The diff tab compares rank 0 with the first rank whose output differs; either side can change.
    tabs.nth(4).click()
    body = nb.code_cell(hello).locator(".jp-ShardRankOutput-body")
    assert [t.strip() for t in body.locator(".jp-ShardRankOutput-del").all_inner_texts()] == [
        "- rank 0 of 2 on cpu: all_reduce sum = 3"
    ]
    assert [t.strip() for t in body.locator(".jp-ShardRankOutput-add").all_inner_texts()] == [
        "+ rank 1 of 2 on cpu: all_reduce sum = 3"
    ]
    summary = nb.code_cell(hello).locator(".jp-ShardRankOutput-diffSummary")
    assert summary.inner_text().strip() == "· 1 only on rank 0, 1 only on rank 1"
    nb.screenshot("rank-diff", show=nb.code_cell(hello))
    nb.code_cell(hello).get_by_label("second rank").select_option("0")
    assert summary.inner_text().strip() == "· identical"
    assert body.locator(".jp-ShardRankOutput-same").count() == 1

    # Identical output (DDP keeps the replicas equal) is one tab for both ranks, with no diff tab.
    # Run All sent every cell before the comm opened, so the model, training and "agree" cells run
    # again, now with the comm open.
    for source in ("shard.prepare(model, opt)", "shard.log(loss=loss)", 'print("weights", weights'):
        index = nb.find_code_cell(source)
        nb.run_cell(index)
        nb.wait_finished(index)
    agree = nb.find_code_cell('print("weights", weights')
    agree_tabs = nb.code_cell(agree).locator(".jp-ShardRankOutput-tab")
    assert agree_tabs.all_inner_texts() == ["summary", "all ranks", "ranks 0–1"]
    agree_tabs.nth(2).click()
    agree_body = nb.code_cell(agree).locator(".jp-ShardRankOutput-body")
    assert agree_body.inner_text().strip() == "weights [2.0, -3.0, 0.5, 1.0] bias 0.25"
    nb.screenshot("rank-tabs-collapsed", show=nb.code_cell(agree))

    nb.page.locator(f'{PANEL} button[data-request="stacks"]').click()
    nb.wait_for(
        "return document.querySelector('#jupyter-shard-panel .jp-ShardPanel-stacks')"
        ".textContent.includes('──── rank 1 ────');",
        timeout=15 * SECOND,
        what="the stacks of both ranks in the panel",
    )

    # The picker's button: the extension inserts its %%distributed line as a new cell below.
    cells_before = nb.code_cell_count()
    picker = nb.find_code_cell("%dist_status")
    set_source(nb, picker, "%dist_picker 1.3B")
    nb.run_cell(picker)
    nb.wait_finished(picker)
    nb.code_cell(picker).get_by_role("button", name="Insert as new cell").click()
    nb.wait_for(
        f"return codeCells().length === {cells_before + 1};",
        timeout=10 * SECOND,
        what="a new code cell from the picker",
    )
    inserted = nb.page.evaluate(
        """(arg) => {
            const panel = Array.from(window.jupyterapp.shell.widgets('main'))
                .find((w) => w.context && w.context.path === arg.path);
            const code = panel.content.widgets.filter((c) => c.model.type === 'code');
            return code[arg.index + 1].model.sharedModel.getSource();
        }""",
        {"path": nb.path, "index": picker},
    )
    assert inserted.startswith("%%distributed"), inserted
    nb.screenshot("picker-inserted-cell", show=nb.code_cell(picker + 1))


def set_source(nb: Notebook, index: int, source: str) -> None:
    """Replace code cell ``index``'s source (as typing would)."""
    nb.page.evaluate(
        """(arg) => {
            const panel = Array.from(window.jupyterapp.shell.widgets('main'))
                .find((w) => w.context && w.context.path === arg.path);
            const code = panel.content.widgets.filter((c) => c.model.type === 'code');
            code[arg.index].model.sharedModel.setSource(arg.source);
        }""",
        {"path": nb.path, "index": index, "source": source},
    )


def test_panel_follows_and_interrupts_a_running_cell(open_nb: OpenNotebook) -> None:
    nb = open_nb("00_quickstart.ipynb")
    for source in ("%load_ext jupyter_shard", "all_reduce(t)"):
        index = nb.find_code_cell(source)
        nb.run_cell(index)
        nb.wait_finished(index)
    open_panel(nb)
    nb.wait_panel_ranks("idle", 2, timeout=15 * SECOND, what="the panel to show 2 idle ranks")

    slow = nb.find_code_cell("%dist_status")
    ticks = "for i in range(1200):\n    if i % 10 == 0:\n        print('tick', i)\n    time.sleep(0.1)"
    set_source(nb, slow, f"%%distributed\nimport time\n{ticks}")
    nb.run_cell(slow)
    nb.wait_running(slow)
    # The rank tabs stream: lines printed a second apart show while the cell still runs.
    nb.wait_for(
        "const body = codeCells()[arg].querySelector('.jp-ShardRankOutput-body');"
        "return promptOf(codeCells()[arg]) === '[*]:' && !!body"
        " && body.textContent.includes('[rank 1] tick 10') && body.textContent.includes('[rank 0] tick 10');",
        arg=slow,
        timeout=20 * SECOND,
        what="both ranks' 'tick 10' lines in the rank tabs while the cell runs",
    )
    # Either the kernel answers between its own steps (the ranks show running) or it holds the
    # request until the cell ends (the panel keeps the last status and says "kernel busy").
    nb.wait_for(
        "const state = document.querySelector('#jupyter-shard-panel .jp-ShardPanel-state').textContent;"
        "return state.includes('kernel busy') || (state === 'running'"
        " && document.querySelectorAll('#jupyter-shard-panel tr[data-state=\"running\"]').length === 2);",
        timeout=15 * SECOND,
        what="the panel to show the running cell (or say the kernel is busy)",
    )
    nb.screenshot("running", show=nb.code_cell(slow))
    nb.page.locator(f'{PANEL} button[data-request="interrupt"]').click()
    nb.wait_finished(slow, timeout=30 * SECOND)
    assert "KeyboardInterrupt" in nb.output_text(slow)
    nb.wait_for(
        "return document.querySelectorAll('#jupyter-shard-panel tr[data-state=\"interrupted\"]').length === 2"
        " && document.querySelector('#jupyter-shard-panel .jp-ShardPanel-state').textContent"
        " === 'interrupted';",
        timeout=15 * SECOND,
        what="the panel to show both ranks interrupted (not failed), the kernel no longer busy",
    )
    nb.screenshot("after-interrupt", show=nb.code_cell(slow))
