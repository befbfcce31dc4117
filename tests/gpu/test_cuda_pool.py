"""GPU ranks: one pinned CUDA device per rank, NCCL all-reduce, CUDA memory in status and shard.memory();
what the pool does on NCCL: interrupts that keep state, a slow collective that kills nobody, values
that come back without a CUDA context in the kernel, a rank that still answers after a device-side
assert.

Skipped where no CUDA device is visible; run with ``pytest -m gpu`` on a GPU machine (``make gpu-check``).
Tests that need two devices say so when skipped.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.rank.channel import IDLE_HEARTBEAT_INTERVAL
from jupyter_shard.spec import visible_gpus
from tests.gpu.marks import gpu_module, requires_gpus

pytestmark = gpu_module(timeout=300)


def test_nccl_pool_pins_one_device_per_rank(tmp_path: Path) -> None:
    from jupyter_shard import Pool
    from jupyter_shard.pool.output import ConsoleSink

    n = visible_gpus()
    with Pool(
        nproc=n,
        device="cuda",
        strategy="ddp",
        log_dir=tmp_path,
        sink=ConsoleSink(io.StringIO(), io.StringIO()),
    ) as pool:
        result = pool.run(
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1, device=shard.device) * (shard.rank + 1)\n"
            "dist.all_reduce(t)\n"
            "(dist.get_backend(), torch.cuda.current_device(), str(shard.device), t.item())"
        )
        expected_sum = float(sum(range(1, n + 1)))
        for rank, r in result.ranks.items():
            # The group is device-mapped (NCCL for CUDA tensors, gloo for CPU ones), and torch's
            # get_backend() names the whole mapping, as it does for a torchrun script that asks for it.
            backend = "cpu:gloo,cuda:nccl"
            assert r.result == {"text/plain": f"('{backend}', {rank}, 'cuda:{rank}', {expected_sum})"}
        # CPU tensors take part in collectives too (FSDP's offloaded gradients, a grad scaler's state)
        cpu = pool.run("c = torch.ones(1) * (shard.rank + 1)\ndist.all_reduce(c)\nc.item()")
        assert cpu.value == {"text/plain": str(expected_sum)}
        pool.run("x = torch.zeros(1024, 1024, device=shard.device); m = shard.memory()")
        memory = pool.pull("m")
        assert memory["cuda_allocated"] >= 4 * 1024 * 1024
        assert all("cuda_allocated" in row.memory for row in pool.status())


# Each rank draws its batches from a generator seeded with its rank, on the CPU, so the test can
# draw the same ones.
DDP_STEPS = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
model, opt = shard.prepare(model, opt)
data = torch.Generator().manual_seed(shard.rank)
for _ in range(5):
    loss = model(torch.randn(32, 16, generator=data).to(shard.device)).pow(2).mean()
    shard.backward(loss); shard.step(); shard.log(loss=loss)
checksum = float(sum(p.detach().sum() for p in model.parameters()))
"""


