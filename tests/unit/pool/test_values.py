"""Push and pull as the pool's connection carries them, with a stand-in connection that answers as
ranks on another machine would (every value in the messages; no shared memory)."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import cloudpickle
import numpy as np
import pytest

from jupyter_shard.errors import PoolError
from jupyter_shard.pool import values as values_module
from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankRecord, RankTable
from jupyter_shard.pool.transcript import Held, PushEntry, Transcript
from jupyter_shard.pool.values import Transfer, Values, named_values
from jupyter_shard.transfer import pickling
from jupyter_shard.wire.protocol import Message
from tests.unit.pool.handles import IdleHandle

Answer = Callable[[int, str, dict[str, Any], list[Any]], Message | None]


class _Conn:
    """Records each request; ``answer(rank, type, body, buffers)`` is each rank's reply (None: silent)."""

    open = True

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[tuple[str, dict[str, Any], list[int], list[Any]]] = []
        self.sent: list[tuple[list[int], str, dict[str, Any]]] = []

    def request(
        self,
        msg_type: str,
        body: Mapping[str, Any],
        targets: list[RankRecord],
        *,
        buffers: Sequence[Any] = (),
        timeout: float,
    ) -> dict[int, Message]:
        self.requests.append((msg_type, dict(body), [r.rank for r in targets], list(buffers)))
        replies = {r.rank: self.answer(r.rank, msg_type, dict(body), list(buffers)) for r in targets}
        return {k: m for k, m in replies.items() if m is not None}

    def send(self, targets: Sequence[RankRecord], msg_type: str, body: Mapping[str, Any]) -> None:
        self.sent.append(([r.rank for r in targets], msg_type, dict(body)))


def _values(tmp_path: Path, answer: Answer, ranks: int = 2) -> tuple[Values, _Conn, Transcript]:
    table = RankTable(History())
    for rank in range(ranks):
        table.add(RankRecord(IdleHandle(rank), tmp_path / f"rank-{rank}.log"))
    conn, transcript = _Conn(answer), Transcript()
    return Values(cast(Connection, conn), table, transcript), conn, transcript


def _ok(rank: int, msg_type: str, body: dict[str, Any], buffers: list[Any]) -> Message:
    return Message("push_reply", {"ok": True, "error": ""})


def _pull_reply(value: Any) -> Message:
    packed = pickling.dumps(value)
    body = {"ok": True, "error": "", "sizes": packed.sizes}
    return Message("pull_reply", body, buffers=[packed.inband, *(bytes(b) for b in packed.buffers)])


def test_named_values_joins_a_dict_and_keywords_and_refuses_what_is_not_a_name() -> None:
    assert named_values({"a": 1}, {"b": 2}) == {"a": 1, "b": 2}
    assert named_values(None, {"b": 2}) == {"b": 2}
    assert named_values({"a": 1}, {"a": 3}) == {"a": 3}  # a keyword wins over the dict
    with pytest.raises(TypeError, match=r"push takes its values by name"):
        named_values(cast(Any, [1, 2]), {})
    with pytest.raises(PoolError, match=r"cannot push under '1x', 2: each name must be a Python identifier"):
        named_values(cast(Any, {"1x": 0, 2: 0, "ok": 0}), {})


def test_a_push_sends_the_pickle_to_every_rank_and_records_its_bytes(tmp_path: Path) -> None:
    values, conn, transcript = _values(tmp_path, _ok)
    array = np.arange(12, dtype=np.float32)
    size = values.push(None, {"x": array, "n": 5})
    [(msg_type, body, targets, buffers)] = conn.requests
    assert (msg_type, body["names"], targets) == ("push", ["x", "n"], [0, 1])
    inband = buffers[: len(body["names"])]
    oob = buffers[len(body["names"]) :]
    assert sum(body["counts"]) == len(oob) and body["sizes"] == [b.nbytes for b in oob]
    assert size == sum(len(b) for b in inband) + sum(body["sizes"])
    x = pickling.loads(inband[0], [bytearray(b) for b in oob[: body["counts"][0]]])
    assert np.array_equal(x, array)
    [entry] = transcript.entries
    assert isinstance(entry, PushEntry) and entry.ranks is None
    recorded = dict(entry.pickled())
    assert np.array_equal(cloudpickle.loads(recorded["x"]), array) and cloudpickle.loads(recorded["n"]) == 5
    assert values.last is not None
    assert (values.last.kind, values.last.ranks, values.last.path) == ("push", 2, "messages")


