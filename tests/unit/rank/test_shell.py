"""The rank shell's shortcut past IPython's tokenizer must give exactly IPython's own transform."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.interactiveshell import InteractiveShell

from jupyter_shard.rank.shell import COMPILED_CELLS, RankShell, _plain_python


class _NoChannel:
    def send(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing should be sent while transforming")


@pytest.fixture(scope="module")
def shell() -> Iterator[RankShell]:
    had = InteractiveShell.initialized()
    previous = InteractiveShell._instance if had else None
    InteractiveShell.clear_instance()
    sh = RankShell.create(_NoChannel(), {})  # type: ignore[arg-type]
    yield sh
    RankShell.clear_instance()
    if previous is not None:  # give other test modules back the shell they made
        InteractiveShell._instance = previous


CELLS = [
    "pass",
    "x = 1\ny = 2",
    "for i in range(3):\n    print(i)\n",
    "total = (values\n    .sum()\n    .item())",
    "def f():\n    return 1\n",
    "print('50%')",
    "x = 10 % 3",
    "%time x = 1",
    "%%time\nx = 1",
    "!ls",
    "files = !ls",
    "out = %pwd",
    "x?",
    "len??",
    "\n\nx = 1",
    "    x = 1\n    y = 2",
    ">>> x = 1\n>>> y = 2",
    "In [1]: x = 1",
    "   ...: y = 2",
    ",print a b",
    ";print a b",
    "/print 1",
    "ls",
    "time",
    "cd",
    "",
    "x = 'a ! b'",
    "async def f():\n    await g()",
    "0\n ",
    "x = 1\n   \ny = 2\n\t\n",
    "pass",
    "import os",
    "pass  # PYTHON-MODE",
    "for x in y: pass",
    "del x",
    "True",
    "not x",
    "lambda: 1",
    "print(1)",
    "pass",
    "raise",
    "if x:pass",
    "return",
]


@pytest.mark.parametrize("cell", CELLS)
def test_same_as_ipython(shell: RankShell, cell: str) -> None:
    assert shell.transform_cell(cell) == InteractiveShell.transform_cell(shell, cell)


def test_plain_python_detection() -> None:
    assert _plain_python("x = 1\nprint(x)")
    assert not _plain_python("%time x")
    assert not _plain_python(" x = 1")
    assert not _plain_python("a = b ? c")
    assert not _plain_python("x = 1\n/print 1")
    assert _plain_python("# %%distributed --nproc 2\nx = 1")  # the magic's own first line
    assert _plain_python("x = 1\n   # why? 100% !\ny = 2")
    assert not _plain_python("# %%distributed\n%time x = 1")
    assert not _plain_python("# ok\nx = 1  # 50%")  # a comment after code: not looked into
    assert not _plain_python("# ok\nx?")


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab =()\n\t.:,;/%!?>In[1]'\"#0")), max_size=40))
def test_same_as_ipython_on_random_text(shell: RankShell, cell: str) -> None:
    try:
        expected = InteractiveShell.transform_cell(shell, cell)
    except Exception as exc:  # IPython itself rejects some inputs; the rank shell must do the same
        with pytest.raises(type(exc)):
            shell.transform_cell(cell)
        return
    assert shell.transform_cell(cell) == expected


def test_top_level_await_still_detected(shell: RankShell) -> None:
    assert shell.should_run_async("await x", transformed_cell="await x\n")
    assert not shell.should_run_async("x = 1", transformed_cell="x = 1\n")


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, kind: str, body: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self.sent.append((kind, body))


def test_printed_output_is_not_kept(shell: RankShell, capsys: pytest.CaptureFixture[str]) -> None:
    """IPython's own run_cell files every write to stdout/stderr in history_manager.outputs."""
    recorder = _Recorder()
    before = shell.channel
    shell.channel = recorder  # type: ignore[assignment]
    try:
        error = shell.run(
            "import sys\nfor i in range(2000):\n    print('line', i)\n    print('err', i, file=sys.stderr)\n"
            "write_in_cell = sys.stdout.write\n41 + 1",
            "cell-1",
            1,
        )
    finally:
        shell.channel = before
    assert error is None
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 2000 and "line 1999" in captured.out
    assert "err 1999" in captured.err
    assert shell.history_manager is not None
    assert dict(shell.history_manager.outputs) == {}
    # stdout's write was not wrapped while the cell ran
    assert shell.user_ns["write_in_cell"] == sys.stdout.write
    assert [kind for kind, _ in recorder.sent] == ["result"]
    assert recorder.sent[0][1]["data"]["text/plain"] == "42"


