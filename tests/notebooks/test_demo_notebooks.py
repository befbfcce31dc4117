"""The demo notebooks: stored the way nbval needs them, and runnable by the headless runner.

nbval itself (``pytest --nbval --nbval-current-env notebooks``, run by ``make test``) re-executes
each notebook and compares outputs; these tests check what nbval cannot: that there are stored
outputs to compare at all, and that ``make quickstart-headless`` prints the per-rank lines.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import nbformat
import pytest

from jupyter_shard.spec import visible_gpus

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
QUICKSTART = NOTEBOOKS / "00_quickstart.ipynb"


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_quickstart_exists() -> None:
    assert QUICKSTART in _notebooks()


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.name)
def test_stored_with_outputs_and_no_errors(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    assert all(c.execution_count is not None for c in code), "run the notebook and save it with outputs"
    # A cell may store an error only when it is marked as failing on purpose (the cell tag that
    # nbclient and nbval both honour, or nbval's comment marker) and the notebook says so. A magic's
    # UsageError is an error too (the kernel's reply says so, and JupyterLab's Run All stops there)
    # though it stores only its line on stderr.
    errors = [o for c in code if not _raises_on_purpose(c) for o in c.outputs if _is_error(o)]
    assert not errors, f"stored error output: {errors[0].get('ename') or errors[0].get('text')}"
    for cell in filter(_raises_on_purpose, code):
        assert any(_is_error(o) for o in cell.outputs), "a raises-exception cell stored no error"
        tags = cell.metadata.get("tags", [])
        assert "raises-exception" in tags, "tag failing cells raises-exception, so nbclient and nbval go on"


def _is_error(output: nbformat.NotebookNode) -> bool:
    if output.output_type == "error":
        return True
    return (
        output.output_type == "stream" and output.name == "stderr" and output.text.startswith("UsageError:")
    )


def _raises_on_purpose(cell: nbformat.NotebookNode) -> bool:
    return "raises-exception" in cell.metadata.get("tags", []) or "# NBVAL_RAISES_EXCEPTION" in cell.source


def _load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_headless", NOTEBOOKS / "run_headless.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_headless"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(visible_gpus() > 0, reason="expects the CPU pool (2 ranks); GPUs change the output")
def test_headless_run_prints_rank_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = _load_runner()
    saved = tmp_path / "out.ipynb"
    assert runner.main([str(QUICKSTART), "--output", str(saved)]) == 0
    printed = capsys.readouterr().out
    assert "[rank 0] rank 0 of 2 on cpu: all_reduce sum = 3" in printed
    assert "[rank 1] rank 1 of 2 on cpu: all_reduce sum = 3" in printed
    assert "[rank 0] learned weights [2.0, -3.0, 0.5, 1.0] bias 0.25" in printed
    assert "60 steps pulled from rank 0" in printed
    assert nbformat.read(saved, as_version=4).cells[-1].outputs, "executed notebook not saved"
