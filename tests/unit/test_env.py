"""jupyter_shard.env: the rank environment is written and read back by one definition."""

from __future__ import annotations

import pytest

from jupyter_shard import env as env_module
from jupyter_shard.env import (
    CURVE,
    KEY,
    PER_RANK,
    SECRETS,
    RankEnv,
    pop_secrets,
    without_per_rank,
    without_pool_variables,
)


def _local() -> RankEnv:
    return RankEnv(
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        master_port=29512,
        key="ab" * 32,
        address="ipc:///tmp/pool.sock",
        max_frame=1 << 30,
        device="cpu",
        strategy="ddp",
        timeout=60.0,
        options={"precision": "32", "accumulate": 2},
        store="/tmp/pool/store",
        lifeline_fd=7,
        parent_pid=1234,
        log="/tmp/logs/rank-1.log",
    )


def test_a_local_rank_reads_back_what_the_kernel_wrote() -> None:
    orders = _local()
    written = orders.to_env()
    assert all(isinstance(v, str) for v in written.values())
    assert RankEnv.from_env(written) == orders


def test_the_variable_names_stay_as_ranks_and_scripts_know_them() -> None:
    written = _local().to_env()
    assert written["RANK"] == "1" and written["WORLD_SIZE"] == "2" and written["MASTER_ADDR"] == "127.0.0.1"
    assert written["JUPYTER_SHARD_KEY"] == "ab" * 32
    assert written["JUPYTER_SHARD_STORE"] == "/tmp/pool/store"
    assert written["JUPYTER_SHARD_LIFELINE_FD"] == "7"
    assert written["JUPYTER_SHARD_TIMEOUT"] == "60.0"
    assert written["JUPYTER_SHARD_OPTIONS"] == '{"precision": "32", "accumulate": 2}'
    assert "JUPYTER_SHARD_CURVE" not in written and "JUPYTER_SHARD_NODE" not in written


def test_a_rank_has_what_torchrun_gives_its_workers() -> None:
    orders = RankEnv(**{**_local().__dict__, "run_id": "pool-x", "error_file": "/tmp/logs/rank-1-error.json"})
    written = orders.to_env()
    assert {
        name: written[name] for name in written if name.startswith(("ROLE_", "GROUP_", "TORCHELASTIC_"))
    } == {
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": "1",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "pool-x",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": "/tmp/logs/rank-1-error.json",
    }
    assert RankEnv.from_env(written) == orders
    # a node agent (torchrun) sets every one of these itself
    assert not set(written) - set(PER_RANK) & {n for n in written if not n.startswith("JUPYTER_SHARD_")}


def test_a_rank_started_by_an_agent_reads_the_agents_variables() -> None:
    written = _local().to_env()
    written[CURVE] = "server client secret"
    agent = without_per_rank(written) | {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29400",
        "JUPYTER_SHARD_NODE": "3",
    }
    orders = RankEnv.from_env(agent)
    assert (orders.rank, orders.local_rank, orders.world_size, orders.master_addr) == (5, 1, 8, "node0")
    assert orders.store is None and orders.lifeline_fd is None and orders.log is None
    assert orders.curve == "server client secret"
    assert orders.node_index == 3
    assert RankEnv.from_env({k: v for k, v in agent.items() if k != env_module.NODE}).node_index == 1


def test_per_rank_variables_and_pool_variables_are_dropped() -> None:
    written = _local().to_env() | {"PATH": "/bin"}
    assert not set(PER_RANK) & set(without_per_rank(written))
    assert without_pool_variables(written) == {
        k: v for k, v in written.items() if not k.startswith("JUPYTER_SHARD_")
    }


def test_secrets_are_popped(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {KEY: "k", CURVE: "c", "PATH": "/bin"}
    pop_secrets(environ)
    assert environ == {"PATH": "/bin"}
    assert set(SECRETS) == {KEY, CURVE}