def test_a_push_to_some_ranks_records_them_sorted_once(tmp_path: Path) -> None:
    values, conn, transcript = _values(tmp_path, _ok, ranks=3)
    values.push([2, 0, 2], {"x": 1})
    assert conn.requests[0][2] == [0, 2]
    assert cast(PushEntry, transcript.entries[0]).ranks == (0, 2)


def test_the_pools_own_pushes_are_not_recorded(tmp_path: Path) -> None:
    values, _, transcript = _values(tmp_path, _ok)
    values.push(None, {"_js_probe": 1})
    assert len(transcript) == 0


def test_a_large_value_is_recorded_by_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(values_module, "_RECORD_UP_TO", 100)
    values, _, transcript = _values(tmp_path, _ok)
    big = np.zeros(1000, dtype=np.uint8)
    values.push(None, {"big": big})
    [(name, kept)] = cast(PushEntry, transcript.entries[0]).values
    assert name == "big" and isinstance(kept, Held) and kept.value is big


def test_a_push_that_fails_on_a_rank_names_the_rank_and_is_not_recorded(tmp_path: Path) -> None:
    def answer(rank: int, msg_type: str, body: dict[str, Any], buffers: list[Any]) -> Message | None:
        if rank == 1:
            return Message("push_reply", {"ok": False, "error": "no room"})
        return None if rank == 2 else _ok(rank, msg_type, body, buffers)

    values, _, transcript = _values(tmp_path, answer, ranks=3)
    with pytest.raises(PoolError, match=r"^push failed on rank 1: no room; rank 2: did not answer the push$"):
        values.push(None, {"x": 1})
    assert len(transcript) == 0


def test_a_big_push_goes_in_acknowledged_parts_then_a_final_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(values_module, "CHUNK", 40)
    values, conn, _ = _values(tmp_path, _ok)
    array = np.arange(25, dtype=np.int32)  # 100 bytes: parts at 0, 40, 80
    values.push(None, {"a": array})
    parts, final = conn.requests[:-1], conn.requests[-1]
    assert [body["offset"] for _, body, _, _ in parts] == [0, 40, 80]
    assert [sum(memoryview(b).nbytes for b in bufs) for _, _, _, bufs in parts] == [40, 40, 20]
    assert len({body["stream"] for _, body, _, _ in conn.requests}) == 1
    assert final[1]["final"] is True and len(final[3]) == 1  # only the in-band pickle
    joined = b"".join(bytes(memoryview(b)) for _, _, _, bufs in parts for b in bufs)
    assert joined == array.tobytes()


def test_a_rank_that_fails_a_part_gets_no_more_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(values_module, "CHUNK", 40)

    def answer(rank: int, msg_type: str, body: dict[str, Any], buffers: list[Any]) -> Message:
        if rank == 1 and body.get("offset") == 40:
            return Message("push_reply", {"ok": False, "error": "disk full"})
        return _ok(rank, msg_type, body, buffers)

    values, conn, _ = _values(tmp_path, answer)
    with pytest.raises(PoolError, match="rank 1: disk full"):
        values.push(None, {"a": np.arange(25, dtype=np.int32)})
    assert [targets for _, _, targets, _ in conn.requests] == [[0, 1], [0, 1], [0], [0]]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (io.StringIO("text"), r"'v' is an open file, which cannot be sent to the ranks: push its path"),
        (threading.Lock(), r"'v' could not be pickled \(TypeError: .*\): create it on the ranks"),
    ],
    ids=["open-file", "unpicklable"],
)
def test_a_value_that_cannot_travel_is_refused_before_anything_is_sent(
    tmp_path: Path, value: Any, expected: str
) -> None:
    values, conn, transcript = _values(tmp_path, _ok)
    with pytest.raises(PoolError, match=expected):
        values.push(None, {"v": value})
    assert conn.requests == [] and len(transcript) == 0


