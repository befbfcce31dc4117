"""notebooks/07_bring_your_own_code, run from JupyterLab's menu: a torchrun script, Lightning with the
live dashboard, Fabric and a Hugging Face Trainer, with no errors."""

from __future__ import annotations

import pytest

from tests.ui.conftest import OpenNotebook

pytestmark = pytest.mark.timeout(300)


def test_run_all_runs_the_frameworks_unchanged(open_nb: OpenNotebook) -> None:
    nb = open_nb("07_bring_your_own_code.ipynb")
    nb.run_all()
    nb.wait_all_settled()
    assert not nb.error_outputs(), nb.error_outputs()

    script = nb.find_code_cell('dist.init_process_group(backend="gloo")')
    shown = nb.output_text(script)
    assert "[rank 0] 2 processes, launched by torchrun: True" in shown
    assert "the cell closed the process group on rank 0-1 (destroy_process_group)" in shown
    fit = nb.find_code_cell("L.Trainer(")
    nb.screenshot("lightning-fit", show=nb.code_cell(fit))
    shown = nb.output_text(fit)
    assert "[rank 0] DDPStrategy, world size 2, 240 steps" in shown
    assert "2 CPU ranks" in shown and "train_mse" in shown  # the live dashboard, with Lightning's metric
    assert "loss logged at steps [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]" in nb.output_text(
        nb.find_code_cell("hf_loss = ")
    )
