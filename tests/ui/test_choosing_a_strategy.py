"""notebooks/06_choosing_a_strategy, run from JupyterLab's menu: every cell runs, the dry run of a model
built in a ``%%dist_picker`` cell is drawn as the picker's widget and defines no name in the notebook,
and the one cell that fails on purpose (a batch the model cannot take) is last and says so in one line.
JupyterLab's Run All stops at the first cell that fails, tagged ``raises-exception`` or not."""

from __future__ import annotations

import pytest

from tests.ui.conftest import OpenNotebook

pytestmark = pytest.mark.timeout(300)


def test_run_all_reaches_the_end_and_draws_the_dry_run_of_a_cells_model(open_nb: OpenNotebook) -> None:
    nb = open_nb("06_choosing_a_strategy.ipynb")
    nb.run_all()
    nb.wait_all_settled()
    prompts = nb.prompts()
    assert all(p.strip("[]:").isdigit() for p in prompts), prompts  # none left unrun by an error

    cell = nb.find_code_cell("%%dist_picker --batch")
    shown = nb.output_text(cell)
    nb.screenshot("dry-run-from-a-cell", show=nb.code_cell(cell))
    assert "Dry run of" in shown and "Insert as new cell" in shown, shown  # the widget, drawn
    after = nb.output_text(nb.find_code_cell('print("blocks" in globals())'))
    assert after.strip().endswith("False"), after

    last = nb.output_text(len(prompts) - 1)
    assert last.startswith("UsageError: %dist_picker: the model's forward or backward on this batch raised")
    assert len(last.strip().splitlines()) == 1, last
