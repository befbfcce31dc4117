"""jupyter_shard.pool.output: line assembly, progress lines, labelling, the per-cell cap."""

from __future__ import annotations

import io
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_shard.pool import output as rank_output
from jupyter_shard.pool.output import ConsoleSink, LineAssembler, RankSink, visible_text

# -- visible_text / LineAssembler --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("segment", "shown"),
    [("plain", "plain"), ("\r 10%", " 10%"), ("\r 10%\r 50%", " 50%"), ("a\r", "a"), ("\r", ""), ("", "")],
)
def test_visible_text(segment: str, shown: str) -> None:
    assert visible_text(segment) == shown


def test_a_rich_live_redraw_is_one_live_line_with_its_colours() -> None:
    # Rich on a terminal: hide the cursor, then "\r" + erase line + the frame for every redraw
    a = LineAssembler()
    frame = "Epoch 0/0  \x1b[35m━━━━\x1b[0m\x1b[90m━━━━\x1b[0m {}/4"
    assert a.feed("\x1b[?25l\r\x1b[2K" + frame.format(1)) == ([], frame.format(1))
    assert a.feed("\r\x1b[2K" + frame.format(4)) == ([], frame.format(4))
    assert a.feed("\n\x1b[?25hdone\n") == ([(frame.format(4), True), ("done", False)], None)
    assert visible_text("\x1b[1A\x1b[2K") == ""


def test_whole_lines_in_one_chunk() -> None:
    a = LineAssembler()
    assert a.feed("one\ntwo\n") == ([("one", False), ("two", False)], None)
    assert a.partial == ""
    assert a.finish() == []


def test_lines_split_across_chunk_boundaries() -> None:
    a = LineAssembler()
    assert a.feed("hel") == ([], None)
    assert a.feed("lo wo") == ([], None)
    assert a.feed("rld\nsec") == ([("hello world", False)], None)
    assert a.feed("ond\n\nthi") == ([("second", False), ("", False)], None)
    assert a.finish() == [("thi", False)]
    assert a.finish() == []


def test_newline_alone_and_empty_chunks() -> None:
    a = LineAssembler()
    assert a.feed("") == ([], None)
    assert a.feed("\n") == ([("", False)], None)
    assert a.feed("x") == ([], None)
    assert a.feed("\n") == ([("x", False)], None)


def test_tqdm_like_progress_gives_live_texts_then_one_final_live_line() -> None:
    a = LineAssembler()
    assert a.feed("\r 10%") == ([], " 10%")
    assert a.feed("\r 50%") == ([], " 50%")
    assert a.feed("\r100%\n") == ([("100%", True)], None)
    assert a.finish() == []


def test_progress_then_ordinary_lines() -> None:
    a = LineAssembler()
    lines, live = a.feed("start\n\r1/3\r2/3")
    assert lines == [("start", False)] and live == "2/3"
    lines, live = a.feed("\r3/3\ndone\n")
    assert lines == [("3/3", True), ("done", False)] and live is None


def test_unterminated_progress_line_is_flushed_at_finish_as_live() -> None:
    a = LineAssembler()
    a.feed("\r 10%\r 90%")
    assert a.finish() == [(" 90%", True)]


@settings(max_examples=60, database=None)
@given(st.lists(st.text(alphabet="ab\n ", max_size=12), max_size=12))
def test_chunking_does_not_change_the_lines(chunks: list[str]) -> None:
    a = LineAssembler()
    got: list[tuple[str, bool]] = []
    for chunk in chunks:
        got += a.feed(chunk)[0]
    got += a.finish()
    whole = "".join(chunks)
    expected = [(line, False) for line in whole.split("\n")]
    if expected[-1][0] == "":
        expected.pop()
    assert got == expected


# -- ConsoleSink --------------------------------------------------------------------------------------


