"""jupyter_shard.notebook.display: the notebook's rank-output sink, the rank-tabs display and
rank-labelled rich output."""

from __future__ import annotations

import base64
import itertools
import json
import time
from typing import Any, ClassVar

import pytest

from jupyter_shard.notebook import display, panel
from jupyter_shard.notebook.display import RANK_OUTPUT_MIME, NotebookSink, RankOutputDisplay, label_bundle


class FakeHandle:
    shown: ClassVar[list[tuple[str, dict[str, Any]]]] = []
    times: ClassVar[list[float]] = []

    def display(self, data: dict[str, Any], raw: bool = False) -> None:
        self.shown.append(("display", json.loads(json.dumps(data))))
        self.times.append(time.monotonic())

    def update(self, data: dict[str, Any], raw: bool = False) -> None:
        self.shown.append(("update", json.loads(json.dumps(data))))
        self.times.append(time.monotonic())


@pytest.fixture
def handles(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    FakeHandle.shown, FakeHandle.times = [], []
    monkeypatch.setattr("IPython.display.DisplayHandle", FakeHandle)
    return FakeHandle.shown


def test_without_the_extension_the_sink_writes_plain_rank_lines(
    handles: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert not panel.frontend_attached()
    sink = NotebookSink()
    sink.begin_cell()
    sink.stream(0, "stdout", "hello\n")
    sink.end_cell()
    assert capsys.readouterr().out == "[rank 0] hello\n"
    assert handles == []


def test_the_pools_notices_are_plain_output_and_rank_stderr_stays_stderr(
    handles: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """JupyterLab paints stderr as an error: the pool saying what it does is not one."""
    sink = NotebookSink()
    sink.begin_cell()
    sink.notice("jupyter_shard: restarting the pool (rank 1 was killed); rank state is lost\n")
    sink.stream(1, "stderr", "careful\n")
    sink.end_cell()
    said = capsys.readouterr()
    assert said.out == "jupyter_shard: restarting the pool (rank 1 was killed); rank state is lost\n"
    assert said.err == "[rank 1] careful\n"


def test_with_the_extension_one_display_holds_the_cell_and_a_text_fallback(
    handles: list[Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(panel, "_open", [object()])
    sink = NotebookSink()
    sink.begin_cell()
    sink.stream(0, "stdout", "epoch 1\n")
    sink.stream(1, "stdout", "epoch 1\n")  # within 0.1 s: held back, shown by the timer or the end
    sink.stream(1, "stderr", "warning\n")
    sink.end_cell(failed=[1])
    assert capsys.readouterr().out == ""
    kinds = [kind for kind, _ in handles]
    assert kinds[0] == "display" and set(kinds[1:]) <= {"update"} and len(kinds) <= 3
    final = handles[-1][1]
    assert final[RANK_OUTPUT_MIME] == {
        "version": 2,
        "lines": [[0, "stdout", "epoch 1"], [1, "stdout", "epoch 1"], [1, "stderr", "warning"]],
        "failed": [1],
        "summary": [["0-1", "stdout", "epoch 1"], ["1", "stderr", "warning"]],
        "view": "all",  # 2 ranks: every line first
    }
    assert final["text/plain"] == "[rank 0] epoch 1\n[rank 1] epoch 1\n[rank 1] warning\n"


def _printing_loop(sink: NotebookSink, ranks: int, steps: int) -> None:
    sink.begin_cell(ranks)
    for step in range(steps):
        for rank in range(ranks):
            sink.stream(rank, "stdout", f"step {step} loss {0.5 - rank / 1000:.3f}\n")
    sink.end_cell()


def test_from_nine_ranks_a_plain_frontend_gets_one_summary_display(
    handles: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """No extension: 64 ranks printing 30 steps are 30 lines, in one display updated in place."""
    sink = NotebookSink()
    _printing_loop(sink, 64, 30)
    assert capsys.readouterr().out == ""
    kinds = [kind for kind, _ in handles]
    assert kinds[0] == "display" and set(kinds[1:]) <= {"update"}
    final = handles[-1][1]
    assert set(final) == {"text/plain"}
    lines = final["text/plain"].splitlines()
    assert len(lines) == 30
    assert lines[0] == "[rank 0-63] step 0 loss 0.500 (rank 0; loss 0.437–0.500)"


def test_below_nine_ranks_and_with_all_chosen_every_line_streams(
    handles: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    sink = NotebookSink()
    _printing_loop(sink, 8, 2)
    assert capsys.readouterr().out.count("\n") == 16 and handles == []
    display.set_output_mode("all")
    try:
        _printing_loop(sink, 64, 2)
        assert capsys.readouterr().out.count("\n") == 128 and handles == []
        display.set_output_mode("summary")
        _printing_loop(sink, 2, 2)
        assert (
            handles[-1][1]["text/plain"].splitlines()[0]
            == "[rank 0-1] step 0 loss 0.500 (rank 0; loss 0.499–0.500)"
        )
    finally:
        display.set_output_mode("auto")
    with pytest.raises(ValueError, match="not one of auto, summary, all"):
        display.set_output_mode("some")


def test_with_the_extension_at_64_ranks_the_summary_is_the_first_view_and_the_fallback(
    handles: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(panel, "_open", [object()])
    _printing_loop(NotebookSink(), 64, 30)
    final = handles[-1][1]
    bundle = final[RANK_OUTPUT_MIME]
    assert bundle["view"] == "summary" and len(bundle["summary"]) == 30
    assert len(bundle["lines"]) == 64 * 30  # every line for the rank tabs
    assert len(final["text/plain"].splitlines()) == 30


def test_rank_output_display_updates_at_most_ten_times_a_second(handles: list[Any]) -> None:
    lines = RankOutputDisplay()
    start = time.monotonic()
    while time.monotonic() - start < 0.35:
        lines.add(0, "stdout", ["x"])
        time.sleep(0.005)
    time.sleep(0.15)  # the timer shows what was held back
    gaps = [later - earlier for earlier, later in itertools.pairwise(FakeHandle.times)]
    assert len(handles) >= 3 and min(gaps) >= 0.095  # a slow machine only widens the gaps
    assert len(handles[-1][1][RANK_OUTPUT_MIME]["lines"]) == len(lines.lines)


def test_a_held_back_update_is_due_an_interval_after_the_last_one(handles: list[Any]) -> None:
    lines = RankOutputDisplay()
    lines.add(0, "stdout", ["a"])  # shown at once
    time.sleep(0.02)
    lines.add(0, "stdout", ["b"])  # held back until 0.1 s after "a"
    time.sleep(0.085)
    lines.add(0, "stdout", ["c"])  # around 0.105 s: held back until 0.1 s after the last update
    lines.add(0, "stdout", ["d"])
    time.sleep(0.2)
    gaps = [later - earlier for earlier, later in itertools.pairwise(FakeHandle.times)]
    assert min(gaps) >= 0.095
    assert len(handles[-1][1][RANK_OUTPUT_MIME]["lines"]) == 4


# -- label_bundle ------------------------------------------------------------------------------------


def test_label_bundle_keeps_plain_text_fallback() -> None:
    data = {"text/plain": "42"}
    out = label_bundle(3, data)
    assert out == {"text/plain": "[rank 3] 42"}
    assert data == {"text/plain": "42"}, "the input bundle is not modified"


def test_label_bundle_without_plain_text_still_gets_a_fallback() -> None:
    assert label_bundle(0, {"application/json": {"a": 1}})["text/plain"] == "[rank 0] "


def test_label_bundle_wraps_html() -> None:
    out = label_bundle(1, {"text/plain": "<DataFrame>", "text/html": "<table>t</table>"})
    assert out["text/plain"] == "[rank 1] <DataFrame>"
    assert out["text/html"].startswith(
        '<div class="jupyter-shard-rank" data-rank="1"><small>[rank 1]</small>'
    )
    assert out["text/html"].endswith("<table>t</table></div>")


@pytest.mark.parametrize("mime", ["image/png", "image/jpeg"])
def test_label_bundle_wraps_images(mime: str) -> None:
    b64 = base64.b64encode(b"\x89PNG fake").decode()
    out = label_bundle(2, {"text/plain": "<Figure size 640x480>", mime: b64})
    assert out[mime] == b64, "the image itself is kept for nbconvert / GitHub"
    assert out["text/plain"] == "[rank 2] <Figure size 640x480>"
    assert '<small>[rank 2]</small><br><img src="' in out["text/html"]
    assert f"data:{mime};base64,{b64}" in out["text/html"]


def test_label_bundle_escapes_image_data_in_the_src_attribute() -> None:
    out = label_bundle(0, {"image/png": 'x" onerror="alert(1)'})
    assert 'onerror="alert' not in out["text/html"]
    assert "&quot;" in out["text/html"]


def test_with_the_summary_every_ranks_progress_bar_is_one_live_line(handles: list[Any]) -> None:
    """64 ranks drawing a tqdm-like bar twice: two live displays, not 128."""
    sink = NotebookSink()
    sink.begin_cell(64)
    for _ in range(2):  # two bars, one after the other
        for percent in (10, 50, 100):
            for rank in range(64):
                done = percent + rank % 5 if percent < 100 else 100
                end = "\n" if done == 100 else ""
                sink.stream(rank, "stderr", f"\r{done}%|{'#' * (done // 10)}| {done}/100{end}")
    sink.end_cell()
    assert [kind for kind, _ in handles].count("display") == 2  # one per bar, for all 64 ranks
    finished = [
        data["text/plain"] for _, data in handles if data["text/plain"].startswith("[rank 0-63] 100%")
    ]
    assert finished[-1] == "[rank 0-63] 100%|##########| 100/100 (64 ranks)"


def test_a_group_of_bars_shows_the_lowest_rank_and_the_range_of_the_first_number() -> None:
    group = display._LiveGroup()
    for rank, percent in ((3, 48), (0, 41), (1, 45)):
        group.texts[rank] = f"{percent}%|###| {percent}/100 [00:10<00:12]"
    group.done.add(1)
    assert group.label() == "[rank 0-1,3] 41%|###| 41/100 [00:10<00:12] (3 ranks from 41 to 48, 1 done)"
    group.texts = {5: "loading"}
    assert group.label() == "[rank 5] loading"


def test_a_cell_of_1024_ranks_carries_its_first_and_last_lines_and_counts_those_between() -> None:
    """30 lines from each of 1,024 ranks: the extension's bundle holds BUNDLE_LINES of them (the
    first half and the last), says how many it left out and where, and its every-line fallback says
    so in their place; the summary still counts every line."""
    shown = RankOutputDisplay(rich=True, summary_first=False)
    for step in range(30):
        for rank in range(1024):
            shown.add(rank, "stdout", [f"step {step} loss {rank}"])
    shown._cancel_timer()
    data = shown.data()
    bundle = data[RANK_OUTPUT_MIME]
    half = display.BUNDLE_LINES // 2
    assert len(bundle["lines"]) == display.BUNDLE_LINES
    assert bundle["omitted"] == [half, 30 * 1024 - display.BUNDLE_LINES]
    assert bundle["lines"][0] == [0, "stdout", "step 0 loss 0"]
    assert bundle["lines"][-1] == [1023, "stdout", "step 29 loss 1023"]
    text = data["text/plain"].splitlines()
    assert text[half] == display.omitted_note(30 * 1024 - display.BUNDLE_LINES)
    assert len(text) == display.BUNDLE_LINES + 1
    size = len(json.dumps(data))
    assert size < 200_000, size  # against 2.2 MB with every line
    assert bundle["summary"][0][0] == "0-1023"  # every rank counted, in a few bytes


def test_a_cell_under_the_bound_carries_every_line_and_no_note() -> None:
    shown = RankOutputDisplay(rich=True, summary_first=False)
    shown.add(0, "stdout", [f"line {i}" for i in range(display.BUNDLE_LINES)])
    shown._cancel_timer()
    bundle = shown.data()[RANK_OUTPUT_MIME]
    assert len(bundle["lines"]) == display.BUNDLE_LINES and "omitted" not in bundle