def test_a_push_to_a_rank_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    values, conn, _ = _values(tmp_path, _ok)
    with pytest.raises(PoolError, match="rank 5 does not exist: the pool has 2 ranks"):
        values.push([5], {"x": 1})
    assert conn.requests == []


def test_a_pull_rebuilds_each_ranks_value(tmp_path: Path) -> None:
    def answer(rank: int, msg_type: str, body: dict[str, Any], buffers: list[Any]) -> Message:
        return _pull_reply({"rank": rank, "w": np.full(4, rank, dtype=np.float64)})

    values, conn, _ = _values(tmp_path, answer)
    got = values.pull("state", None, gather=False)
    assert sorted(got) == [0, 1]
    assert got[1]["rank"] == 1 and np.array_equal(got[1]["w"], np.full(4, 1.0))
    [(msg_type, body, targets, _)] = conn.requests
    assert msg_type == "pull" and body["name"] == "state" and body["gather"] is False
    assert body["device"] is False and targets == [0, 1]
    assert values.last is not None and values.last.kind == "pull" and values.last.path == "messages"
    assert conn.sent == []  # nothing was lent, so nothing to release


def test_a_pull_a_rank_refuses_raises_its_error(tmp_path: Path) -> None:
    def answer(rank: int, msg_type: str, body: dict[str, Any], buffers: list[Any]) -> Message:
        return Message("pull_reply", {"ok": False, "error": "name 'state' is not defined on rank 0"})

    values, _, _ = _values(tmp_path, answer, ranks=1)
    with pytest.raises(PoolError, match="name 'state' is not defined on rank 0"):
        values.pull("state", None, gather=False)


def test_a_pull_a_rank_does_not_answer_names_the_rank(tmp_path: Path) -> None:
    def answer(rank: int, msg_type: str, body: dict[str, Any], buffers: list[Any]) -> Message | None:
        return _pull_reply(rank) if rank == 0 else None

    values, _, _ = _values(tmp_path, answer, ranks=3)
    with pytest.raises(PoolError, match=r"rank 1-2 did not answer the pull of 'x'"):
        values.pull("x", None, gather=False)


@pytest.mark.parametrize("broken", ["not-a-pickle", "wrong-sizes", "no-pickle"])
def test_a_reply_that_cannot_be_rebuilt_leaves_the_pool_unchanged(tmp_path: Path, broken: str) -> None:
    def answer(rank: int, msg_type: str, body: dict[str, Any], buffers: list[Any]) -> Message:
        reply = _pull_reply(np.arange(4))
        if broken == "not-a-pickle":
            reply.buffers[0] = b"garbage"
        elif broken == "wrong-sizes":
            reply.body["sizes"] = [1]
        else:
            reply.buffers = []
        return reply

    values, _, _ = _values(tmp_path, answer, ranks=1)
    with pytest.raises(PoolError, match=r"the value from rank 0 could not be rebuilt .*try the pull again"):
        values.pull("x", None, gather=False)


def test_pull_last_asks_for_the_last_value_with_its_limit_and_nothing_for_no_ranks(tmp_path: Path) -> None:
    values, conn, _ = _values(tmp_path, lambda rank, *_: _pull_reply(rank * 10))
    assert values.pull_last([]) == {}
    assert conn.requests == []
    assert values.pull_last([1], limit=1000) == {1: 10}
    [(_, body, targets, _)] = conn.requests
    assert body["last"] is True and body["limit"] == 1000 and targets == [1]


def test_a_transfers_rate_counts_every_copy_of_a_push() -> None:
    push = Transfer("push", 100, 4, 2.0, "messages")
    pull = Transfer("pull", 100, 4, 2.0, "direct+segment")
    assert push.rate == 200.0 and pull.rate == 50.0
    assert not push.shared and pull.shared
    assert Transfer("push", 100, 1, 0.0, "").rate == 0.0
    assert not Transfer("push", 1, 1, 1.0, "").shared
