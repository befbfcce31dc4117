"""The quickstart notebook, run from JupyterLab's menu: rank-labelled output and no errors."""

from __future__ import annotations

import pytest

from tests.ui.conftest import OpenNotebook

pytestmark = pytest.mark.timeout(300)


def test_run_all_shows_rank_output(open_nb: OpenNotebook) -> None:
    nb = open_nb("00_quickstart.ipynb")
    nb.run_all()
    nb.wait_all_settled()
    hello = nb.find_code_cell("all_reduce(t)")
    nb.screenshot("after-run-all", show=nb.code_cell(hello))

    assert not nb.error_outputs(), nb.error_outputs()
    assert all(prompt.removeprefix("[").removesuffix("]:").isdigit() for prompt in nb.prompts()), str(
        nb.prompts()
    )
    shown = nb.output_text(hello)
    assert "[rank 0] rank 0 of 2 on cpu: all_reduce sum = 3" in shown
    assert "[rank 1] rank 1 of 2 on cpu: all_reduce sum = 3" in shown
    trained = nb.output_text(nb.find_code_cell("shard.log(loss=loss)"))
    assert "[rank 0] learned weights [2.0, -3.0, 0.5, 1.0] bias 0.25" in trained
