"""Driving one notebook in JupyterLab through the page, as a user would, with real waits.

Cells are found by their position among the code cells, or by a piece of their source. A code
cell's input prompt tells its state: ``[*]:`` while it is queued or running, ``[n]:`` once it ran,
``[ ]:`` when it never ran (or a run was aborted). What a cell shows is read from the DOM; the
output models (their ``output_type``) are read through ``window.jupyterapp``, which the server
exposes for these tests.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

SECOND = 1000  # Playwright timeouts are in milliseconds
OPEN_TIMEOUT = 90 * SECOND
RUN_TIMEOUT = 240 * SECOND
POLL_MS = 100  # how often a wait re-checks its condition in the page

CODE_CELLS = ".jp-Notebook .jp-CodeCell"
PROMPT = ".jp-InputArea-prompt"

# JavaScript shared by the page functions below: the notebook panel of `path`, its code cells' DOM
# nodes and the prompt text of one of them.
_JS_HELPERS = """
const panel = (path) => Array.from(window.jupyterapp.shell.widgets('main'))
    .find((w) => w.context && w.context.path === path);
const codeCells = () => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell'));
const promptOf = (cell) => cell.querySelector('.jp-InputArea-prompt').textContent.replace(/\\s/g, '');
"""


def _js(body: str) -> str:
    """A page function ``(arg) => ...`` with the helpers above in scope."""
    return f"(arg) => {{ {_JS_HELPERS} {body} }}"


class Notebook:
    """One notebook open in its own JupyterLab workspace."""

    def __init__(self, page: Page, path: str, artifacts: Path, prefix: str) -> None:
        self.page = page
        self.path = path
        self.artifacts = artifacts
        self.prefix = prefix

    def wait_kernel_idle(self, timeout: float = OPEN_TIMEOUT) -> None:
        """The notebook's kernel is connected and idle (the toolbar's status can say idle earlier)."""
        self.wait_for(
            "const k = panel(arg)?.sessionContext?.session?.kernel;"
            "return !!k && k.connectionStatus === 'connected' && k.status === 'idle';",
            arg=self.path,
            timeout=timeout,
            what="its kernel to be connected and idle",
        )

    def code_cell(self, index: int) -> Locator:
        return self.page.locator(CODE_CELLS).nth(index)

    def code_cell_count(self) -> int:
        return self.page.locator(CODE_CELLS).count()

    def find_code_cell(self, source: str) -> int:
        """The index (among code cells) of the only code cell whose source contains ``source``."""
        sources: list[str] = self.page.evaluate(
            _js("return panel(arg).content.widgets.filter((c) => c.model.type === 'code')"
                ".map((c) => c.model.sharedModel.getSource());"),
            self.path,
        )  # fmt: skip
        found = [i for i, text in enumerate(sources) if source in text]
        assert len(found) == 1, f"{len(found)} code cells contain {source!r} in {self.path}"
        return found[0]

    def prompts(self) -> list[str]:
        """The input prompt of every code cell, without spaces: ``[*]:``, ``[3]:``, ``[]:``."""
        prompts: list[str] = self.page.evaluate(_js("return codeCells().map(promptOf);"))
        return prompts

    def clear_all_outputs(self) -> None:
        """Edit → Clear Outputs of All Cells: no stored output or prompt number is left."""
        self._menu("Edit", "editmenu:clear-all")
        self.wait_for(
            "return codeCells().every((c) => promptOf(c) === '[]:'"
            " && c.querySelectorAll('.jp-OutputArea-child').length === 0);",
            what="all outputs and prompt numbers to be cleared",
        )

    def run_all(self) -> None:
        """Clear all outputs, then Run → Run All Cells; returns once every code cell is queued."""
        self.wait_kernel_idle()
        self.clear_all_outputs()
        self._menu("Run", "runmenu:run-all")
        self.wait_for(
            "return codeCells().every((c) => promptOf(c) !== '[]:');",
            timeout=10 * SECOND,
            what="Run All Cells to queue every code cell",
        )

    def _menu(self, menu: str, command: str) -> None:
        self.page.locator("#jp-MainMenu").get_by_role("menuitem", name=menu, exact=True).click()
        self.page.locator(f'.lm-Menu [data-command="{command}"]').click()

    def run_cell(self, index: int) -> None:
        """Select code cell ``index`` and run it (Run → Run Selected Cell), as a user would."""
        self.page.evaluate(
            _js("const cells = panel(arg.path).content.widgets;"
                "const code = cells.filter((c) => c.model.type === 'code');"
                "panel(arg.path).content.activeCellIndex = cells.indexOf(code[arg.index]);"
                "void window.jupyterapp.commands.execute('notebook:run-cell');"),
            {"path": self.path, "index": index},
        )  # fmt: skip

    def wait_running(self, index: int, timeout: float = RUN_TIMEOUT) -> None:
        """Code cell ``index`` shows ``[*]:`` (queued or running)."""
        self.wait_for(
            "return promptOf(codeCells()[arg]) === '[*]:';",
            arg=index,
            timeout=timeout,
            what=f"[*] on cell {index}",
        )

    def wait_finished(self, index: int, timeout: float = RUN_TIMEOUT) -> int:
        """Wait until code cell ``index`` shows ``[n]:``; return n."""
        self.wait_for(
            r"return /^\[\d+\]:$/.test(promptOf(codeCells()[arg]));",
            arg=index,
            timeout=timeout,
            what=f"code cell {index} to finish",
        )
        match = re.fullmatch(r"\[(\d+)\]:", self.prompts()[index])
        assert match is not None
        return int(match.group(1))

    def wait_all_settled(self, timeout: float = RUN_TIMEOUT) -> None:
        """No code cell is queued or running any more (after an error the rest show ``[ ]:``)."""
        self.wait_for(
            "return codeCells().every((c) => promptOf(c) !== '[*]:');",
            timeout=timeout,
            what="every code cell to finish",
        )

    def wait_for(self, body: str, arg: Any = None, timeout: float = RUN_TIMEOUT, what: str = "") -> Any:
        """Wait until the page function ``body`` (helpers in scope) returns a truthy value; return it."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            handle = self.page.wait_for_function(_js(body), arg=arg, timeout=timeout, polling=POLL_MS)
        except PlaywrightTimeout:
            raise AssertionError(
                f"{self.path}: timed out after {timeout / SECOND:.0f} s waiting for {what or body}"
            ) from None
        return handle.json_value()

    def wait_panel_says(self, prefix: str, timeout: float, what: str) -> None:
        """The jupyter_shard side panel's state line starts with ``prefix``."""
        self.wait_for(
            "return document.querySelector('#jupyter-shard-panel .jp-ShardPanel-state')"
            ".textContent.startsWith(arg);",
            arg=prefix,
            timeout=timeout,
            what=what,
        )

    def wait_panel_ranks(self, state: str, count: int, timeout: float, what: str) -> None:
        """The jupyter_shard side panel shows ``count`` ranks in ``state`` (from 9 ranks its rows
        stand for several ranks each: ``data-count``)."""
        self.wait_for(
            "return Array.from(document.querySelectorAll("
            '`#jupyter-shard-panel tr[data-state="${arg.state}"]`))'
            ".reduce((n, tr) => n + Number(tr.dataset.count), 0) === arg.count;",
            arg={"state": state, "count": count},
            timeout=timeout,
            what=what,
        )

    def outputs(self, index: int) -> list[dict[str, Any]]:
        """Code cell ``index``'s outputs as nbformat dicts, from the notebook model."""
        outputs: list[dict[str, Any]] = self.page.evaluate(
            _js("return panel(arg.path).content.widgets.filter((c) => c.model.type === 'code')"
                "[arg.index].model.outputs.toJSON();"),
            {"path": self.path, "index": index},
        )  # fmt: skip
        return outputs

    def error_outputs(self) -> list[dict[str, Any]]:
        """Every ``error`` output in the notebook."""
        return [
            out
            for index in range(self.code_cell_count())
            for out in self.outputs(index)
            if out["output_type"] == "error"
        ]

    def output_text(self, index: int) -> str:
        """What code cell ``index``'s output area shows, as text."""
        return self.code_cell(index).locator(".jp-OutputArea").inner_text()

    def screenshot(self, name: str, show: Locator | None = None) -> Path:
        """A screenshot of the page, scrolled to ``show`` first; kept in the artifacts folder."""
        if show is not None:
            show.scroll_into_view_if_needed()
        path = self.artifacts / f"{self.prefix}-{name}.png"
        self.page.screenshot(path=path)
        return path


def open_notebook(page: Page, base_url: str, path: str, artifacts: Path, prefix: str) -> Notebook:
    """Open ``path`` in a fresh workspace; return once its cells are shown and its kernel is idle."""
    page.goto(base_url)
    page.locator(CODE_CELLS).first.wait_for(timeout=OPEN_TIMEOUT)
    notebook = Notebook(page, path, artifacts, prefix)
    notebook.wait_kernel_idle()
    return notebook