def _ddp_reference(world_size: int) -> float:
    """The checksum ``DDP_STEPS`` must reach, computed here on the CPU without DDP: the gradient DDP
    averages over ranks is the gradient of the mean loss over all ranks' batches (equal sizes)."""
    import torch

    with torch.random.fork_rng(devices=[]):  # no CUDA here: the kernel side never creates a context
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    generators = [torch.Generator().manual_seed(rank) for rank in range(world_size)]
    for _ in range(5):
        batch = torch.cat([torch.randn(32, 16, generator=g) for g in generators])
        loss = model(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(sum(p.detach().sum() for p in model.parameters()))


def test_ddp_training_step_on_gpu(tmp_path: Path) -> None:
    from jupyter_shard import Pool
    from jupyter_shard.pool.output import ConsoleSink

    n = visible_gpus()
    with Pool(
        nproc=n,
        device="cuda",
        strategy="ddp",
        log_dir=tmp_path,
        sink=ConsoleSink(io.StringIO(), io.StringIO()),
    ) as pool:
        pool.run(DDP_STEPS)
        sums = pool.pull_all("checksum")
    assert len(set(sums.values())) == 1  # the replicas agree (with one GPU, trivially) ...
    # ... and agree with the same five Adam steps taken here (five steps move the sum by up to 0.85;
    # the GPU's float32 kernels differ from the CPU's by far less than the tolerance)
    assert sums[0] == pytest.approx(_ddp_reference(n), rel=1e-4, abs=1e-4)


def _until(done: Any, seconds: float, what: str) -> None:
    """Wait for ``done()`` (polled every 0.1 s) at most ``seconds``; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {seconds:g} s")
        time.sleep(0.1)


def test_dashboard_shows_cuda_memory_from_heartbeats(tmp_path: Path) -> None:
    from jupyter_shard import Pool
    from jupyter_shard.notebook.dashboard import render
    from jupyter_shard.pool.output import ConsoleSink

    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(nproc=1, device="cuda", log_dir=tmp_path, sink=sink) as pool:
        pool.run("import torch\nx = torch.zeros(64, 1024, 1024, device=shard.device)")  # 256 MiB
        # a short cell sends no beat of its own: the next idle one, within IDLE_HEARTBEAT_INTERVAL
        _until(
            lambda: pool.activity()[0].memory.get("cuda_allocated", 0) >= 256 * 2**20,
            IDLE_HEARTBEAT_INTERVAL + 3,
            "heartbeat with the 256 MiB allocated",
        )
        (row,) = pool.activity()
        assert row.memory["cuda_allocated"] >= 256 * 2**20
        assert row.memory["cuda_total"] >= row.memory["cuda_free"] > 0
        markup = render(pool, compact=False)
        assert "memory per rank: CUDA allocated, MiB" in markup and "cuda 256 / " in markup


def _quiet_sink() -> ConsoleSink:
    return ConsoleSink(io.StringIO(), io.StringIO())


_SETUP = """
import os, torch, torch.distributed as dist
kept = os.getpid()
steps = 0
weights = {k: v.cpu() for k, v in torch.nn.Linear(512, 512).state_dict().items()}
"""

# Prepared afresh each time: after an interrupt that had to abort the group, the model prepared
# before holds the old one.
_TRAIN = """
model = torch.nn.Linear(512, 512).to(shard.device)
model.load_state_dict(weights)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
model, opt = shard.prepare(model, opt)
while True:
    loss = model(torch.randn(256, 512, device=shard.device)).pow(2).mean()
    shard.backward(loss)
    shard.step()
    steps += 1
    if steps % 7 == 0:
        loss.item()  # a host-device sync, where an interrupt often lands
"""

_CHECK = """
model = torch.nn.Linear(512, 512).to(shard.device)
model.load_state_dict(weights)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
model, opt = shard.prepare(model, opt)
for _ in range(3):
    loss = model(torch.randn(8, 512, device=shard.device)).pow(2).mean()
    shard.backward(loss)
    shard.step()
checksum = float(sum(p.detach().sum() for p in model.parameters()))
"""


@requires_gpus(2)
@pytest.mark.timeout(1200)
def test_interrupting_a_ddp_loop_at_20_random_points_keeps_every_rank_and_its_state(tmp_path: Path) -> None:
    from jupyter_shard import DistributedError, Pool

    rng = random.Random(18)
    notices: list[str] = []
    with Pool(nproc=2, device="cuda", strategy="ddp", log_dir=tmp_path, sink=_quiet_sink()) as pool:
        pool.on_notice = notices.append
        pool.run(_SETUP)
        pids = {row.rank: row.pid for row in pool.status()}
        for point in range(20):
            run = pool.run_background(_TRAIN)
            time.sleep(rng.uniform(0.3, 4.0))
            pool.interrupt()
            started = time.monotonic()
            with pytest.raises(DistributedError):
                run.wait(30)
            assert time.monotonic() - started < 10, f"interrupt {point} took too long; notices: {notices}"
            assert not any("killed rank" in n for n in notices), notices
        # A collective the last interrupt left pending is released here; the next cell regroups.
        with contextlib.suppress(DistributedError):
            pool.run("torch.cuda.synchronize()\ndist.barrier()", timeout=30)
        pool.run(_CHECK, timeout=120)
        sums = pool.pull_all("checksum")
        assert len(set(sums.values())) == 1  # DDP kept the ranks in step
        assert {row.rank: row.pid for row in pool.status()} == pids  # no rank was killed or restarted
        assert pool.pull_all("kept") == pids and all(s > 0 for s in pool.pull_all("steps").values())


@requires_gpus(2)
@pytest.mark.timeout(400)
def test_a_barrier_that_waits_longer_than_the_collective_timeout_kills_no_rank(tmp_path: Path) -> None:
    from jupyter_shard import Pool

    notices: list[str] = []
    # Rank 0 "writes a checkpoint" for 90 s while the other waits in barrier(), past the 60 s
    # collective timeout: NCCL's watchdog only records it (TORCH_NCCL_ASYNC_ERROR_HANDLING=0).
    with Pool(nproc=2, device="cuda", timeout=60.0, log_dir=tmp_path, sink=_quiet_sink()) as pool:
        pool.on_notice = notices.append
        pids = {row.rank: row.pid for row in pool.status()}
        result = pool.run(
            "import time, torch, torch.distributed as dist\n"
            "if shard.rank == 0:\n"
            "    time.sleep(90)\n"
            "dist.barrier()\n"
            "'past the barrier'"
        )
        assert result.ok and result.value == {"text/plain": "'past the barrier'"}
        after = pool.run("t = torch.ones(1, device=shard.device)\ndist.all_reduce(t)\nt.item()")
        assert after.value == {"text/plain": "2.0"}
        assert {row.rank: row.pid for row in pool.status()} == pids
        assert not any("rebuilt the process group" in n or "restart" in n for n in notices), notices


# The kernel, in a fresh interpreter: this test process may have touched CUDA elsewhere.
_KERNEL = """
import json, os, shutil, subprocess, sys
import psutil, torch
from jupyter_shard import Pool

CELL = (
    "import torch\\n"
    "loss = torch.tensor(1.5, device=shard.device)\\n"
    "parts = {'w': torch.ones(2, device=shard.device), 'steps': [torch.tensor(3, device=shard.device)]}\\n"
    "model = torch.nn.Linear(2, 2).to(shard.device)\\n"
)
def holds_gpu(pid):  # whether pid has a /dev/nvidia<N> open, as a CUDA context does
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").rstrip("0123456789") == "/dev/nvidia":
                return True
        except OSError:
            continue
    return False


with Pool(nproc=1, device="cuda", log_dir=sys.argv[1]) as pool:
    pool.run(CELL)
    loss, parts, model = pool.pull("loss"), pool.pull("parts"), pool.pull("model")
    query = [shutil.which("nvidia-smi") or "true", "--query-compute-apps=pid", "--format=csv,noheader"]
    smi = subprocess.run(query, capture_output=True, text=True, check=False).stdout.split()
    tensors = [loss, parts["w"], parts["steps"][0], *model.parameters()]
    print(json.dumps({
        "kernel": os.getpid(),
        "ours": [p.pid for p in psutil.Process().children(recursive=True)],
        "ranks": [row.pid for row in pool.status()],
        "smi": [int(p) for p in smi if p.isdigit()],
        "gpu_open": [pid for pid in [os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))]
                     if holds_gpu(pid)],
        "cuda_initialized": torch.cuda.is_initialized(),
        "devices": sorted({t.device.type for t in tensors}),
        "values": [loss.item(), parts["w"].tolist(), parts["steps"][0].item()],
        "parameter": type(model.weight).__name__,
    }))
