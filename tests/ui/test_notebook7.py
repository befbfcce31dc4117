"""The extension in Notebook 7 (the same server, its ``/notebooks/`` page): rank tabs and side panel.

Notebook 7 has no status bar, so only the rank-output renderer and the "Distributed" panel (in its
right sidebar) are checked; the same plugin serves both front ends.
"""

from __future__ import annotations

import pytest

from tests.ui.conftest import OpenNotebook
from tests.ui.notebook import SECOND

pytestmark = pytest.mark.timeout(300)

PANEL = "#jupyter-shard-panel"


def test_rank_tabs_and_side_panel_in_notebook7(open_nb7: OpenNotebook) -> None:
    nb = open_nb7("00_quickstart.ipynb")
    assert nb.page.url.split("?")[0].endswith("/notebooks/00_quickstart.ipynb")
    assert nb.page.evaluate("document.body.dataset.notebook") == "notebooks"  # Notebook 7's page

    load = nb.find_code_cell("%load_ext jupyter_shard")
    nb.run_cell(load)
    nb.wait_finished(load)
    # The panel lives in Notebook 7's right sidebar; showing it opens the comm to the kernel.
    nb.page.evaluate("window.jupyterapp.shell.activateById('jupyter-shard-panel')")
    nb.page.locator(PANEL).wait_for(state="visible", timeout=10 * SECOND)
    nb.wait_panel_says(
        "no pool", timeout=15 * SECOND, what="the panel to say 'no pool' before the first %%distributed cell"
    )

    hello = nb.find_code_cell("all_reduce(t)")
    nb.run_cell(hello)
    nb.wait_finished(hello)
    tabs = nb.code_cell(hello).locator(".jp-ShardRankOutput-tab")
    assert tabs.all_inner_texts() == ["summary", "all ranks", "rank 0", "rank 1", "diff"]
    body = nb.code_cell(hello).locator(".jp-ShardRankOutput-body")
    assert "[rank 1] rank 1 of 2 on cpu: all_reduce sum = 3" in body.inner_text()  # 2 ranks: every line
    tabs.nth(2).click()
    assert body.inner_text().strip() == "rank 0 of 2 on cpu: all_reduce sum = 3"

    nb.wait_panel_ranks("idle", 2, timeout=15 * SECOND, what="the panel to show 2 idle ranks")
    assert nb.page.locator(f"{PANEL} .jp-ShardPanel-header").inner_text() == "2 CPU ranks · ddp"
    nb.screenshot("notebook7", show=nb.code_cell(hello))
