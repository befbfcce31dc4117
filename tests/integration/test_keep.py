"""Kept pools (``--keep``): the ranks and their state outlive a killed or restarted kernel, another
kernel of the same user attaches to them (``%dist_pools``, ``%dist_attach``), a kernel holding the
pool is refused unless taken over, and ``python -m jupyter_shard pools | stop`` work from a terminal.
Every test has its own runtime directory, so it sees only its own kept pools."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.env import RUNTIME_DIR_VAR
from tests.faults.conftest import alive

pytestmark = pytest.mark.timeout(240)

SETUP = """%%distributed --nproc 2 --device cpu --strategy ddp --keep 2m
import os
import torch, torch.distributed as dist
torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
model, opt = shard.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
x = 41
for step in range(3):
    loss = model(torch.ones(2, 4)).pow(2).sum()
    shard.backward(loss)
    shard.step()
    shard.log(loss=loss)
print("pid", os.getpid())"""
# A cell that needs the kept namespace, the prepared model and a working process group.
CHECK = """%%distributed
t = torch.ones(1)
dist.all_reduce(t)
print("kept", x + 1, int(t.item()), shard.global_step, type(model).__name__)"""


@pytest.fixture
def runtime(kept_runtime: Path) -> Path:
    return kept_runtime


def _cli(command: str, runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, RUNTIME_DIR_VAR: str(runtime)}
    argv = [sys.executable, "-m", "jupyter_shard", command, *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def _rank_pids(run: Any) -> list[int]:
    return sorted(int(p) for p in re.findall(r"\] pid (\d+)", run.stream()))


def _kept(kernel: Any) -> list[int]:
    assert kernel.execute("%load_ext jupyter_shard").ok
    run = kernel.execute(SETUP)
    assert run.ok, run.error_text()
    pids = _rank_pids(run)
    assert len(pids) == 2
    return pids


def _check(kernel: Any) -> None:
    run = kernel.execute(CHECK)
    assert run.ok, run.error_text()
    lines = sorted(line for line in run.stream().splitlines() if line.startswith("[rank"))
    assert lines == [f"[rank {r}] kept 42 2 3 DistributedDataParallel" for r in (0, 1)]


def test_a_kept_pool_outlives_a_killed_kernel_and_another_kernel_attaches(
    runtime: Path, kernel_factory: Any
) -> None:
    first = kernel_factory()
    pids = _kept(first)
    os.kill(first.pid, signal.SIGKILL)
    time.sleep(1.5)
    assert alive(pids) == pids  # the ranks live on

    second = kernel_factory()
    assert second.execute("%load_ext jupyter_shard").ok
    run = second.execute("%dist_pools")
    assert run.ok
    rows = run.stream().splitlines()
    assert rows[0].split()[:4] == ["id", "ranks", "strategy", "device"]
    assert rows[1].split()[1:4] == ["2", "ddp", "cpu"] and "none" in rows[1]  # no kernel holds it
    run = second.execute("%dist_attach")
    assert run.ok, run.error_text()
    seconds = float(re.search(r"attached to .* in ([\d.]+) s", run.stream()).group(1))  # type: ignore[union-attr]
    assert seconds < 1.0, run.stream()
    _check(second)
    run = second.execute("import jupyter_shard\nlen(jupyter_shard.history())")
    assert run.data("execute_result")[0]["text/plain"] == "6"  # the dashboard's history came back
    run = second.execute("%%distributed\nprint('pid', os.getpid())")
    assert _rank_pids(run) == pids


def test_a_restarted_kernel_attaches_to_the_pool_it_kept(runtime: Path, kernel_factory: Any) -> None:
    kernel = kernel_factory()
    pids = _kept(kernel)
    kernel.km.restart_kernel(now=False)
    kernel.kc.wait_for_ready(timeout=60)
    assert alive(pids) == pids
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%dist_attach").ok
    _check(kernel)


def test_a_held_pool_is_refused_unless_taken_over(runtime: Path, kernel_factory: Any) -> None:
    owner = kernel_factory()
    pids = _kept(owner)
    other = kernel_factory()
    assert other.execute("%load_ext jupyter_shard").ok
    run = other.execute("%dist_attach")
    text = str(run.outputs)
    assert f"is attached to kernel pid {owner.pid}" in text and "--take-over" in text, text
    run = other.execute("%dist_attach --take-over")
    assert run.ok, run.outputs
    _check(other)
    # the first kernel let go: its next cell starts a pool of its own, and says why
    run = owner.execute("%%distributed\nimport os\nprint('pid', os.getpid())")
    assert run.ok, run.error_text()
    assert f"kernel pid {other.pid} took the kept pool over" in run.stream()
    assert not set(_rank_pids(run)) & set(pids)


def test_the_terminal_lists_and_stops_kept_pools(runtime: Path, kernel_factory: Any) -> None:
    kernel = kernel_factory()
    pids = _kept(kernel)
    listed = _cli("pools", runtime)
    assert listed.returncode == 0, listed.stderr
    pool_id = listed.stdout.splitlines()[1].split()[0]
    assert f"kernel pid {kernel.pid}" in listed.stdout
    refused = _cli("stop", runtime, pool_id)
    assert refused.returncode == 1 and f"attached to kernel pid {kernel.pid}" in refused.stderr
    done = _cli("stop", runtime, pool_id, "--force")
    assert done.returncode == 0 and f"stopped kept pool {pool_id}" in done.stdout
    deadline = time.monotonic() + 5
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(pids) == [] and not list(runtime.glob("jupyter_shard-*"))
    assert "no kept pools" in _cli("pools", runtime).stdout


def test_a_background_cell_left_running_follows_the_pool_to_the_next_kernel(
    runtime: Path, kernel_factory: Any
) -> None:
    first = kernel_factory()
    assert first.execute("%load_ext jupyter_shard").ok
    run = first.execute(
        "%%distributed --nproc 2 --device cpu --keep 2m --bg\nimport time\n"
        "for i in range(40):\n    time.sleep(0.1)\n    print('tick', i, flush=True)\nshard.rank + 100"
    )
    assert run.ok, run.error_text()
    time.sleep(1.0)
    os.kill(first.pid, signal.SIGKILL)
    second = kernel_factory()
    assert second.execute("%load_ext jupyter_shard").ok
    run = second.execute("%dist_attach")
    assert run.ok, run.error_text()
    assert "rank 0-1 still run a background cell" in run.stream()
    done = second.execute("%dist_wait")
    assert done.ok, done.error_text()
    assert done.data("execute_result")[0]["text/plain"] == "[rank 0] 100\n[rank 1] 101"
    ticks = [m for _, m in second.messages if m["msg_type"] == "stream" and "tick 39" in m["content"]["text"]]
    assert ticks, "the background cell's output did not reach the new kernel"
    run = second.execute("%%distributed\nprint('after', i)")
    assert sorted(line for line in run.stream().splitlines() if line.startswith("[rank")) == [
        "[rank 0] after 39",
        "[rank 1] after 39",
    ]
