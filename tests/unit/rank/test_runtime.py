"""jupyter_shard.rank.runtime: a rank's start-up, with the sockets, threads and the group faked.

``main`` is run in this process with stand-ins for the channel, the shell socket and the watchers,
and ``os._exit`` turned into ``SystemExit``: what is checked is what it reads, wires and reports.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard import env as env_module
from jupyter_shard.env import RankEnv
from jupyter_shard.rank import runtime
from jupyter_shard.rank.output import RankStream
from jupyter_shard.wire.protocol import io_identity, rank_identity

KEY = "ab" * 32
BASE = RankEnv(
    rank=2,
    local_rank=2,
    world_size=4,
    local_world_size=4,
    master_port=29500,
    key=KEY,
    address="ipc:///tmp/pool/socket",
    max_frame=1 << 30,
    device="cpu",
    strategy="none",
    timeout=60.0,
)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []


class FakeChannel:
    def __init__(self, events: Events, *args: Any) -> None:
        self.events = events
        self.args = args
        self.flushers: list[Any] = []
        self.io_handlers: dict[str, Any] = {}
        self.heartbeat: Any = None
        self.queued: list[tuple[str, Any, list[bytes]]] = []
        events.seen.append(("channel", *args[1:]))

    def enqueue(self, msg_type: str, body: Any, buffers: list[bytes]) -> None:
        self.queued.append((msg_type, body, buffers))

    def start(self) -> None:
        self.events.seen.append(("channel started",))

    def close(self) -> None:
        self.events.seen.append(("channel closed",))


class FakeShellSocket:
    def __init__(self, events: Events, *args: Any) -> None:
        self.events = events
        events.seen.append(("shell socket", *args[1:]))

    def connect_direct(self, path: str) -> None:
        self.events.seen.append(("direct", path))

    def monitor(self) -> str:
        return "monitor-socket"

    def send(self, msg_type: str, body: Any) -> None:
        self.events.seen.append(("send", msg_type, body))


class Exited(Exception):
    pass


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[Events]:
    events = Events()
    monkeypatch.setattr(runtime, "Channel", lambda *a: FakeChannel(events, *a))
    monkeypatch.setattr(runtime, "ShellSocket", lambda *a: FakeShellSocket(events, *a))
    monkeypatch.setattr(runtime, "watch_owner", lambda *a: events.seen.append(("lifeline", *a)))
    monkeypatch.setattr(runtime, "watch_kernel", lambda *a: events.seen.append(("watch kernel", *a)))
    monkeypatch.setattr(runtime, "_log_to_own_file", lambda path: events.seen.append(("own log", path)))
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(runtime.os, "_exit", exit_)
    for name in ("stdout", "stderr", "argv"):
        monkeypatch.setattr(sys, name, getattr(sys, name))
    yield events


def _environ(monkeypatch: pytest.MonkeyPatch, env: RankEnv) -> None:
    for name in (*env_module.SECRETS, env_module.DIRECT, env_module.LIFELINE_FD, env_module.LOG):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.to_env().items():
        monkeypatch.setenv(name, value)


class FakeRunner:
    def __init__(self, events: Events) -> None:
        self.events = events

    def loop(self) -> None:
        self.events.seen.append(("loop",))


def test_a_local_rank_wires_its_links_hides_the_key_and_runs_its_loop(
    started: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dataclasses.replace(BASE, direct="/tmp/pool/direct", lifeline_fd=9, parent_pid=4321, log="/l/r.log")
    _environ(monkeypatch, env)
    channels: list[FakeChannel] = []

    def start_up(read: RankEnv, channel: FakeChannel, sock: FakeShellSocket, state: Any) -> FakeRunner:
        assert env_module.KEY not in os.environ, "the key is gone before any cell can run"
        assert read.rank == 2 and read.key == KEY
        channels.append(channel)
        return FakeRunner(started)

    monkeypatch.setattr(runtime, "_start_up", start_up)
    runtime.main()

    key = bytes.fromhex(KEY)
    assert started.seen == [
        ("channel", env.address, key, io_identity(2), None),
        ("shell socket", env.address, key, rank_identity(2), None),
        ("direct", "/tmp/pool/direct"),
        ("lifeline", 9, 4321, "monitor-socket", 2),
        ("channel started",),
        ("loop",),
    ]
    (channel,) = channels
    assert isinstance(sys.stdout, RankStream) and isinstance(sys.stderr, RankStream)
    assert channel.flushers == [sys.stdout.flush, sys.stderr.flush]
    assert set(channel.io_handlers) >= {"stacks", "status"} and channel.heartbeat is not None
    assert sys.argv == [""]


def test_a_rank_started_by_an_agent_logs_to_its_own_file_and_watches_the_kernel(
    started: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dataclasses.replace(BASE, curve="client-keys", rank_logs="/logs/pool")
    _environ(monkeypatch, env)
    monkeypatch.setattr(runtime, "_start_up", lambda *a: FakeRunner(started))
    runtime.main()
    assert started.seen[0] == ("own log", "/logs/pool/rank-2.log")
    assert started.seen[1][-1] == "client-keys" and started.seen[2][-1] == "client-keys"
    assert ("watch kernel", "monitor-socket", os.getppid(), 2) in started.seen
    assert not [e for e in started.seen if e[0] in ("lifeline", "direct")]
    assert env_module.CURVE not in os.environ


def test_a_failed_start_up_is_reported_with_its_traceback_and_the_rank_exits(
    started: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    _environ(monkeypatch, dataclasses.replace(BASE, lifeline_fd=9))

    def start_up(*args: Any) -> FakeRunner:
        raise RuntimeError("no CUDA device visible")

    monkeypatch.setattr(runtime, "_start_up", start_up)
    with pytest.raises(Exited) as info:
        runtime.main()
    assert info.value.args == (1,)
    assert started.seen[-2] == ("channel closed",), "the traceback's output goes first"
    kind, msg_type, body = started.seen[-1]
    assert (kind, msg_type, body["rank"]) == ("send", "startup_failed", 2)
    assert body["traceback"].startswith("Traceback (most recent call last):")
    assert body["traceback"].rstrip().endswith("RuntimeError: no CUDA device visible")
    assert ("loop",) not in started.seen


@pytest.mark.parametrize(
    ("log", "rank_logs", "expected"),
    [
        ("/pool/rank-2.log", "/elsewhere", "/pool/rank-2.log"),
        (None, "/logs", "/logs/rank-2.log"),
        (None, None, "./rank-2.log"),
    ],
)
def test_the_log_path(log: str | None, rank_logs: str | None, expected: str) -> None:
    assert runtime._log_path(dataclasses.replace(BASE, log=log, rank_logs=rank_logs)) == expected


def test_a_rank_of_an_agent_sends_its_native_output_to_its_own_private_log(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "rank-0.log"
    path.parent.mkdir()
    path.write_text("earlier\n")
    saved = os.dup(1), os.dup(2)
    try:
        runtime._log_to_own_file(str(path))
        os.write(1, b"native stdout\n")
        os.write(2, b"native stderr\n")
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    assert path.read_text() == "earlier\nnative stdout\nnative stderr\n", "appended, both streams"
    fresh = tmp_path / "new" / "rank-1.log"
    saved = os.dup(1), os.dup(2)
    try:
        runtime._log_to_own_file(str(fresh))
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    assert stat.S_IMODE(fresh.parent.stat().st_mode) & 0o077 == 0
