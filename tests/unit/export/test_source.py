"""jupyter_shard.export.source: cells as plain Python and pushed values as literals or pickles, as they
come out in a rendered script. No processes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from jupyter_shard.pool.transcript import CellEntry
from jupyter_shard.rank import script as script_module
from tests.unit.export._helpers import _cell, _push, _render, _run_script


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


def test_plain_cells_stay_verbatim_and_need_no_ipython_shell() -> None:
    code = 'msg = "100% done"  # not a magic\nfor i in range(2):\n    print(f"{i}%")\n'
    text = _render(_cell(code, 1))
    assert f"# --- cell [1] ---\n# %%distributed\n{code}" in text
    assert "get_ipython" not in text and "ipython" not in text.split("shard = start")[0].split("import")[-1]


def test_cells_on_some_ranks_run_only_there_and_multiline_strings_keep_their_text(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code = 'seen = "first"\ntext = """line one\n  line two\n"""\nif True:\n    nested = 1\n'
    entries = (
        _cell("seen = None\ntext = None", 1),
        CellEntry(f"# %%rank 1\n{code}", (1,), "ok", 2),
        _cell("others = shard.rank", 3, ranks=(0, 2)),
    )
    text = _render(*entries)
    assert "# --- cell [2] on rank 1 ---\nif shard.rank == 1:\n    # %%rank 1\n" in text
    assert "# --- cell [3] on rank 0,2 ---\nif shard.rank in (0, 2):\n" in text
    on_1 = _run_script(text, 1, monkeypatch, tmp_path)
    assert on_1["seen"] == "first" and on_1["text"] == "line one\n  line two\n" and on_1["nested"] == 1
    assert "others" not in on_1
    on_0 = _run_script(text, 0, monkeypatch, tmp_path)
    assert on_0["seen"] is None and on_0["others"] == 0


def test_a_comment_only_cell_on_some_ranks_still_parses() -> None:
    text = _render(_cell("# just a note", 1, ranks=(1,)))
    assert "if shard.rank == 1:\n    # %%distributed\n    # just a note\n    pass\n" in text


def test_pushed_values_are_literals_when_they_read_back_equal_else_pickled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values: dict[str, Any] = {
        "lr": 0.05,
        "cfg": {"layers": [1, 2], "name": "mlp", "flags": (True, None)},
        "weights": torch.arange(4.0),
        "pt": Point(3),
        "missing": math.nan,
    }
    text = _render(_push(**values), _cell("x = 1", 1))
    assert "\nlr = 0.05\n" in text
    assert "\ncfg = {'layers': [1, 2], 'name': 'mlp', 'flags': (True, None)}\n" in text
    assert "weights = unpickle(" in text and "# torch.Tensor, cloudpickle" in text
    assert "pt = unpickle(" in text and f"# {__name__}.Point, cloudpickle" in text
    assert "missing = unpickle(" in text  # nan != nan: not a literal
    monkeypatch.setattr(script_module, "unpickle", script_module.unpickle)
    ns = _run_script(text, 0, monkeypatch, tmp_path)
    assert ns["lr"] == 0.05 and ns["cfg"] == values["cfg"]
    assert torch.equal(ns["weights"], values["weights"]) and ns["pt"].x == 3
    assert math.isnan(ns["missing"])


def test_ipython_syntax_is_transformed_and_the_script_gets_a_shell() -> None:
    text = _render(
        _cell("%time y = 2\n!echo hi\nx = 1", 1),
        CellEntry("%%time\nz = 3\n", None, "ok", 2),
    )
    assert "get_ipython().run_line_magic('time', 'y = 2')" in text
    assert "get_ipython().system('echo hi')" in text
    assert "get_ipython().run_cell_magic('time', '', 'z = 3\\n')" in text
    assert "from jupyter_shard.rank.script import finish, ipython, start" in text
    assert (
        text.index("shard = start(")
        < text.index("get_ipython = ipython(globals())")
        < text.index("run_line_magic")
    )


def test_display_without_an_import_gets_the_shell_and_with_one_does_not() -> None:
    assert "get_ipython = ipython(globals())" in _render(_cell("display(1)", 1))
    imported = _render(_cell("from IPython.display import display\ndisplay(1)", 1))
    assert "get_ipython = ipython(globals())" not in imported