def _sink() -> tuple[ConsoleSink, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return ConsoleSink(stdout=out, stderr=err), out, err


def test_console_sink_labels_every_line_and_keeps_streams_apart() -> None:
    sink, out, err = _sink()
    sink.begin_cell()
    sink.stream(0, "stdout", "a\nb")
    sink.stream(1, "stdout", "x\n")
    sink.stream(1, "stderr", "warn: ")
    sink.stream(0, "stdout", "c\n")
    sink.stream(1, "stderr", "careful\n")
    sink.stream(0, "stderr", "oops")
    sink.end_cell()
    assert out.getvalue() == "[rank 0] a\n[rank 1] x\n[rank 0] bc\n"
    assert err.getvalue() == "[rank 1] warn: careful\n[rank 0] oops\n"


def test_console_sink_progress_bar_shows_one_final_line() -> None:
    sink, out, err = _sink()
    sink.begin_cell()
    for chunk in ("\r 10%", "\r 50%", "\r100%\n"):
        sink.stream(2, "stderr", chunk)
    sink.stream(2, "stderr", "after\n")
    sink.end_cell()
    assert err.getvalue() == "[rank 2] 100%\n[rank 2] after\n"
    assert out.getvalue() == ""


def test_console_sink_notice_and_display() -> None:
    sink, out, err = _sink()
    sink.notice("jupyter_shard: restarting\n")
    sink.display(3, {"text/plain": "<Figure>", "image/png": "AAA"}, {})
    sink.display(1, {"image/png": "AAA"}, {})
    assert err.getvalue() == "jupyter_shard: restarting\n"
    assert out.getvalue() == "[rank 3] <Figure>\n[rank 1] <display>\n"


class _Recorder(RankSink):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, str]] = []
        self.live: list[tuple[int, str, str, bool]] = []

    def write(self, name: str, text: str) -> None:
        self.writes.append((name, text))

    def live_line(self, rank: int, name: str, text: str, final: bool) -> None:
        self.live.append((rank, name, text, final))

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        raise AssertionError("not used")


def test_sink_reports_intermediate_live_texts_and_the_final_one() -> None:
    sink = _Recorder()
    sink.begin_cell()
    for chunk in ("\r 10%", "\r 50%", "\r100%\n"):
        sink.stream(0, "stderr", chunk)
    sink.end_cell()
    assert sink.live == [
        (0, "stderr", " 10%", False),
        (0, "stderr", " 50%", False),
        (0, "stderr", "100%", True),
    ]
    assert sink.writes == []


def test_live_line_keeps_order_with_plain_lines_in_one_chunk() -> None:
    sink = _Recorder()
    sink.begin_cell()
    sink.stream(0, "stdout", "before\n\rbar 100%\nafter\n")
    assert sink.writes == [("stdout", "[rank 0] before\n"), ("stdout", "[rank 0] after\n")]
    assert sink.live == [(0, "stdout", "bar 100%", True)]


# -- the per-cell cap ---------------------------------------------------------------------------------


def _cap(monkeypatch: pytest.MonkeyPatch, lines: int, tail: int) -> None:
    monkeypatch.setattr(rank_output, "MAX_LINES_SHOWN", lines)
    monkeypatch.setattr(rank_output, "TAIL_LINES", tail)


RUNNING = "… more output not shown while the cell runs; its last lines follow when it ends (full log: {})"


def test_cap_shows_the_first_and_the_last_lines_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    _cap(monkeypatch, 5, 2)
    sink, out, _ = _sink()
    sink.log_paths[0] = "/tmp/logs/rank-0.log"
    sink.begin_cell()
    for i in range(10):
        sink.stream(0, "stdout", f"line {i}\n")
    sink.stream(0, "stdout", "".join(f"more {i}\n" for i in range(10)))
    assert out.getvalue().splitlines()[-1] == "[rank 0] " + RUNNING.format("/tmp/logs/rank-0.log")
    sink.end_cell()
    assert out.getvalue().splitlines() == [
        "[rank 0] line 0",
        "[rank 0] line 1",
        "[rank 0] line 2",
        "[rank 0] " + RUNNING.format("/tmp/logs/rank-0.log"),
        "[rank 0] … 15 lines not shown (full log: /tmp/logs/rank-0.log)",
        "[rank 0] more 8",
        "[rank 0] more 9",
    ]


def test_cap_is_per_rank_and_per_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    _cap(monkeypatch, 2, 1)
    sink, out, _ = _sink()
    sink.begin_cell()
    sink.stream(0, "stdout", "a\nb\nc\nd\n")
    sink.stream(1, "stdout", "p\n")
    sink.end_cell()
    text = out.getvalue()
    assert "[rank 1] p\n" in text and "rank 1] …" not in text
    assert "[rank 0] a\n" in text and "[rank 0] d\n" in text and "[rank 0] b" not in text
    assert "[rank 0] … 2 lines not shown (full log: the rank's log file)" in text  # no log path known
    out.truncate(0)
    out.seek(0)
    sink.begin_cell()
    sink.stream(0, "stdout", "e\n")
    sink.end_cell()
    assert out.getvalue() == "[rank 0] e\n"


def test_cap_on_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_output, "MAX_BYTES_SHOWN", 10)
    monkeypatch.setattr(rank_output, "TAIL_BYTES", 4)
    sink, out, _ = _sink()
    sink.log_paths[1] = "r1.log"
    sink.begin_cell()
    sink.stream(1, "stdout", "12345\n67890\nabc\n")
    sink.end_cell()
    assert out.getvalue() == (
        f"[rank 1] 12345\n[rank 1] {RUNNING.format('r1.log')}\n"
        "[rank 1] … 1 line not shown (full log: r1.log)\n[rank 1] abc\n"
    )


