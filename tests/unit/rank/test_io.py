"""A rank's I/O thread (jupyter_shard.rank.channel and io_replies) goes on through failures.

A real :class:`Channel` runs its loop against a real ROUTER socket playing the kernel. The failures
are torch's own: on this CPU-only build every CUDA call raises, as every CUDA call does on a GPU
after a device-side assert. ``torch.cuda.is_initialized`` is made to say True so that the
heartbeat's memory probe makes those calls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
import zmq

from jupyter_shard.rank import channel as channel_module
from jupyter_shard.rank import shard as shard_module
from jupyter_shard.rank.channel import Channel
from jupyter_shard.rank.io_replies import serve_io
from jupyter_shard.rank.runner import CellState
from jupyter_shard.wire.messages import HEARTBEAT, Outgoing, check_body
from jupyter_shard.wire.protocol import Message, Wire, io_identity, new_key

pytestmark = pytest.mark.timeout(30)

RANK_IO = io_identity(0)


@dataclass
class Kernel:
    """The kernel's end: a ROUTER socket, its wire, and every message the rank's I/O thread sent."""

    router: zmq.Socket[bytes]
    wire: Wire
    received: list[Message] = field(default_factory=list)

    def send(self, msg_type: str, body: dict[str, object]) -> None:
        self.router.send_multipart([RANK_IO.encode(), *self.wire.to_socket(msg_type, body)])

    def receive_until(self, done: Callable[[list[Message]], bool], seconds: float = 15.0) -> list[Message]:
        deadline = time.monotonic() + seconds
        while not done(self.received) and time.monotonic() < deadline:
            if self.router.poll(20):
                identity, *frames = self.router.recv_multipart()
                assert identity == RANK_IO.encode()
                self.received.append(self.wire.from_socket(frames, expect_sender=RANK_IO))
        return self.received

    def of_type(self, msg_type: str) -> list[Message]:
        return [m for m in self.received if m.type == msg_type]

    def stderr(self) -> list[str]:
        return [m.buffers[0].decode() for m in self.of_type("stream") if m.body["name"] == "stderr"]


@pytest.fixture
def wired(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Kernel, Channel]]:
    monkeypatch.setattr(channel_module, "HEARTBEAT_INTERVAL", 0.05)
    monkeypatch.setattr(channel_module, "IDLE_HEARTBEAT_INTERVAL", 0.05)
    key = new_key()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    channel = Channel(ctx, f"tcp://127.0.0.1:{port}", key, RANK_IO)
    yield Kernel(router, Wire(key, "kernel")), channel
    channel.close(timeout=2.0)
    router.close(linger=0)
    ctx.destroy(linger=0)


def _cuda_call() -> None:
    torch.cuda.synchronize()  # raises here: no CUDA in this torch build


def test_the_loop_goes_on_after_a_heartbeat_a_flusher_and_a_handler_raise(
    wired: tuple[Kernel, Channel],
) -> None:
    kernel, channel = wired
    beats = 0

    def heartbeat() -> Outgoing:
        nonlocal beats
        beats += 1
        if beats == 1:
            _cuda_call()
        return HEARTBEAT(
            {
                "executing": False,
                "cell": "",
                "running_for": 0.0,
                "memory": {},
                "step": beats,
                "collective": "",
                "group_ranks": [],
                "waiting": "",
            }
        )

    statuses = 0

    def status(msg: Message) -> None:
        nonlocal statuses
        statuses += 1
        if statuses == 1:
            _cuda_call()
        channel.enqueue("status_reply", {"req_id": msg.body["req_id"]}, [])

    late_output = threading.Event()

    def working_flusher() -> None:
        if late_output.is_set():
            channel.enqueue("stream", {"cell_id": "c", "name": "stdout"}, [b"still flowing\n"])
            late_output.clear()

    channel.flushers.extend([_cuda_call, working_flusher])
    channel.heartbeat = heartbeat
    channel.io_handlers = {"status": status}
    channel.start()

    # the ROUTER drops what it sends before the rank's socket has said anything: wait for a heartbeat
    kernel.receive_until(lambda got: bool(kernel.of_type("heartbeat")))
    kernel.send("status", {"req_id": "first"})
    kernel.receive_until(lambda got: len(kernel.of_type("heartbeat")) >= 3)
    kernel.send("status", {"req_id": "second"})
    late_output.set()
    flowing = [b"still flowing\n"]
    kernel.receive_until(
        lambda got: bool(kernel.of_type("status_reply")) and any(m.buffers == flowing for m in got)
    )

    assert [m.body["req_id"] for m in kernel.of_type("status_reply")] == ["second"]
    assert [m.body["step"] for m in kernel.of_type("heartbeat")][:2] == [2, 3]  # the first one raised
    kernel.receive_until(lambda got: len(kernel.stderr()) >= 3, seconds=1.0)
    reports = sorted(kernel.stderr())
    assert len(reports) == 3, reports  # once each, however often it failed
    assert [r.split(" failed on this rank (")[0] for r in reports] == [
        "jupyter_shard: answering a 'status' request",
        "jupyter_shard: flushing _cuda_call",
        "jupyter_shard: the heartbeat",
    ]
    assert all(
        "(AssertionError: Torch not compiled with CUDA enabled); its I/O thread goes on" in r for r in reports
    )
    assert all(r.endswith(", and says this once\n") for r in reports)


def test_a_flush_from_the_main_thread_survives_a_failing_flusher(wired: tuple[Kernel, Channel]) -> None:
    kernel, channel = wired
    channel.flushers.append(_cuda_call)
    channel.start()
    count = channel.flush()  # what a cell's ``done`` counts: it must go out
    assert count == 1 and channel.flush() == 1  # the report, once
    assert kernel.receive_until(lambda got: len(kernel.stderr()) == 1)


def test_a_heartbeat_whose_memory_probe_fails_still_goes_out(
    wired: tuple[Kernel, Channel], monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel, channel = wired
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # so the probe asks CUDA
    monkeypatch.setattr(shard_module, "_current", None)
    helper = shard_module.Shard(0, 0, 1, torch.device("cuda", 0), "none", channel.enqueue)
    shard_module.set_current(helper)
    serve_io(channel, CellState())
    channel.start()

    kernel.receive_until(lambda got: len(kernel.of_type("heartbeat")) >= 3)
    kernel.send("status", {"req_id": "r"})
    kernel.receive_until(lambda got: bool(kernel.of_type("status_reply")))

    for msg in [*kernel.of_type("heartbeat"), *kernel.of_type("status_reply")]:
        assert set(msg.body["memory"]) == {"rss"} and msg.body["memory"]["rss"] > 0
        assert check_body(msg.type, msg.body) == []
    (report,) = kernel.stderr()
    assert report.startswith("jupyter_shard: the heartbeat's memory probe failed on this rank")


def test_a_rank_beats_every_second_in_a_cell_and_every_five_between_cells(
    wired: tuple[Kernel, Channel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scaled down 10 times: between cells a beat each 0.5 s, in a cell each 0.1 s, and the first one
    within 0.1 s of the cell's start, whenever the last idle beat was (the kernel calls a running rank
    stuck after five intervals without one). At 1,024 ranks a beat a second each between cells cost
    the kernel 7% of a core."""
    monkeypatch.setattr(channel_module, "HEARTBEAT_INTERVAL", 0.1)
    monkeypatch.setattr(channel_module, "IDLE_HEARTBEAT_INTERVAL", 0.5)
    kernel, channel = wired
    busy = threading.Event()
    channel.busy = busy.is_set
    beats: list[tuple[float, bool]] = []

    def heartbeat() -> Outgoing:
        beats.append((time.monotonic(), busy.is_set()))
        body = {"executing": busy.is_set(), "cell": "", "running_for": 0.0, "memory": {}, "step": 0}
        return HEARTBEAT({**body, "collective": "", "group_ranks": [], "waiting": ""})  # type: ignore[typeddict-item]

    channel.heartbeat = heartbeat
    channel.start()
    time.sleep(0.15)  # just past the first (idle) beat: the next one is 0.5 s away
    began = time.monotonic()
    busy.set()
    time.sleep(1.0)
    busy.clear()
    ended = time.monotonic()
    time.sleep(1.6)
    first = min(t for t, b in beats if t >= began)
    assert first - began < 0.1 + 0.08, beats  # not at the idle beat 0.35 s later
    in_cell = [t for t, _ in beats if began <= t < ended]
    assert len(in_cell) >= 7, beats
    after = [t for t, _ in beats if t > ended + 0.2]  # the first beat after the cell may be a busy one
    assert 2 <= len(after) <= 4, beats
    kernel.receive_until(lambda got: len(got) >= len(beats) - 1, seconds=5.0)
    assert len(kernel.of_type("heartbeat")) >= len(beats) - 1
