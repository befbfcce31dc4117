"""A rank's lease, with a real lifeline pipe and connection events fed by hand: without a lease the
rank ends as soon as its kernel is gone; with one it waits, a kernel attaching stops the countdown,
and losing that kernel starts it again; rank 0 notes in the record when the kernel went."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from jupyter_shard.rank import keep


@pytest.fixture
def watched(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[int, zmq.Socket[bytes], list[tuple[float, str]]]]:
    """(lifeline write end, a socket to send connection events on, when and why the rank ended)."""
    ended: list[tuple[float, str]] = []

    def end(rank: int, record: Path | None, why: str) -> None:
        ended.append((time.monotonic(), why))
        threading.Event().wait()  # the watching thread stops here, as the rank itself would end

    monkeypatch.setattr(keep, "_end", end)
    monkeypatch.setattr(keep, "LEASE", keep.Lease())
    ctx = zmq.Context()
    events, feed = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    events.bind("inproc://events")
    feed.connect("inproc://events")
    read, write = os.pipe()
    keep.watch_owner(read, os.getppid(), events, rank=1)
    yield write, feed, ended
    feed.close(0)
    events.close(0)
    ctx.term()
    os.close(read)


def _event(feed: zmq.Socket[bytes], event: int) -> None:
    feed.send_multipart([struct.pack("=hi", event, 0), b"ipc://pool.sock"])


def _wait(ended: list[tuple[float, str]], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)


def test_without_a_lease_the_rank_ends_with_its_kernel(watched: tuple[int, zmq.Socket[bytes], list]) -> None:
    write, _, ended = watched
    gone = time.monotonic()
    os.close(write)
    _wait(ended, 2.0)
    assert ended and ended[0][1] == "" and ended[0][0] - gone < 0.5


def test_a_lease_waits_and_an_attaching_kernel_stops_the_countdown(
    watched: tuple[int, zmq.Socket[bytes], list],
) -> None:
    write, feed, ended = watched
    keep.set_lease(0.6, None)
    os.close(write)
    time.sleep(0.3)
    _event(feed, zmq.EVENT_HANDSHAKE_SUCCEEDED)  # a kernel bound the pool's socket again
    time.sleep(1.0)
    assert ended == []
    lost = time.monotonic()
    _event(feed, zmq.EVENT_DISCONNECTED)  # and went
    _wait(ended, 3.0)
    assert ended and "the lease of this kept pool" in ended[0][1]
    assert 0.55 < ended[0][0] - lost < 1.2


def test_keep_0_from_an_attached_kernel_read_before_its_connection_event_keeps_the_rank(
    watched: tuple[int, zmq.Socket[bytes], list],
) -> None:
    """The lease is set by a message from the kernel, so a kernel is attached when it arrives: the rank
    goes on, though this thread has not yet read that kernel's connection event; it ends with that
    kernel."""
    write, feed, ended = watched
    keep.set_lease(60, None)
    os.close(write)  # the first kernel went: the lease holds the rank
    time.sleep(0.3)
    keep.set_lease(0, None)  # `--keep 0` from the kernel that attached, before its event is read
    time.sleep(keep.HEARD_GRACE / 2)
    assert ended == []
    _event(feed, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    time.sleep(keep.HEARD_GRACE + 0.5)
    assert ended == []
    lost = time.monotonic()
    _event(feed, zmq.EVENT_DISCONNECTED)  # that kernel goes: the rank ends with it, at once
    _wait(ended, 2.0)
    assert ended and ended[0][1] == "" and ended[0][0] - lost < 0.5


def test_a_lease_the_gone_kernel_set_in_a_cell_run_late_still_ends_the_rank(
    watched: tuple[int, zmq.Socket[bytes], list],
) -> None:
    """A busy rank runs the kernel's `--keep 0` after that kernel went: no kernel's connection comes
    up, so the rank ends once the grace for one has passed; it is never kept for good."""
    write, _, ended = watched
    keep.set_lease(600, None)
    os.close(write)  # the kernel went; the lease holds the rank
    time.sleep(0.3)
    late = time.monotonic()
    keep.set_lease(0, None)  # that kernel's setting, run late
    _wait(ended, keep.HEARD_GRACE + 2.0)
    assert ended and ended[0][1] == ""
    assert keep.HEARD_GRACE - 0.1 < ended[0][0] - late < keep.HEARD_GRACE + 1.0


def test_set_lease_never_goes_below_zero() -> None:
    lease = keep.LEASE
    try:
        keep.set_lease(-5, "/x/kept.json")
        assert lease.seconds == 0.0 and lease.record == Path("/x/kept.json")
    finally:
        keep.set_lease(0, None)


def test_rank_zero_notes_when_the_kernel_went(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "kept.json"
    record.write_text(json.dumps({"owner": [1, 2.0], "orphaned_at": None, "keep": 60}))
    monkeypatch.setattr(keep, "LEASE", keep.Lease())
    keep.set_lease(60, str(record))
    keep._kernel_went(rank=1)
    assert json.loads(record.read_text())["owner"] == [1, 2.0]  # only rank 0 writes
    before = time.time()
    keep._kernel_went(rank=0)
    data = json.loads(record.read_text())
    assert data["owner"] is None and before <= data["orphaned_at"] <= time.time()
    assert oct(record.stat().st_mode & 0o777) == "0o600"
