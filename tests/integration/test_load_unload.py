"""``%unload_ext`` and ``%reload_ext jupyter_shard``: the pool is shut down and says so, every magic
is unregistered, nothing the extension started outlives the unload, and a reload works."""

from __future__ import annotations

from typing import Any

import psutil
import pytest

from tests.faults.conftest import wait_gone

pytestmark = pytest.mark.timeout(120)

CHILDREN = "import psutil\nsorted(p.pid for p in psutil.Process().children(recursive=True))"


def _children(kernel: Any) -> list[int]:
    run = kernel.execute(CHILDREN)
    assert run.ok, run.error_text()
    return [int(p) for p in run.data("execute_result")[0]["text/plain"].strip("[]").split(",") if p.strip()]


def test_unload_shuts_the_pool_down_unregisters_and_leaves_no_process(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nx = 1").ok
    started = _children(kernel)
    assert len(started) >= 3, "two ranks and the zygote"
    run = kernel.execute("%unload_ext jupyter_shard")
    assert run.ok, run.error_text()
    assert (
        run.stream()
        == "jupyter_shard: unloaded; the pool (2 CPU ranks · none) was shut down, rank state is lost\n"
    )
    wait_gone(started, within=2.0)
    assert _children(kernel) == []
    for magic in ("%%distributed\n1", "%%rank 0\n1", "%dist_status", "%dist_shutdown"):
        gone = kernel.execute(magic)
        assert not gone.ok and "not found" in gone.stream("stderr"), magic
    assert psutil.Process(kernel.pid).is_running()


def test_reload_gives_a_working_extension_and_no_unreachable_pool(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nx = 1").ok
    before = _children(kernel)
    run = kernel.execute("%reload_ext jupyter_shard")
    assert "the pool (2 CPU ranks · none) was shut down" in run.stream()
    wait_gone(before, within=2.0)
    again = kernel.execute(
        "%%distributed --nproc 2 --device cpu\nimport torch, torch.distributed as dist\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert again.data("execute_result") == [{"text/plain": "2.0"}]
    status = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    assert status.startswith("2 CPU ranks · none") and "idle" in status
    pids = {int(line.split()[1]) for line in status.splitlines()[4:6]}
    assert pids <= set(_children(kernel)), "the running ranks are the pool %dist_status sees"
    assert kernel.execute("%dist_shutdown").stream() == "jupyter_shard: pool shut down\n"
    kernel.execute("%unload_ext jupyter_shard")
    assert _children(kernel) == []