def test_the_last_lines_keep_their_streams_and_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _cap(monkeypatch, 2, 3)
    sink, out, err = _sink()
    sink.begin_cell()
    sink.stream(0, "stdout", "".join(f"o{i}\n" for i in range(5)))
    sink.stream(0, "stderr", "e0\n")
    sink.stream(0, "stdout", "o5\n")
    sink.end_cell()
    assert out.getvalue().endswith(
        "[rank 0] … 4 lines not shown (full log: the rank's log file)\n[rank 0] o4\n[rank 0] o5\n"
    )
    assert err.getvalue() == "[rank 0] e0\n"


def test_a_flood_ends_with_its_last_line_and_the_exact_count() -> None:
    sink, out, _ = _sink()
    sink.begin_cell()
    lines = [f"step {i} loss {1 / (i + 1):.6f}" for i in range(200_000)]
    text = "".join(f"{line}\n" for line in lines)
    for at in range(0, len(text), 65536):  # chunks cut anywhere, as the rank sends them
        sink.stream(0, "stdout", text[at : at + 65536])
    sink.end_cell()
    shown = out.getvalue().splitlines()
    head = rank_output.MAX_LINES_SHOWN - rank_output.TAIL_LINES
    assert shown[:head] == [f"[rank 0] {line}" for line in lines[:head]]
    assert shown[-1] == f"[rank 0] {lines[-1]}"
    assert shown[-rank_output.TAIL_LINES :] == [
        f"[rank 0] {line}" for line in lines[-rank_output.TAIL_LINES :]
    ]
    skipped = 200_000 - head - rank_output.TAIL_LINES
    assert f"[rank 0] … {skipped:,} lines not shown (full log: the rank's log file)" in shown


@pytest.mark.parametrize("past_the_cap", [False, True], ids=["first-lines", "last-lines"])
@pytest.mark.parametrize("chunk", [65536, 10 * 2**20 + 1], ids=["in-chunks", "at-once"])
def test_a_10_mb_line_is_shown_cut_with_its_length(
    monkeypatch: pytest.MonkeyPatch, chunk: int, past_the_cap: bool
) -> None:
    sink, out, _ = _sink()
    sink.begin_cell()
    if past_the_cap:
        _cap(monkeypatch, 3, 2)
        sink.stream(0, "stdout", "a\nb\nc\n")
    line = "x" * (10 * 2**20)
    text = line + "\nafter\n"
    for at in range(0, len(text), chunk):
        sink.stream(0, "stdout", text[at : at + chunk])
    sink.end_cell()
    shown = out.getvalue().splitlines()
    assert shown[-2] == (
        f"[rank 0] {'x' * rank_output.LINE_CHARS} … (a line of {10 * 2**20:,} characters, cut; "
        "the rank's log has all of it)"
    )
    assert shown[-1] == "[rank 0] after"


def test_crlf_lines_are_plain_lines() -> None:
    """Output from a pty (``!cmd``) ends lines with CRLF: those are ordinary lines, not live ones."""
    assert LineAssembler().feed("one\r\ntwo\r\n") == ([("one", False), ("two", False)], None)


def test_crlf_lines_count_towards_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    _cap(monkeypatch, 2, 1)
    sink = _Recorder()
    sink.begin_cell()
    sink.stream(0, "stdout", "".join(f"{i}\r\n" for i in range(5)))
    assert sink.live == []
    assert "".join(t for _, t in sink.writes).count("\n") == 2  # a line and the notice
    sink.end_cell()
    assert sink.writes[-1] == ("stdout", "[rank 0] 4\n")


def test_progress_line_ended_by_crlf_is_still_live() -> None:
    assert LineAssembler().feed("\r 50%\r100%\r\n") == ([("100%", True)], None)


def test_past_the_cap_the_unfinished_line_is_still_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the cap only the last plain lines are kept, and the line still open at the end of a chunk
    too, so a progress bar that starts on it later shows the right text."""
    _cap(monkeypatch, 2, 1)
    sink = _Recorder()
    sink.begin_cell()
    sink.stream(0, "stdout", "a\nb\nc\n")  # the cap is reached here
    sink.stream(0, "stdout", "d\nep")  # skipped lines; "ep" is still open
    sink.stream(0, "stdout", "och ")  # no newline: the open line grows
    sink.stream(0, "stdout", "1\r")
    assert sink.live == [(0, "stdout", "epoch 1", False)]
    sink.stream(0, "stdout", "epoch 2\n")
    assert sink.live[-1] == (0, "stdout", "epoch 2", True)
    assert "".join(t for _, t in sink.writes).count("\n") == 2  # a line and the notice
