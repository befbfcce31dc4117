"""jupyter_shard.rank.io_replies: what the I/O thread answers (stacks, status, signals, aborts) and
the collective the heartbeat names, with a stand-in channel and torch's fake process group.

(That the I/O loop goes on when the heartbeat's memory probe fails, through a real socket, is in
``tests/unit/rank/test_io.py``.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from jupyter_shard.rank import io_replies
from jupyter_shard.rank import shard as shard_module
from jupyter_shard.rank.io_replies import collective_and_group, current_collective, serve_io
from jupyter_shard.rank.runner import CellState
from jupyter_shard.wire.messages import check_body
from jupyter_shard.wire.protocol import Message

pytestmark = pytest.mark.timeout(30)


class FakeChannel:
    def __init__(self) -> None:
        self.io_handlers: dict[str, Any] = {}
        self.heartbeat: Any = None
        self.queued: list[tuple[str, dict[str, Any]]] = []
        self.reports: list[tuple[str, BaseException]] = []

    def enqueue(self, msg_type: str, body: Any, buffers: list[bytes]) -> None:
        assert check_body(msg_type, body) == [], body
        self.queued.append((msg_type, dict(body)))

    def enqueue_numbered(self, message: Any) -> None:
        self.enqueue(*message(len(self.queued) + 1), [])

    def report(self, what: str, exc: BaseException) -> None:
        self.reports.append((what, exc))


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeChannel, CellState]:
    monkeypatch.setattr(shard_module, "_current", None)
    channel, state = FakeChannel(), CellState()
    serve_io(channel, state)  # type: ignore[arg-type]
    return channel, state


def _ask(channel: FakeChannel, msg_type: str, **body: Any) -> None:
    channel.io_handlers[msg_type](Message(msg_type, body))


def test_stacks_name_each_thread_but_the_ranks_own(served: tuple[FakeChannel, CellState]) -> None:
    channel, _ = served
    release = threading.Event()

    def data_loader_worker() -> None:
        release.wait(10)

    threads = [
        threading.Thread(target=data_loader_worker, name="loader"),
        threading.Thread(target=release.wait, name="jupyter_shard-io"),
    ]
    for t in threads:
        t.start()
    try:
        _ask(channel, "stacks", req_id="s1")
    finally:
        release.set()
        for t in threads:
            t.join()
    ((msg_type, body),) = channel.queued
    assert msg_type == "stacks_reply" and body["req_id"] == "s1"
    by_thread = {s["thread"]: s["stack"] for s in body["stacks"]}
    assert "jupyter_shard-io" not in by_thread
    assert "test_stacks_name_each_thread_but_the_ranks_own" in by_thread["MainThread"]
    assert "data_loader_worker" in by_thread["loader"]


def test_status_and_heartbeat_say_what_the_main_thread_is_doing(
    served: tuple[FakeChannel, CellState],
) -> None:
    channel, state = served
    _ask(channel, "status", req_id="q")
    ((msg_type, idle),) = channel.queued
    assert msg_type == "status_reply" and idle["req_id"] == "q"
    assert (idle["executing"], idle["cell"], idle["running_for"], idle["step"]) == (False, "", 0.0, 0)
    assert idle["memory"]["rss"] > 0 and (idle["collective"], idle["group_ranks"]) == ("", [])

    state.begin("c7", "for step in range(10):\n    train()")
    state.started -= 5.0
    state.waiting = "Continue?"
    msg_type, busy = channel.heartbeat()
    assert msg_type == "heartbeat" and check_body(msg_type, busy) == []
    assert busy["executing"] is True and busy["cell"] == "for step in range(10):"
    assert 5.0 <= busy["running_for"] < 60 and busy["waiting"] == "Continue?"


def test_the_heartbeat_carries_the_ranks_step(
    served: tuple[FakeChannel, CellState], monkeypatch: pytest.MonkeyPatch
) -> None:
    channel, _ = served
    helper = SimpleNamespace(device=None, global_step=12)  # the rank's ``shard``, as the probe reads it
    monkeypatch.setattr(shard_module, "_current", helper)
    assert channel.heartbeat()[1]["step"] == 12


@pytest.fixture
def signals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    sent: list[tuple[str, int, int]] = []
    monkeypatch.setattr(io_replies.os, "kill", lambda pid, sig: sent.append(("kill", pid, sig)))
    monkeypatch.setattr(io_replies.os, "killpg", lambda pg, sig: sent.append(("killpg", pg, sig)))
    return sent


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_from_the_kernel_is_sent_to_this_process(
    served: tuple[FakeChannel, CellState], signals: list[tuple[str, int, int]], sig: int
) -> None:
    _ask(served[0], "signal", signal=int(sig))
    assert signals == [("kill", os.getpid(), sig)]


def test_sigkill_takes_the_ranks_whole_group_when_it_leads_it(
    served: tuple[FakeChannel, CellState],
    signals: list[tuple[str, int, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(io_replies.os, "getpgrp", os.getpid)
    _ask(served[0], "signal", signal=int(signal.SIGKILL))
    monkeypatch.setattr(io_replies.os, "getpgrp", lambda: os.getpid() + 1)
    _ask(served[0], "signal", signal=int(signal.SIGKILL))
    assert signals == [("killpg", os.getpid(), signal.SIGKILL), ("kill", os.getpid(), signal.SIGKILL)]


def test_any_other_signal_is_ignored(
    served: tuple[FakeChannel, CellState], signals: list[tuple[str, int, int]]
) -> None:
    _ask(served[0], "signal", signal=int(signal.SIGSTOP))
    _ask(served[0], "signal", signal=int(signal.SIGUSR1))
    assert signals == []


class FakeGroup:
    backend = "nccl"

    def __init__(self, steps: tuple[str, ...], result: bool | Exception = True) -> None:
        self.steps, self.result = steps, result
        self.asked: list[tuple[str, str]] = []
        self.aborted = threading.Event()

    def release_steps(self, backend: str, role: str) -> tuple[str, ...]:
        self.asked.append((backend, role))
        return self.steps

    def abort(self) -> bool:
        self.aborted.set()
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def _join_aborts() -> None:
    for t in threading.enumerate():
        if t.name == "jupyter_shard-abort":
            t.join(5)


def test_abort_aborts_a_group_whose_backend_frees_a_blocked_rank_that_way(
    served: tuple[FakeChannel, CellState], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    log = io.StringIO()
    monkeypatch.setattr(sys, "__stderr__", log)
    channel, state = served
    _ask(channel, "abort")  # no group yet: nothing to do
    group = FakeGroup(("abort",))
    state.group = group  # type: ignore[assignment]
    _ask(channel, "abort")
    assert group.aborted.wait(5)
    _join_aborts()
    assert group.asked == [("nccl", "blocked")]
    assert "aborted this rank's process group (NCCL) for the kernel" in log.getvalue()
    assert channel.queued == [] and channel.reports == []


def test_abort_does_nothing_where_the_backend_has_no_abort(served: tuple[FakeChannel, CellState]) -> None:
    channel, state = served
    group = FakeGroup(("close",))
    state.group = group  # type: ignore[assignment]
    _ask(channel, "abort")
    time.sleep(0.05)
    _join_aborts()
    assert not group.aborted.is_set() and group.asked == [("nccl", "blocked")]


def test_a_failed_abort_is_reported(served: tuple[FakeChannel, CellState]) -> None:
    channel, state = served
    failure = RuntimeError("ncclCommAbort failed")
    state.group = FakeGroup(("abort",), failure)  # type: ignore[assignment]
    _ask(channel, "abort")
    _join_aborts()
    assert channel.reports == [("aborting the process group", failure)]


@pytest.fixture
def fake_world() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _inside_all_reduce(
    monkeypatch: pytest.MonkeyPatch, group: Any, executing: bool
) -> tuple[str, list[int], str]:
    """What the heartbeat says while the main thread is inside ``dist.all_reduce(..., group=group)``."""
    c10d = dist.distributed_c10d
    seen: list[tuple[str, list[int], str]] = []
    original = c10d._check_single_tensor

    def probe(*args: Any, **kwargs: Any) -> Any:
        seen.append((*collective_and_group(executing), current_collective()))
        return original(*args, **kwargs)

    monkeypatch.setattr(c10d, "_check_single_tensor", probe)
    dist.all_reduce(torch.ones(2), group=group)
    monkeypatch.setattr(c10d, "_check_single_tensor", original)
    (found,) = seen
    return found


def test_the_collective_and_its_subgroup_are_read_from_the_main_threads_frames(
    fake_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = dist.new_group([0, 2])
    assert _inside_all_reduce(monkeypatch, sub, True) == ("all_reduce", [0, 2], "all_reduce")
    assert _inside_all_reduce(monkeypatch, None, True) == ("all_reduce", [], "all_reduce")
    world = dist.GroupMember.WORLD
    assert _inside_all_reduce(monkeypatch, world, True) == ("all_reduce", [], "all_reduce")
    assert _inside_all_reduce(monkeypatch, sub, False) == ("", [], "all_reduce"), "between cells: none"
    assert current_collective() == "" and collective_and_group(True) == ("", [])


# -- a long import is named, a quick one is not --------------------------------------------------------


def test_the_import_the_main_thread_is_in_is_the_outermost_one_of_code_outside_this_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main thread (this test's) imports a module that imports one that waits: the probe,
    from another thread, names the outer one, as the code wrote it."""
    (tmp_path / "js_probe_sync.py").write_text(
        "import threading\nSTARTED, RELEASE = threading.Event(), threading.Event()\n"
    )
    (tmp_path / "js_probe_outer.py").write_text("import js_probe_inner\n")
    (tmp_path / "js_probe_inner.py").write_text(
        "from js_probe_sync import STARTED, RELEASE\nSTARTED.set()\nRELEASE.wait(10)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import js_probe_sync

    seen: list[str] = []

    def probe() -> None:
        js_probe_sync.STARTED.wait(10)
        seen.append(io_replies.current_import())
        js_probe_sync.RELEASE.set()

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        import js_probe_outer  # noqa: F401
    finally:
        js_probe_sync.RELEASE.set()
        thread.join(10)
        for name in ("js_probe_sync", "js_probe_outer", "js_probe_inner"):
            sys.modules.pop(name, None)
    assert seen == ["js_probe_outer"]
    assert io_replies.current_import() == ""  # not importing now


def test_only_an_import_that_lasts_is_named_in_the_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(io_replies.time, "monotonic", lambda: now[0])
    current = ["IPython.core.application"]
    watch = io_replies.ImportWatch(lambda: current[0])
    watch.sample()
    now[0] += 0.05
    assert watch.long() == ""  # a quick lazy import, as a cell's first lines make
    current[0] = ""
    watch.sample()
    current[0] = "transformers"
    watch.sample()
    now[0] += io_replies.LONG_IMPORT - 0.01
    assert watch.long() == ""
    now[0] += 0.02
    assert watch.long() == "transformers"
    current[0] = ""
    assert watch.long() == ""
