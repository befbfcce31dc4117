"""jupyter_shard.launchers.tether: the tether as a real process, started by remote.tether_argv."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_shard.launchers.base import KEPT_RECORD
from jupyter_shard.launchers.remote import tether_argv

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _catches_sigterm(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & SIGTERM_BIT)
    except OSError:
        pass
    return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _until(check: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


class _Tether:
    def __init__(
        self, command: list[str], cancel: list[str] | tuple[str, ...] = (), pool_dir: Path | None = None
    ) -> None:
        read, self.write = os.pipe()
        self.proc = subprocess.Popen(
            tether_argv(read, command, cancel, pool_dir), pass_fds=(read,), stderr=subprocess.PIPE
        )
        os.close(read)

    def children(self) -> list[psutil.Process]:
        """The command and everything it started, once the tether watches for signals."""
        found: list[psutil.Process] = []

        def ready() -> bool:
            nonlocal found
            with_children = psutil.Process(self.proc.pid).children(recursive=True)
            found = with_children
            return bool(with_children) and _catches_sigterm(self.proc.pid)

        assert _until(ready), "the tether did not start its command"
        return found

    def close(self) -> None:
        if self.write >= 0:
            os.close(self.write)
            self.write = -1


@pytest.fixture
def tethers() -> Iterator[list[_Tether]]:
    started: list[_Tether] = []
    yield started
    for t in started:
        t.close()
        if t.proc.poll() is None:
            t.proc.kill()
        t.proc.wait(5)
        if t.proc.stderr is not None:
            t.proc.stderr.close()


def test_tether_exits_with_the_commands_status(tethers: list[_Tether]) -> None:
    t = _Tether(["sh", "-c", "exit 3"])
    tethers.append(t)
    assert t.proc.wait(5) == 3


def test_tether_reports_a_signal_as_a_shell_does(tethers: list[_Tether]) -> None:
    t = _Tether(["sh", "-c", "kill -9 $$"])
    tethers.append(t)
    assert t.proc.wait(5) == 128 + signal.SIGKILL


def test_tether_when_the_kernel_is_gone_cancels_and_kills_the_process_group(
    tmp_path: Path, tethers: list[_Tether]
) -> None:
    marker = tmp_path / "cancelled"
    t = _Tether(["sh", "-c", "sleep 60 & wait"], cancel=["touch", str(marker)])
    tethers.append(t)
    t.children()
    procs = _until_children(t, 2)
    assert len(procs) == 2, "sh and its background sleep"
    t.close()  # the kernel's end of the lifeline
    assert t.proc.wait(5) == 128 + signal.SIGTERM
    assert marker.exists(), "the --cancel command did not run"
    assert all(_until(lambda p=p: _gone(p.pid), 3.0) for p in procs), "a process of the group outlived it"
    assert t.proc.stderr is not None
    assert b"the kernel is gone" in t.proc.stderr.read()


def _until_children(t: _Tether, n: int) -> list[psutil.Process]:
    _until(lambda: len(psutil.Process(t.proc.pid).children(recursive=True)) >= n)
    return psutil.Process(t.proc.pid).children(recursive=True)


def test_tether_sigterm_stops_the_command_and_exits(tmp_path: Path, tethers: list[_Tether]) -> None:
    marker = tmp_path / "cancelled"
    t = _Tether(["sleep", "60"], cancel=["touch", str(marker)])
    tethers.append(t)
    (child,) = t.children()
    t.proc.send_signal(signal.SIGTERM)
    assert t.proc.wait(5) == 128 + signal.SIGTERM
    assert _until(lambda: _gone(child.pid), 3.0)
    assert marker.exists()


def test_tether_without_a_command_is_a_usage_error() -> None:
    read, write = os.pipe()
    try:
        done = subprocess.run(
            tether_argv(read, []), pass_fds=(read,), capture_output=True, timeout=10, check=False
        )
    finally:
        os.close(read)
        os.close(write)
    assert done.returncode == 2 and b"no command given" in done.stderr


def _record(pool_dir: Path, keep: float) -> Path:
    """A kept pool's record as the kernel writes it: this process is the owner."""
    path = pool_dir / KEPT_RECORD
    owner = [os.getpid(), psutil.Process().create_time()]
    path.write_text(json.dumps({"keep": keep, "owner": owner, "orphaned_at": None}))
    return path


@dataclass
class _Orphaned:
    """A kept pool's agent (``sleep``) under a tether whose kernel has gone."""

    tether: _Tether
    agent: psutil.Process
    pool_dir: Path
    record: Path
    cancelled: Path


def _orphaned(tmp_path: Path, tethers: list[_Tether]) -> _Orphaned:
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    record = _record(pool_dir, 60)
    marker = tmp_path / "cancelled"
    t = _Tether(["sleep", "60"], cancel=["touch", str(marker)], pool_dir=pool_dir)
    tethers.append(t)
    (child,) = t.children()
    t.close()  # the kernel's end of the lifeline
    assert _until(lambda: json.loads(record.read_text())["owner"] is None)
    return _Orphaned(t, child, pool_dir, record, marker)


def test_a_kept_pools_agent_outlives_the_kernel_and_its_end_removes_the_pool_directory(
    tmp_path: Path, tethers: list[_Tether]
) -> None:
    went = time.time()
    o = _orphaned(tmp_path, tethers)
    assert json.loads(o.record.read_text())["orphaned_at"] >= went  # %dist_pools counts from here
    time.sleep(0.5)
    assert o.tether.proc.poll() is None and not _gone(o.agent.pid), "the kept pool's agent was stopped"
    assert not o.cancelled.exists(), "a kept pool's job was cancelled"
    o.agent.kill()  # its ranks' lease ran out: the agent ends with them
    assert o.tether.proc.wait(5) == 128 + signal.SIGKILL
    assert not o.pool_dir.exists(), "the pool's directory (its record, with the key) was left behind"


def test_a_record_that_says_keep_0_or_is_gone_stops_the_agent_with_the_kernel(
    tmp_path: Path, tethers: list[_Tether]
) -> None:
    for keep in (0.0, None):
        pool_dir = tmp_path / f"pool-{keep}"
        pool_dir.mkdir()
        if keep is not None:
            _record(pool_dir, keep)
        t = _Tether(["sleep", "60"], pool_dir=pool_dir)
        tethers.append(t)
        (child,) = t.children()
        t.close()
        assert t.proc.wait(5) == 128 + signal.SIGTERM
        assert _until(lambda child=child: _gone(child.pid), 3.0)


def test_a_kept_pools_agent_stops_on_sigterm_from_a_kernel_that_attached(
    tmp_path: Path, tethers: list[_Tether]
) -> None:
    o = _orphaned(tmp_path, tethers)
    o.tether.proc.send_signal(signal.SIGTERM)  # AdoptedAgent.stop, from the kernel that attached
    assert o.tether.proc.wait(5) == 128 + signal.SIGTERM
    assert _until(lambda: _gone(o.agent.pid), 3.0) and o.cancelled.exists()
