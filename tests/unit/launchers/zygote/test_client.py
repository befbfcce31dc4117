"""jupyter_shard.launchers.zygote.client: which zygote serves a rank."""

from __future__ import annotations

import pytest

from jupyter_shard.launchers.zygote.client import interpreter_key


def test_one_zygote_serves_every_rank_and_pool_of_an_interpreter() -> None:
    base = {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/src",
        "OMP_NUM_THREADS": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }

    def rank(k: int, pool: str) -> dict[str, str]:
        return base | {
            "RANK": str(k),
            "TORCHELASTIC_RUN_ID": pool,
            "TORCHELASTIC_ERROR_FILE": f"/logs/{pool}/rank-{k}-error.json",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }

    keys = {interpreter_key(rank(k, pool)) for k in range(4) for pool in ("pool-a", "pool-b")}
    assert keys == {(("PYTHONPATH", "/src"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))}
    assert interpreter_key(base | {"LD_PRELOAD": "x.so"}) != interpreter_key(base)


@pytest.mark.parametrize(
    "name", ["TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CXX", "INDUCTOR_TEST_FLAG", "AOT_INDUCTOR_DEBUG"]
)
def test_a_setting_the_zygotes_compiler_imports_read_needs_another_zygote(name: str) -> None:
    """The zygote imports torch._dynamo, whose import reads these: a rank forked from a zygote that
    read another value would not see the user's."""
    base = {"PYTHONPATH": "/src"}
    assert interpreter_key(base | {name: "x"}) != interpreter_key(base)


def test_which_gpus_a_rank_uses_does_not_need_another_zygote() -> None:
    base = {"PYTHONPATH": "/src", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert interpreter_key(base | {"CUDA_VISIBLE_DEVICES": "0,1"}) == interpreter_key(
        base | {"CUDA_VISIBLE_DEVICES": "2,3"}
    )
    assert interpreter_key(base | {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) != interpreter_key(base)
