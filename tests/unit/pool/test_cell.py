"""Rank output on the wire: a rank's ``RankStream`` to the kernel's ``Connection`` and the running cell,
through real framing."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.pool.cell import POST_MORTEM, CellGathering
from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.escalation import Escalation
from jupyter_shard.pool.history import History
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.pool.ranks import RankRecord, RankState, RankTable
from jupyter_shard.pool.results import DistributedError
from jupyter_shard.rank.output import RankStream
from jupyter_shard.wire.messages import check_body
from jupyter_shard.wire.protocol import Message, Wire, io_identity, new_key
from tests.unit.pool.handles import IdleHandle


class _Link:
    """One rank's I/O wire and the kernel's receiver, joined as the pool socket joins them."""

    def __init__(self, tmp_path: Path) -> None:
        key = new_key()
        self.rank_wire, self.kernel_wire = Wire(key, io_identity(0)), Wire(key, "kernel")
        self.out, self.err = io.StringIO(), io.StringIO()
        sink = ConsoleSink(self.out, self.err)
        self.ranks = RankTable(History())
        self.conn = Connection(self.ranks)
        escalation = Escalation(self.conn, self.ranks, sink.notice, lambda ranks: {})
        self.cells = CellGathering(self.conn, self.ranks, escalation, lambda: sink)
        record = RankRecord(IdleHandle(0), tmp_path / "rank-0.log")
        self.ranks.add(record)
        self.gathering = self.cells.open("print()", [record], None, 0, None, record=False)
        self.log = io.StringIO()
        self.stream = RankStream("stdout", self.log, self.send, lambda: "c", threading.Lock())
        self.sent: list[tuple[str, dict[str, Any], list[bytes]]] = []

    def send(self, msg_type: str, body: dict[str, Any], buffers: list[bytes]) -> None:
        self.sent.append((msg_type, body, buffers))
        frames = self.rank_wire.to_socket(msg_type, body, buffers)
        self.conn.dispatch(self.kernel_wire, [io_identity(0).encode(), *frames])


def test_any_text_arrives_unchanged_and_is_not_json_escaped(tmp_path: Path) -> None:
    link = _Link(tmp_path)
    text = 'plain "quoted" \\ tab\t é ✓ 𝔘 \x00 lone \udcff surrogate\n'
    link.stream.write(text)
    link.stream.flush()
    assert [(t, b) for t, b, _ in link.sent] == [("stream", {"cell_id": "c", "name": "stdout"})]
    assert link.sent[0][2] == [text.encode("utf-8", "surrogatepass")]
    assert link.gathering.result.ranks[0].stdout == text
    assert link.conn.dropped + link.ranks.dropped == 0
    assert link.ranks[0].io_received == 1
    assert link.log.getvalue() == text


@pytest.mark.parametrize(
    ("body", "buffers"),
    [
        ({"cell_id": "c", "name": "stdout", "text": "old layout\n"}, []),
        ({"cell_id": "c", "name": "stdout"}, [b"one\n", b"two\n"]),
        ({"cell_id": "c", "name": "stdout"}, [b"\xff\xfe not UTF-8\n"]),
    ],
    ids=["text-in-body", "two-buffers", "not-utf8"],
)
def test_malformed_output_is_dropped_and_counted(
    tmp_path: Path, body: dict[str, Any], buffers: list[bytes]
) -> None:
    link = _Link(tmp_path)
    link.send("stream", body, buffers)
    assert link.conn.dropped + link.ranks.dropped == 1
    assert link.gathering.result.ranks[0].stdout == ""
    assert link.out.getvalue() == ""
    link.stream.write("after\n")
    link.stream.flush()
    assert link.gathering.result.ranks[0].stdout == "after\n"  # the link still works


LOST = "CUDA error: device-side assert triggered"


def _done(cell_id: str, status: str = "ok", lost_context: str = "") -> Message:
    body = {
        "io_count": 0,
        "cell_id": cell_id,
        "status": status,
        "ename": "AcceleratorError" if status == "error" else "",
        "evalue": f"{LOST}\nSearch for `cudaErrorAssert'" if status == "error" else "",
        "traceback": [],
        "duration": 0.1,
        "grouped": True,
        "lost_context": lost_context,
    }
    assert check_body("done", body) == []
    return Message("done", body)


def test_a_rank_whose_cuda_context_is_lost_is_broken_and_the_cell_says_what_to_do(tmp_path: Path) -> None:
    link = _Link(tmp_path)
    link.ranks.add(RankRecord(IdleHandle(1), tmp_path / "rank-1.log"))
    cells, ranks = link.cells, link.ranks
    gathering = cells.open("x[7]", [ranks[0], ranks[1]], None, 0, None, record=False)
    cell_id = gathering.result.cell_id
    cells.on_done(ranks[0], _done(cell_id))
    cells.on_done(ranks[1], _done(cell_id, "error", LOST))
    cells.end(gathering, [])

    assert ranks[1].state is RankState.BROKEN and ranks[1].broken == LOST
    assert ranks[0].state is RankState.IDLE and ranks[0].broken == ""
    assert gathering.lost == [1]
    notes = gathering.result.notes
    assert notes[0].startswith(f"rank 1 lost its CUDA context ({LOST}): every later CUDA call")
    assert "only a new process helps" in notes[0]
    assert "%dist_restart for fresh ranks (rank state is lost" in notes[0]
    assert "%dist_pull NAME --rank 1" in notes[0]
    assert "CUDA_LAUNCH_BLOCKING=1" in notes[1]
    assert DistributedError(gathering.result).render()[1:3] == notes[:2]

    # %debug on the broken rank (the pool lets it through) ends with the rank still broken, said once
    again = cells.open(POST_MORTEM, [ranks[1]], None, 0, [1], record=False)
    cells.on_done(ranks[1], _done(again.result.cell_id, "ok", LOST))
    cells.end(again, [])
    assert ranks[1].state is RankState.BROKEN and again.lost == [] and again.result.notes == []
