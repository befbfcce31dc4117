"""jupyter_shard.notebook.values: what a cell shows as its value, and the display hook override."""

from __future__ import annotations

from typing import Any

from IPython.core.interactiveshell import InteractiveShell

from jupyter_shard.notebook.values import _show_once_as, shown_bundle
from jupyter_shard.pool.results import RankResult, RunResult


def _run(*values: dict[str, Any] | None) -> RunResult:
    return RunResult("c", {k: RankResult(k, status="ok", result=v) for k, v in enumerate(values)})


def test_ranks_that_agree_show_one_value_unlabelled() -> None:
    bundle = {"text/plain": "41", "text/html": "<b>41</b>"}
    assert shown_bundle(_run(bundle, dict(bundle), dict(bundle))) == bundle


def test_ranks_that_differ_show_every_value_labelled_and_aligned() -> None:
    shown = shown_bundle(_run({"text/plain": "1"}, {"text/plain": "a\nb"}))
    assert shown == {"text/plain": "[rank 0] 1\n[rank 1] a\n         b"}


def test_a_rank_without_a_value_differs_and_is_left_out() -> None:
    assert shown_bundle(_run(None, {"text/plain": "'x'"})) == {"text/plain": "[rank 1] 'x'"}
    assert shown_bundle(_run(None, None)) is None


def test_html_of_differing_values_keeps_each_ranks_html_and_escapes_plain_text() -> None:
    shown = shown_bundle(_run({"text/plain": "a<b", "text/html": "<i>a</i>"}, {"text/plain": "c<d"}))
    assert shown is not None
    assert (
        shown["text/html"] == "<div><b>[rank 0]</b></div><i>a</i><div><b>[rank 1]</b></div><pre>c&lt;d</pre>"
    )


def test_the_display_hook_shows_the_ranks_bundle_once_and_files_the_object() -> None:
    shell = InteractiveShell.instance()
    value = [1, 2]
    _show_once_as(shell, value, {"text/plain": "[rank 0] shown"})
    hook: Any = shell.displayhook
    assert hook.compute_format_data(value) == ({"text/plain": "[rank 0] shown"}, {})
    assert hook.compute_format_data(value)[0]["text/plain"] == "[1, 2]", "used once"
    _show_once_as(shell, value, {"text/plain": "unused"})
    assert hook.compute_format_data("other")[0]["text/plain"] == "'other'", "another object: as usual"
    assert "compute_format_data" not in vars(hook)