"""


def _with_this_tree(pythonpath: str) -> str:
    """``PYTHONPATH`` with this checkout first, the entries already there kept after it (a GPU
    machine's site may come from there)."""
    return os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), *filter(None, pythonpath.split(os.pathsep))]
    )


def test_a_cuda_value_comes_back_on_the_cpu_without_a_cuda_context_in_the_kernel(tmp_path: Path) -> None:
    script = tmp_path / "kernel.py"
    script.write_text(_KERNEL)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "PYTHONPATH": _with_this_tree(os.environ.get("PYTHONPATH", ""))},
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["devices"] == ["cpu"] and seen["values"] == [1.5, [1.0, 1.0], 3]
    assert seen["parameter"] == "Parameter"
    assert seen["cuda_initialized"] is False  # no CUDA context in the kernel
    if set(seen["ranks"]) & set(seen["smi"]):  # nvidia-smi sees this machine's processes
        ours_on_gpu = set(seen["smi"]) & {seen["kernel"], *seen["ours"]}
    else:  # in a container nvidia-smi lists other pids: the processes holding /dev/nvidia<N> open
        ours_on_gpu = set(seen["gpu_open"])
    assert ours_on_gpu == set(seen["ranks"])  # the ranks only: not the kernel, not a zygote


@pytest.mark.timeout(300)
def test_a_device_side_assert_leaves_ranks_that_still_answer(tmp_path: Path) -> None:
    from jupyter_shard import DistributedError, Pool
    from jupyter_shard.errors import PoolError
    from jupyter_shard.pool.ranks import RankState

    n = min(visible_gpus(), 2)
    with Pool(nproc=n, device="cuda", log_dir=tmp_path, sink=_quiet_sink()) as pool:
        pids = {row.rank: row.pid for row in pool.status()}
        with pytest.raises(DistributedError) as caught:
            pool.run(
                "import torch\n"
                "x = torch.zeros(4, device=shard.device)\n"
                "y = x[torch.tensor([10], device=shard.device)]  # out of range: a device-side assert\n"
                "torch.cuda.synchronize()"
            )
        assert "CUDA error" in "\n".join(line for tb in caught.value.tracebacks.values() for line in tb)
        broke = time.monotonic()
        # each rank beats after the assert (heartbeats probe CUDA memory in the broken context): its
        # I/O thread lives on
        _until(
            lambda: all(
                row.heartbeat_age is not None and row.heartbeat_age < time.monotonic() - broke
                for row in pool.activity()
            ),
            IDLE_HEARTBEAT_INTERVAL + 5,
            "heartbeat from every rank after the device-side assert",
        )
        rows = pool.status()  # what %dist_status shows
        assert [row.rank for row in rows] == list(range(n))
        assert {row.rank: row.pid for row in rows} == pids and all(row.memory["rss"] > 0 for row in rows)
        assert all("MainThread" in stack for stack in pool.stacks().values())
        # F20 on a real device: the rank is shown broken, the cell said so, the next cell is refused
        assert "lost its CUDA context" in "\n".join(caught.value.result.notes), caught.value.result.notes
        assert all(row.state == RankState.BROKEN for row in rows), [row.state for row in rows]
        started = time.monotonic()
        with pytest.raises(PoolError, match="CUDA context"):
            pool.run("1 + 1")
        assert time.monotonic() - started < 1.0
        pool.restart()  # a CUDA error of that kind lasts for the life of the process: fresh ranks work
        # new ranks hold none of the old ones' names: the cell imports torch itself
        fresh = pool.run("import torch\ntorch.ones(2, device=shard.device).sum().item()")
        assert fresh.value == {"text/plain": "2.0"}
