"""jupyter_shard.rank.output: a rank's stdout and stderr, written to its log at once and sent to the
kernel in coalesced chunks."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.rank import output
from jupyter_shard.rank.output import RankStream
from jupyter_shard.wire.messages import check_body


class Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any], list[bytes]]] = []

    def __call__(self, msg_type: str, body: Any, buffers: list[bytes]) -> None:
        assert check_body(msg_type, body) == []
        self.sent.append((msg_type, dict(body), buffers))


class CountingLog(io.StringIO):
    flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def _stream(name: str = "stdout", cell: list[str] | None = None) -> tuple[RankStream, CountingLog, Outbox]:
    log, outbox, cell = CountingLog(), Outbox(), cell or ["c1"]
    return RankStream(name, log, outbox, lambda: cell[0], threading.Lock()), log, outbox  # type: ignore[arg-type]


def test_text_reaches_the_log_at_once_and_the_kernel_at_the_flush() -> None:
    stream, log, outbox = _stream()
    assert stream.write("step 1\n") == 7
    print("step", 2, file=stream)
    assert log.getvalue() == "step 1\nstep 2\n"
    assert outbox.sent == []
    stream.flush()
    assert outbox.sent == [("stream", {"cell_id": "c1", "name": "stdout"}, [b"step 1\nstep 2\n"])]


def test_a_flush_with_nothing_new_sends_nothing_but_flushes_the_log() -> None:
    stream, log, outbox = _stream()
    stream.write("x")
    stream.flush()
    before = log.flushes
    stream.flush()
    assert len(outbox.sent) == 1 and log.flushes == before + 1


def test_the_chunk_belongs_to_the_cell_running_when_it_is_flushed() -> None:
    cell = ["c1"]
    stream, _, outbox = _stream("stderr", cell)
    stream.write("warning\n")
    cell[0] = "c2"
    stream.flush()
    assert outbox.sent[0][1] == {"cell_id": "c2", "name": "stderr"}


def test_a_flood_is_sent_in_chunks_of_bounded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "MAX_PENDING", 10)
    stream, log, outbox = _stream()
    for _ in range(8):
        stream.write("abc")  # the 4th and 8th writes reach 10 characters
    assert [b[0] for _, _, b in outbox.sent] == [b"abc" * 4, b"abc" * 4]
    stream.write("d")
    assert len(outbox.sent) == 2
    stream.flush()
    assert outbox.sent[-1][2] == [b"d"] and log.getvalue() == "abc" * 8 + "d"


def test_any_text_is_sent_as_utf8_with_lone_surrogates_kept() -> None:
    stream, _, outbox = _stream()
    stream.write("é ✓ \udcff\n")
    stream.flush()
    assert outbox.sent[0][2] == ["é ✓ \udcff\n".encode("utf-8", "surrogatepass")]


def test_only_text_may_be_written() -> None:
    stream, log, outbox = _stream()
    with pytest.raises(TypeError, match="write\\(\\) argument must be str, not bytes"):
        stream.write(b"raw")  # type: ignore[arg-type]
    assert stream.write("") == 0
    stream.flush()
    assert log.getvalue() == "" and outbox.sent == []


def test_the_stream_looks_like_a_utf8_file_not_a_terminal(tmp_path: Path) -> None:
    with open(tmp_path / "rank-0.log", "w") as log:
        stream = RankStream("stdout", log, Outbox(), lambda: "", threading.Lock())
        assert stream.fileno() == log.fileno()
        assert stream.encoding == "utf-8" and stream.writable() and not stream.isatty()
        assert stream.name == "stdout"


def test_stdout_and_stderr_share_the_log_without_interleaving_a_write() -> None:
    log, outbox, lock = io.StringIO(), Outbox(), threading.Lock()
    out = RankStream("stdout", log, outbox, lambda: "c", lock)
    err = RankStream("stderr", log, outbox, lambda: "c", lock)
    line_out, line_err = "o" * 1000 + "\n", "e" * 1000 + "\n"

    def write(stream: RankStream, line: str) -> None:
        for _ in range(200):
            stream.write(line)

    threads = [threading.Thread(target=write, args=(s, ln)) for s, ln in ((out, line_out), (err, line_err))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(log.getvalue().splitlines(keepends=True))) == [line_err, line_out]