def test_cell_sources_are_not_cached_for_a_history_database(shell: RankShell) -> None:
    """History is off on a rank, so nothing writes IPython's database cache out: it stays empty,
    whichever path a cell takes, while ``In`` keeps every cell as in a notebook."""
    assert shell.history_manager is not None and not shell.history_manager.enabled
    cells = ["pass", "%time 1 + 1", "x_db = 1", "raise ValueError('no')"]
    for count, cell in enumerate(cells, start=101):
        shell.run(cell, f"cell-{count}", count)
    assert shell.history_manager.db_input_cache == []
    kept = ["pass", "get_ipython().run_line_magic('time', '1 + 1')", "x_db = 1", "raise ValueError('no')"]
    assert shell.user_ns["In"][-len(cells) :] == kept


# -- the plain-Python path must behave as IPython's run_cell ----------------------------------------

SEQUENCE = [
    "x = 1",
    "x + 1",
    "y = x * 3\ny",
    "1; 2",
    "def f():\n    return 1 / 0\n",
    "f()",
    "for i in range(3):\n    i",
    "print('hi')\n5",
    "x = 1; y = undefined_name",
    "x",
    "_",
    "_i",
    "In[-2] if len(In) > 1 else None",
    "Out.get(2)",
    "from __future__ import annotations\ndef g(a: Undefined) -> int:\n    return 1\ng.__annotations__['a']",
    "def h(a: Undefined2):\n    pass\nh.__annotations__",
    "import sys\nsys.displayhook is get_ipython().displayhook",
    "raise SystemExit(3)",
    "1 +",
    "return 5",
    "class C:\n    def __repr__(self):\n        return 'C()'\nC()",
    "# only a comment",
    "# %%distributed --nproc 2 --device cpu\nx + 2",
    "# %%rank 0,1 (100% sure?)\n  # !ls\n_ * 2",
    "x = 5  # comment",
    "get_ipython().execution_count",
    "assert False, 'message'",
    "[n for n in range(3)]",
    "pass",
]


def _run_sequence(shell: RankShell, fast: bool, counts: bool) -> list[Any]:
    recorder = _Recorder()
    before = shell.channel
    shell.channel = recorder  # type: ignore[assignment]
    shell.reset(new_session=False)
    shell.execution_count = 1
    taken: list[str] = []
    run_plain = shell._run_plain

    def counting(raw_cell: str, cell_id: str, exec_count: int = 0) -> Any:
        result = run_plain(raw_cell, cell_id, exec_count)
        if result is not None:
            taken.append(raw_cell)
        return result

    shell._run_plain = counting  # type: ignore[method-assign]
    if not fast:
        shell._plain_ok = lambda code: False  # type: ignore[method-assign]
    seen: list[Any] = []
    try:
        for n, cell in enumerate(SEQUENCE, start=1):
            recorder.sent.clear()
            error = shell.run(cell, f"cell-{n}", n + 10 if counts else 0)
            seen.append((cell, error, [(k, b.get("data")) for k, b in recorder.sent], shell.execution_count))
    finally:
        shell.channel = before
        del shell._run_plain
        if not fast:
            del shell._plain_ok
    # every cell but the two that do not compile went the plain way, or none did
    assert len(taken) == (len(SEQUENCE) - 2 if fast else 0), taken
    return seen


