"""The namespace half of a suspend, in one process: names kept by value, references kept as
references, functions from cells rebuilt over the new namespace, what cannot be kept named."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

from jupyter_shard.rank.suspend import pickle_namespace, unpickle_namespace


def _cell_namespace() -> dict[str, object]:
    ns: dict[str, object] = {"__name__": "__main__", "torch": torch}
    exec(
        "counter = [0]\n"
        "class Box:\n"
        "    def __init__(self, v):\n"
        "        self.v = v\n"
        "def bump(n=1):\n"
        "    counter[0] += n\n"
        "    return counter[0]\n"
        "box = Box(torch.arange(3))\n"
        "pending = (i for i in range(2))\n"
        "In, Out, _, _i3, _7 = [], {}, 1, 'x', 2\n",
        ns,
    )
    return ns


def test_values_modules_and_lost_names() -> None:
    ns = _cell_namespace()
    model = torch.nn.Linear(2, 2)
    ns["model_alias"], ns["weight"] = model, model.weight
    values, modules, lost = pickle_namespace(ns, {}, {"model": model, "parameter:weight": model.weight})
    assert modules == {"torch": "torch"}
    assert set(values) == {"counter", "Box", "bump", "box", "model_alias", "weight"}  # IPython's own skipped
    assert set(lost) == {"pending"} and lost["pending"].startswith("TypeError: cannot pickle 'generator'")

    fresh: dict[str, object] = {"__name__": "__main__"}
    other = torch.nn.Linear(2, 2)
    restored, failed = unpickle_namespace(values, {"model": other, "parameter:weight": other.weight}, fresh)
    assert failed == {} and set(restored) == set(values)
    assert fresh["model_alias"] is other and fresh["weight"] is other.weight  # references, not copies
    bump = fresh["bump"]
    assert isinstance(bump, types.FunctionType) and bump.__globals__ is fresh
    assert bump(2) == 2 and fresh["counter"] == [2]  # the function sees the namespace's own list
    fresh["counter"] = [10]
    assert bump() == 11  # and a name rebound later


def test_a_reference_the_new_pool_lacks_is_named_not_fatal() -> None:
    model = torch.nn.Linear(2, 2)
    values, _, _ = pickle_namespace({"m": model, "x": 3}, {}, {"model": model})
    restored, failed = unpickle_namespace(values, {}, {})
    assert restored == ["x"] and "not part of the resumed pool's prepared model" in failed["m"]


def test_hidden_names_are_skipped_only_while_unchanged() -> None:
    start = object()
    values, _, _ = pickle_namespace({"a": start, "b": 2}, {"a": start, "b": 1}, {})
    assert set(values) == {"b"}


def test_an_open_file_is_reopened_at_its_place_never_copied_into_memory(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    writer = open(log, "w")  # noqa: SIM115
    writer.write("step 1\n")
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(100)))
    reader = open(data, "rb")  # noqa: SIM115
    reader.read(40)
    values, _, lost = pickle_namespace({"log": writer, "data": reader}, {}, {})
    assert lost == {} and all(len(blob) < 1000 for blob in values.values())  # no file content inside
    writer.close()
    reader.close()
    fresh: dict[str, Any] = {}
    reopened: dict[str, str] = {}
    restored, failed = unpickle_namespace(values, {}, fresh, reopened)
    assert sorted(restored) == ["data", "log"] and failed == {}
    fresh["log"].write("step 2\n")  # goes on where it was, on disk, nothing truncated
    fresh["log"].close()
    assert log.read_text() == "step 1\nstep 2\n"
    assert fresh["data"].read(1) == bytes([40])
    fresh["data"].close()
    assert reopened["log"] == f"{log} (opened 'w', reopened 'r+', at byte 7)"


def test_live_objects_inside_values_are_listed_as_not_kept_with_what_to_do(tmp_path: Path) -> None:
    import socket
    import threading

    handle = open(tmp_path / "x.txt", "w")  # noqa: SIM115
    sock = socket.socket()
    try:
        ns = {
            "cfg": {"out": handle},
            "lock": threading.Lock(),
            "sock": sock,
            "t": threading.Thread(target=print),
        }
        values, _, lost = pickle_namespace(ns, {}, {})
    finally:
        handle.close()
        sock.close()
    assert values == {}
    assert "an open file" in lost["cfg"] and "open it again after the resume" in lost["cfg"]
    assert "lock is not kept" in lost["lock"] and "socket is not kept" in lost["sock"]
    assert "thread is not kept" in lost["t"]


def test_objects_shared_between_names_stay_shared_across_a_failing_name() -> None:
    """``b = a`` and a loader holding its sampler come back as one object each, even with a name
    that cannot be kept between them (its part of the stream is cut, the memo put back)."""
    from torch.utils.data import DataLoader, RandomSampler

    data = list(range(10))
    sampler = RandomSampler(data)
    loader = DataLoader(data, sampler=sampler, batch_size=2)
    shared = {"weights": [1.0, 2.0]}
    ns = {"a": shared, "gen": (i for i in range(2)), "b": shared, "sampler": sampler, "loader": loader}
    values, _, lost = pickle_namespace(ns, {}, {})
    assert set(lost) == {"gen"}
    fresh: dict[str, Any] = {}
    restored, failed = unpickle_namespace(values, {}, fresh)
    assert failed == {} and set(restored) == {"a", "b", "sampler", "loader"}
    assert fresh["a"] is fresh["b"]
    assert fresh["loader"].sampler is fresh["sampler"]  # set_epoch on one reaches the other


def test_in_memory_buffers_are_kept_and_a_file_read_by_next_is_named(tmp_path: Path) -> None:
    import io

    text = tmp_path / "lines.txt"
    text.write_text("a\nb\n")
    reading = open(text)  # noqa: SIM115
    next(reading)  # its position can no longer be told
    try:
        ns = {"buf": io.BytesIO(b"abc"), "held": {"s": io.StringIO("x")}, "reading": reading}
        values, _, lost = pickle_namespace(ns, {}, {})
    finally:
        reading.close()
    assert set(values) == {"buf", "held"}
    assert (
        "telling position disabled" in lost["reading"] and "open it again after the resume" in lost["reading"]
    )
    fresh: dict[str, Any] = {}
    unpickle_namespace(values, {}, fresh)
    assert fresh["buf"].getvalue() == b"abc" and fresh["held"]["s"].getvalue() == "x"
