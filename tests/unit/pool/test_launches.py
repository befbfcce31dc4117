"""Each rank's start: the pool's orders (a ``RankEnv``) and what any rank process needs around them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import jupyter_shard
from jupyter_shard._util.net import loopback_interface
from jupyter_shard.env import CHECK_PROTOCOL_VAR, RankEnv
from jupyter_shard.launchers import resolve_spec
from jupyter_shard.launchers.base import RankLaunch
from jupyter_shard.pool.launches import NCCL_KEEP_RANKS_ALIVE, rank_launch
from jupyter_shard.wire.curve import CurveKeys
from jupyter_shard.wire.protocol import MAX_FRAME

KEY = bytes(range(32))


def _launch(tmp_path: Path, rank: int = 1, nproc: int = 2, **kwargs: Any) -> RankLaunch:
    spec = resolve_spec(nproc=nproc, gpu_count=0)
    options: dict[str, Any] = {
        "address": "ipc:///pool/pool.sock",
        "key": KEY,
        "lifeline_fd": 17,
        "master_port": 29512,
        "curve": None,
        "pool_dir": tmp_path / "jupyter_shard-abcd1234",
        "log_dir": tmp_path / "logs",
        **kwargs,
    }
    return rank_launch(spec, rank, **options)


def test_a_local_rank_is_told_who_it_is_and_where_the_pool_is(tmp_path: Path) -> None:
    launch = _launch(tmp_path, direct="/pool/direct.sock")
    orders = RankEnv.from_env(launch.env)
    assert (orders.rank, orders.local_rank, orders.world_size, orders.local_world_size) == (1, 1, 2, 2)
    assert orders.key == KEY.hex() and orders.address == "ipc:///pool/pool.sock"
    assert orders.master_port == 29512 and orders.max_frame == MAX_FRAME
    assert orders.device == "cpu"
    assert orders.store == str(tmp_path / "jupyter_shard-abcd1234" / "store")
    assert orders.lifeline_fd == 17 and orders.parent_pid == os.getpid()
    assert orders.log == str(tmp_path / "logs" / "rank-1.log")
    assert orders.run_id == "jupyter_shard-abcd1234"
    assert orders.error_file == str(tmp_path / "logs" / "rank-1-error.json")
    assert orders.direct == "/pool/direct.sock"
    assert orders.curve is None and orders.rank_logs is None
    assert launch.rank == 1 and launch.log_path == tmp_path / "logs" / "rank-1.log"
    assert launch.cwd == Path.cwd() and launch.argv == []


def test_a_rank_started_by_an_agent_gets_curve_keys_and_the_log_directory(tmp_path: Path) -> None:
    curve = CurveKeys.new()
    orders = RankEnv.from_env(_launch(tmp_path, curve=curve).env)
    assert orders.curve == curve.client_env()
    assert orders.rank_logs == str(tmp_path / "logs")


def test_the_kernels_own_pool_variables_never_reach_a_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUPYTER_SHARD_KEY", "the kernel's own pool key")
    monkeypatch.setenv("JUPYTER_SHARD_DIRECT", "/elsewhere.sock")
    monkeypatch.setenv("KEEP_ME", "yes")
    monkeypatch.delenv(CHECK_PROTOCOL_VAR, raising=False)
    env = _launch(tmp_path).env
    assert env["JUPYTER_SHARD_KEY"] == KEY.hex()
    assert "JUPYTER_SHARD_DIRECT" not in env  # this launch has no direct links
    assert env["KEEP_ME"] == "yes"


def test_a_protocol_check_file_is_passed_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_PROTOCOL_VAR, str(tmp_path / "protocol.jsonl"))
    assert RankEnv.from_env(_launch(tmp_path).env).check_protocol == str(tmp_path / "protocol.jsonl")


def test_this_package_comes_first_on_the_path_and_the_users_path_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(Path(jupyter_shard.__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", "/user/lib")
    assert _launch(tmp_path).env["PYTHONPATH"] == os.pathsep.join([root, "/user/lib"])
    monkeypatch.delenv("PYTHONPATH")
    assert _launch(tmp_path).env["PYTHONPATH"] == root


def test_ranks_talk_over_loopback_and_write_unbuffered(tmp_path: Path) -> None:
    env = _launch(tmp_path).env
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == loopback_interface()
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TTY_COMPATIBLE"] == env["TTY_INTERACTIVE"] == "1"


def test_nccl_keeps_ranks_alive_unless_the_kernel_says_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in NCCL_KEEP_RANKS_ALIVE:
        monkeypatch.delenv(name, raising=False)
    env = _launch(tmp_path).env
    assert {name: env[name] for name in NCCL_KEEP_RANKS_ALIVE} == dict(NCCL_KEEP_RANKS_ALIVE)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    assert _launch(tmp_path).env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.mark.parametrize(
    ("cpus", "nproc", "threads"), [(8, 2, "4"), (8, 3, "2"), (2, 4, "1"), (None, 2, "1")]
)
def test_each_rank_gets_its_share_of_the_cpu_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int | None, nproc: int, threads: str
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert _launch(tmp_path, rank=0, nproc=nproc).env["OMP_NUM_THREADS"] == threads


def test_a_users_thread_count_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert _launch(tmp_path).env["OMP_NUM_THREADS"] == "7"
