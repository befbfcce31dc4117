"""Helpers shared by the launcher unit tests: specs, one-line SpecErrors, fake agents, rank launches."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.env import CURVE as CURVE_ENV
from jupyter_shard.env import KEY as KEY_ENV
from jupyter_shard.launchers import remote, resolve_spec
from jupyter_shard.launchers.base import RankLaunch
from jupyter_shard.launchers.remote import AgentProcess
from jupyter_shard.spec import LaunchSpec, SpecError
from jupyter_shard.wire.curve import CurveKeys

ELSEWHERE = "192.0.2.1"  # TEST-NET-1: never this machine, and resolving it needs no DNS


KEY = "0123456789abcdef0123456789abcdef"


def _curve_value() -> str:
    return CurveKeys.new().client_env()


def _spec(**kwargs: Any) -> LaunchSpec:
    kwargs.setdefault("gpu_count", 0)
    kwargs.setdefault("nproc", 1)
    return resolve_spec(**kwargs)


def _one_line(exc: pytest.ExceptionInfo[SpecError]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, "a SpecError is one line"
    return msg


def _lo_address() -> str:
    return remote._local_addresses()["lo"]


class _FakeProc:
    """Enough of Popen for AgentProcess: a pid, poll, signals and wait."""

    _next_pid = 4_000_000

    def __init__(self, code: int | None = None) -> None:
        _FakeProc._next_pid += 1
        self.pid = _FakeProc._next_pid
        self.returncode = code
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if self.returncode is None:
            self.returncode = -sig

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            raise subprocess.TimeoutExpired("fake", timeout or 0)
        return self.returncode


class _Spawned:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        node: int | None,
        host: str,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        cwd: Path,
        lifeline_fd: int,
        cancel: list[str] | tuple[str, ...] = (),
        stdin: bytes | None = None,
        pool_dir: Path | None = None,
    ) -> AgentProcess:
        self.calls.append(
            {
                "node": node,
                "host": host,
                "command": list(command),
                "env": dict(env),
                "log": log_path,
                "cwd": cwd,
                "cancel": list(cancel),
                "stdin": stdin,
                "pool_dir": pool_dir,
            }
        )
        return AgentProcess(node, host, _FakeProc(), log_path)  # type: ignore[arg-type]


def _rank_launches(tmp_path: Path, n: int) -> list[RankLaunch]:
    curve = _curve_value()
    launches = []
    for rank in range(n):
        env = {
            "PATH": os.environ["PATH"],
            KEY_ENV: KEY,
            CURVE_ENV: curve,
            "JUPYTER_SHARD_ADDRESS": "tcp://127.0.0.1:5555",
            "GLOO_SOCKET_IFNAME": "lo",
            "NCCL_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "JUPYTER_SHARD_LOG": str(tmp_path / f"rank-{rank}.log"),
        }
        launches.append(RankLaunch(rank, env, tmp_path / f"rank-{rank}.log", tmp_path))
    return launches