@pytest.mark.parametrize(
    ("counts", "again"),
    [(False, False), (True, False), (True, True)],
    ids=["own-count", "kernel-count", "again"],
)
def test_plain_path_matches_run_cell(
    shell: RankShell, capsys: pytest.CaptureFixture[str], counts: bool, again: bool
) -> None:
    """``again``: every cell ran once before, and cells of more than one line run the code kept then."""
    if again:
        shell._compiled.clear()
        _run_sequence(shell, fast=True, counts=counts)
        assert {key[0] for key in shell._compiled} == {cell for cell in SEQUENCE if "\n" in cell}
        capsys.readouterr()
    fast = _run_sequence(shell, fast=True, counts=counts)
    out_fast = capsys.readouterr()
    slow = _run_sequence(shell, fast=False, counts=counts)
    out_slow = capsys.readouterr()
    for a, b in zip(fast, slow, strict=True):
        assert a == b
    assert out_fast == out_slow
    results = {cell: sent for cell, _, sent, _ in fast}
    assert results["x + 1"] == [("result", {"text/plain": "2"})]
    assert results["1; 2"] == [("result", {"text/plain": "2"})]
    assert results["for i in range(3):\n    i"] == []
    errors = {cell: error for cell, error, _, _ in fast}
    assert errors["f()"] is not None and errors["f()"][0] == "ZeroDivisionError"
    assert any("1 / 0" in line for line in errors["f()"][2])  # the cell's source in the traceback
    assert errors["1 +"] is not None and errors["1 +"][0] == "SyntaxError"
    assert errors["def h(a: Undefined2):\n    pass\nh.__annotations__"] is None  # __future__ kept


def test_a_cell_run_again_is_not_compiled_again_and_names_its_own_run(
    shell: RankShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[str] = []
    parse = shell.compile.ast_parse
    monkeypatch.setattr(
        shell.compile, "ast_parse", lambda cell, **kw: parsed.append(cell) or parse(cell, **kw)
    )
    recorder = _Recorder()
    before = shell.channel
    shell.channel = recorder  # type: ignore[assignment]
    cell = "def g_again():\n    return 1 / 0\nx_again = 41\nx_again + 1"
    failing = "x_again = 0\ng_again()"
    try:
        assert shell.run(cell, "cell-a", 401) is None
        assert shell.run(cell, "cell-b", 402) is None
        first = shell.run(failing, "cell-c", 403)
        second = shell.run(failing, "cell-d", 404)
    finally:
        shell.channel = before
    assert parsed == [cell + "\n", failing + "\n"]  # each compiled once
    assert [body["data"]["text/plain"] for kind, body in recorder.sent if kind == "result"] == ["42", "42"]
    assert shell.user_ns["Out"][402] == 42 and shell.user_ns["_i402"] == cell
    assert first is not None and second is not None
    # the traceback names the run it comes from, in the cell and in the function it defined
    assert [line.split("\n")[0] for line in second[2][2:4]] == [
        "Cell In[404], line 2",
        "Cell In[402], line 2, in g_again()",
    ]
    assert [line.split("\n")[0] for line in first[2][2:4]] == [
        "Cell In[403], line 2",
        "Cell In[402], line 2, in g_again()",
    ]


def test_only_the_most_recent_cells_keep_their_code(shell: RankShell) -> None:
    shell._compiled.clear()
    for n in range(COMPILED_CELLS + 5):
        assert shell.run(f"v_{n} = {n}\nw_{n} = v_{n}", f"cell-{n}", 500 + n) is None
    assert len(shell._compiled) == COMPILED_CELLS
    assert shell.run("one_line_kept = 1", "cell-one", 600) is None  # a cell of one line is not kept
    assert "v_0 = 0\nw_0 = v_0" not in {key[0] for key in shell._compiled}
    assert (
        f"v_{COMPILED_CELLS + 4} = {COMPILED_CELLS + 4}\nw_{COMPILED_CELLS + 4} = v_{COMPILED_CELLS + 4}"
        in {key[0] for key in shell._compiled}
    )
    assert len(shell._compiled) == COMPILED_CELLS


def test_plain_path_is_taken_only_for_plain_cells(shell: RankShell) -> None:
    assert shell._plain_ok("x = 1\ny = x")
    assert shell._plain_ok("pass")
    for cell in ["%time x = 1", "!ls", "x?", "await f()", "async def f(): pass", "  x = 1", ""]:
        assert not shell._plain_ok(cell), cell


def test_a_failing_transform_is_the_cells_error_not_the_ranks(
    shell: RankShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefilter runs user objects' code (a macro or autocall check on the first word)."""

    def broken(raw_cell: str) -> str:
        raise RuntimeError("transform failed")

    before = shell.channel
    shell.channel = _Recorder()  # type: ignore[assignment]
    monkeypatch.setattr(shell, "transform_cell", broken)
    try:
        error = shell.run("x = 1", "cell-t", 0)
    finally:
        shell.channel = before
    assert error is not None and error[0] == "RuntimeError" and "transform failed" in error[1]
