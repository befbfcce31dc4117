"""A repeated ``%%distributed`` cell goes to the ranks when the kernel takes its request.

Through a real kernel with 2 CPU ranks. Whether a cell went ahead is seen without racing the clock:
the cell's first line on each rank leaves a mark in a folder, and a ``pre_run_cell`` hook in the
kernel, which runs before IPython calls the cell magic, waits for both marks (up to a few seconds).
A cell sent ahead leaves them while the hook waits; one sent by the magic cannot.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(180)

LINE = "%%distributed --nproc 2 --device cpu"
WAIT = 2.0  # seconds the hook waits for the marks: a cell sent ahead leaves them within milliseconds
HOOK = """
import os, time
_js_marks, _js_seen = {marks!r}, []
def _js_wait(info):
    if "_js_mark" not in (info.raw_cell or "") or "_js_seen" in info.raw_cell:
        return
    deadline = time.monotonic() + {wait}
    while len(os.listdir(_js_marks)) < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    _js_seen.append(sorted(os.listdir(_js_marks)))
def _js_clear(result):  # marks left by a cell that was not sent ahead
    for name in os.listdir(_js_marks):
        os.remove(os.path.join(_js_marks, name))
get_ipython().events.register("pre_run_cell", _js_wait)
get_ipython().events.register("post_run_cell", _js_clear)
"""
STAMP = "_js_mark = open(os.path.join(_js_marks, str(shard.rank)), 'w').close()\n"


@pytest.fixture(scope="module")
def nb(shared_kernel: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    marks = tmp_path_factory.mktemp("marks")
    assert shared_kernel.execute(f"{LINE}\nimport os\n_js_marks = {str(marks)!r}\nvalue = 'kept'").ok
    assert shared_kernel.execute(HOOK.format(marks=str(marks), wait=WAIT)).ok
    return shared_kernel


def went_ahead(nb: Any) -> bool:
    """Whether both ranks started the last marked cell before IPython ran its magic."""
    seen = nb.execute("_js_seen[-1]").data("execute_result")[0]["text/plain"]
    assert seen in ("['0', '1']", "[]"), f"one rank only: {seen}"
    return seen == "['0', '1']"


def test_a_cell_repeating_the_last_line_starts_on_the_ranks_before_the_magic_runs(nb: Any) -> None:
    first = nb.execute(f"{LINE}\n{STAMP}")  # the line's first run on this pool: sent by the magic
    assert first.ok, first.outputs
    assert not went_ahead(nb)
    repeated = nb.execute(f"{LINE}\n{STAMP}print('rank', shard.rank, value)\nshard.rank + 40")
    assert repeated.ok, repeated.outputs
    assert went_ahead(nb)
    assert sorted(repeated.stream().splitlines()) == ["[rank 0] rank 0 kept", "[rank 1] rank 1 kept"]
    assert repeated.data("execute_result") == [{"text/plain": "[rank 0] 40\n[rank 1] 41"}]
    count = repeated.reply["content"]["execution_count"]
    assert nb.execute(f"Out[{count}] + 2").data("execute_result") == [{"text/plain": "42"}]


def test_cells_alternating_between_lines_that_ran_before_both_go_ahead(nb: Any) -> None:
    assert nb.execute(f"%%distributed --timeout 60\n{STAMP}").ok  # a new line: from the magic
    assert not went_ahead(nb)
    for line in [LINE, "%%distributed --timeout 60", LINE, "%%distributed --timeout 60"]:
        assert nb.execute(f"{line}\n{STAMP}").ok
        assert went_ahead(nb), line


def test_a_cell_sent_ahead_fails_under_its_own_cell_number(nb: Any) -> None:
    nb.execute(f"{LINE}\npass")
    failed = nb.execute(f"{LINE}\n{STAMP}raise ValueError(f'bad {{shard.rank}}')")
    assert not failed.ok
    assert went_ahead(nb)
    count = failed.reply["content"]["execution_count"]
    text = failed.error_text()
    assert "ValueError: bad 0" in text and "ValueError: bad 1" in text
    assert f"In[{count}], line 3" in text, text


def test_a_changed_line_or_expanded_variables_go_the_usual_way(nb: Any) -> None:
    nb.execute(f"{LINE}\npass")
    assert nb.execute(f"{LINE} --timeout 30\n{STAMP}").ok
    assert not went_ahead(nb), "a line unlike the last one runs from the magic"
    assert nb.execute("limit = 30").ok
    assert nb.execute(f"{LINE} --timeout {{limit}}\n{STAMP}").ok
    assert nb.execute(f"{LINE} --timeout {{limit}}\n{STAMP}").ok
    assert not went_ahead(nb), "IPython expands {limit}: never sent before that"


def test_a_cell_after_one_that_failed_on_some_ranks_is_not_sent_ahead(nb: Any) -> None:
    nb.execute(f"{LINE}\npass")
    partial = nb.execute(f"{LINE}\nif shard.rank == 1:\n    raise RuntimeError('only here')")
    assert not partial.ok
    after = nb.execute(f"{LINE}\n{STAMP}")
    assert "may be out of step" in after.stream(), after.outputs
    assert not went_ahead(nb)


def test_run_all_after_a_failed_cell_does_not_send_the_queued_cells(nb: Any) -> None:
    """stop_on_error: the cells queued behind a failed one are aborted by the kernel before its
    handler sees them, so nothing of theirs reaches the ranks."""
    nb.execute(f"{LINE}\nmarker = 'before'")
    nb.execute(f"{LINE}\nmarker = 'before'")
    kc = nb.kc
    failing = kc.execute(f"{LINE}\nimport time\ntime.sleep(0.5)\nraise ValueError('stop here')")
    queued = kc.execute(f"{LINE}\nmarker = 'queued ran'")
    replies = {}
    deadline = time.monotonic() + 60
    while len(replies) < 2 and time.monotonic() < deadline:
        msg = kc.get_shell_msg(timeout=60)
        replies[msg["parent_header"]["msg_id"]] = msg["content"]["status"]
    assert replies == {failing: "error", queued: "aborted"}
    nb.drain(0.5)
    check = nb.execute(f"{LINE}\nmarker")
    assert check.data("execute_result") == [{"text/plain": "'before'"}], check.outputs
