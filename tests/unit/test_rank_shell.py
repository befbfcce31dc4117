"""The rank shell's shortcut past IPython's tokenizer must give exactly IPython's own transform."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.interactiveshell import InteractiveShell

from jupyter_shard.rank.shell import RankShell, _plain_python


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
