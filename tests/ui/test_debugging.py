"""Debugging a rank in JupyterLab: ``breakpoint()`` on rank 1 is a pdb session in the notebook's own
input box, and JupyterLab's debugger panel stops the ranks at a gutter breakpoint of a
``%%distributed`` cell and reads each rank's variables. Screenshots in ``test-artifacts/ui/``."""

from __future__ import annotations

import pytest

from tests.ui.conftest import OpenNotebook
from tests.ui.notebook import SECOND, Notebook
from tests.ui.test_extension import open_panel

pytestmark = pytest.mark.timeout(300)

NOTEBOOK = "05_when_things_go_wrong.ipynb"
STDIN = ".jp-Stdin-input"


def _setup(nb: Notebook) -> None:
    """The extension and the ranks' ``weights``, as the notebook's first cells make them."""
    for source in ("%load_ext jupyter_shard", "weights = torch.full"):
        index = nb.find_code_cell(source)
        nb.run_cell(index)
        nb.wait_finished(index)


def _answer(nb: Notebook, prompt: str, text: str) -> None:
    """Wait for a fresh input box with ``prompt``, type ``text`` and Enter, as a person would."""
    nb.page.wait_for_function(
        "(sel) => { const boxes = document.querySelectorAll(sel);"
        " return boxes.length > 0 && boxes[boxes.length - 1].value === ''; }",
        arg=STDIN,
        timeout=60 * SECOND,
    )
    prompt_text = nb.page.locator(".jp-Stdin").last.inner_text()
    assert prompt in prompt_text, prompt_text
    box = nb.page.locator(STDIN).last
    box.fill(text)
    box.press("Enter")


def test_breakpoint_on_a_rank_is_a_pdb_session_in_the_input_box(open_nb: OpenNotebook) -> None:
    nb = open_nb(NOTEBOOK)
    _setup(nb)
    open_panel(nb)
    cell = nb.find_code_cell("breakpoint()")
    nb.run_cell(cell)
    # While rank 1 waits at pdb's prompt the kernel is busy in the cell; the panel is told anyway.
    nb.wait_panel_says("waiting for input (rank 1)", timeout=30 * SECOND, what="the panel to show the prompt")
    nb.wait_panel_ranks("at a prompt", 1, timeout=10 * SECOND, what="rank 1 at a prompt in the panel")
    _answer(nb, "[rank 1] (Pdb)", "p local")
    nb.wait_for(
        "return codeCells()[arg].querySelector('.jp-OutputArea').innerText.includes('tensor(3.)');",
        arg=cell,
        timeout=30 * SECOND,
        what="pdb's answer to `p local` (tensor(3.)) in the cell's output",
    )
    nb.screenshot("pdb-on-rank-1", show=nb.code_cell(cell))
    _answer(nb, "[rank 1] (Pdb)", "c")
    nb.wait_finished(cell)
    text = nb.output_text(cell)
    assert "after the stop: 6.0" in text, text
    assert not [o for o in nb.outputs(cell) if o["output_type"] == "error"]
    # The exchange is in rank 1's own output (its tab).
    tabs = nb.code_cell(cell).locator(".jp-ShardRankOutput-tab")
    tabs.filter(has_text="rank 1").first.click()
    shown = nb.code_cell(cell).locator(".jp-OutputArea").inner_text()
    assert "(Pdb) p local" in shown and "tensor(3.)" in shown, shown


def test_the_debugger_panel_stops_the_ranks_at_a_gutter_breakpoint(open_nb: OpenNotebook) -> None:
    nb = open_nb(NOTEBOOK)
    _setup(nb)
    page = nb.page
    cell = nb.find_code_cell("def scale(by)")
    page.locator(".jp-DebuggerBugButton").first.click()  # the notebook toolbar's debugger switch
    gutter = nb.code_cell(cell).locator(".cm-breakpoint-gutter .cm-gutterElement")
    nb.code_cell(cell).scroll_into_view_if_needed()
    gutter.nth(6).wait_for(timeout=30 * SECOND)
    gutter.nth(6).click()  # line 6 (the first element is CodeMirror's spacer): `return factor / …`
    page.locator(".jp-DebuggerBreakpoint-line").first.wait_for(timeout=30 * SECOND)
    assert page.locator(".jp-DebuggerBreakpoint-line").all_inner_texts() == ["6"]
    nb.run_cell(cell)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-DebuggerCallstackFrame-name')]"
        ".filter((e) => e.textContent.startsWith('rank ')).length >= 4",
        timeout=60 * SECOND,
    )
    names = page.locator(".jp-DebuggerCallstackFrame-name").all_inner_texts()
    assert names == ["rank 0 · scale", "rank 0 · <module>", "rank 1 · scale", "rank 1 · <module>"], names
    nb.screenshot("debugger-call-stack", show=nb.code_cell(cell))
    for rank in (0, 1):
        page.locator(".jp-DebuggerCallstackFrame-name", has_text=f"rank {rank} · scale").click()
        page.wait_for_function(
            r"(want) => new RegExp('factor\\s*:?\\s*' + want + '\\b').test("
            r"[...document.querySelectorAll('.jp-DebuggerVariables')].map((e) => e.innerText).join(' '))",
            arg=str(10 * (rank + 1)),
            timeout=30 * SECOND,
        )
        nb.screenshot(f"debugger-variables-rank-{rank}")
    page.locator(".jp-DebuggerSidebar [title^='Continue']").first.click()  # the call stack's ▶
    nb.wait_finished(cell)
    errors = [o for o in nb.outputs(cell) if o["output_type"] == "error"]
    assert errors and "ZeroDivisionError" in errors[0]["evalue"]  # it went on, and failed as written
