"""What a pool ran since it started: cells and pushes in order, values kept as bytes or by reference."""

from __future__ import annotations

import cloudpickle
import pytest

from jupyter_shard.pool.transcript import CellEntry, Held, PushEntry, Transcript


class _Counter:
    """Counts how often it is pickled."""

    pickled = 0

    def __reduce__(self) -> tuple[type[_Counter], tuple[()]]:
        _Counter.pickled += 1
        return (_Counter, ())


def test_entries_keep_their_order_and_cells_are_listed_alone() -> None:
    transcript = Transcript()
    first, push, second = (
        CellEntry("a = 1", None, "ok", 1),
        PushEntry((("x", b"."),), (0,)),
        CellEntry("b", (1,), "error", 2),
    )
    for entry in (first, push, second):
        transcript.add(entry)
    assert transcript.entries == [first, push, second]
    assert transcript.cells() == [first, second]
    assert len(transcript) == 3
    assert len(Transcript()) == 0 and Transcript().cells() == []


def test_each_transcript_starts_empty() -> None:
    one, two = Transcript(), Transcript()
    one.add(CellEntry("x", None, "ok"))
    assert len(two) == 0  # no entries shared between pools


def test_a_held_value_is_pickled_only_when_asked_and_each_time_afresh() -> None:
    value = {"w": [1, 2, 3], "c": _Counter()}
    held = Held(value)
    before = _Counter.pickled
    assert held.value is value and _Counter.pickled == before
    data = held.pickled()
    assert isinstance(data, bytes) and cloudpickle.loads(data)["w"] == [1, 2, 3]
    value["w"].append(4)  # what an export writes is what it holds then
    assert cloudpickle.loads(held.pickled())["w"] == [1, 2, 3, 4]
    assert _Counter.pickled == before + 2


def test_a_push_entry_gives_every_value_as_bytes_in_the_order_given() -> None:
    small = cloudpickle.dumps(5)
    entry = PushEntry((("b", small), ("a", Held([7]))), None)
    names = [name for name, _ in entry.pickled()]
    assert names == ["b", "a"]
    assert [cloudpickle.loads(data) for _, data in entry.pickled()] == [5, [7]]
    assert entry.pickled()[0][1] is small  # bytes already kept are given as they are


def test_entries_are_frozen() -> None:
    entry = CellEntry("x", None, "ok")
    with pytest.raises(AttributeError):
        entry.status = "error"  # type: ignore[misc]
