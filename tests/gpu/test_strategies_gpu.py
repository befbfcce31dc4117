"""Strategies on GPUs: NCCL, bf16, CUDA memory; the devices a pool chose (``--gpus 0,2``), and no CUDA
context outside the ranks. Skipped where no CUDA device is visible; ``--gpus 0,2`` needs three."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from jupyter_shard.spec import visible_gpus
from tests.gpu.marks import gpu_module, requires_gpus

pytestmark = gpu_module(timeout=600)

TRAIN = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = shard.prepare(model, opt)
x = torch.randn(32, 1024, device=shard.device)
for _ in range(3):
    loss = model(x).float().pow(2).mean()
    shard.backward(loss); shard.step()
out_dtype = str(model(x).dtype)
mem = shard.memory()
"""


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("ddp", {}), ("fsdp", {}), ("deepspeed", {"zero_stage": 2}), ("deepspeed", {"zero_stage": 3})],
    ids=["ddp", "fsdp", "zero2", "zero3"],
)
def test_bf16_training_on_gpu_reports_cuda_memory(
    tmp_path: Path, strategy: str, extra: dict[str, int]
) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    from jupyter_shard import LaunchSpec, Pool
    from jupyter_shard.pool.output import ConsoleSink

    spec = LaunchSpec.create(
        nproc=visible_gpus(), device="cuda", strategy=strategy, precision="bf16-mixed", **extra
    )
    with Pool(spec=spec, log_dir=tmp_path, sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool:
        pool.run(TRAIN)
        assert pool.pull("out_dtype") == "torch.bfloat16"
        mem = pool.pull("mem")
        assert mem["cuda_allocated"] > 0 and mem["cuda_peak"] >= mem["cuda_allocated"]
        assert mem["parameters"] > 0


# -- which GPUs a pool uses, and that only its ranks hold a CUDA context --------------------------------

RANK_DEVICE = (
    "import os, torch\n"
    "x = torch.ones(1, device=shard.device)\n"
    "(str(torch.cuda.get_device_properties(shard.device).uuid), torch.cuda.device_count(), os.getpid(), "
    "os.getppid())"
)


def _smi_uuids() -> list[str]:
    """The machine's GPUs in nvidia-smi's (PCI bus) order, without the ``GPU-`` prefix torch leaves off."""
    from jupyter_shard.gpus import nvidia_smi

    text = nvidia_smi("--query-gpu=uuid", "--format=csv,noheader")
    assert text is not None, "nvidia-smi is needed to check which GPUs the ranks got"
    return [line.strip().removeprefix("GPU-") for line in text.splitlines() if line.strip()]


def _rank_devices(pool: object) -> dict[int, tuple[str, int, int, int]]:
    import ast

    run = pool.run(RANK_DEVICE)  # type: ignore[attr-defined]
    return {k: ast.literal_eval(r.result["text/plain"]) for k, r in run.ranks.items()}


@requires_gpus(3)
@pytest.mark.parametrize(("kernel", "physical"), [(None, (0, 2)), ("2,0,1", (2, 1))], ids=["all", "cvd"])
def test_gpus_list_gives_ranks_those_physical_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str | None, physical: tuple[int, int]
) -> None:
    from jupyter_shard import LaunchSpec, Pool
    from jupyter_shard.pool.output import ConsoleSink

    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA numbers GPUs as nvidia-smi lists them
    if kernel is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", kernel)
    uuids = _smi_uuids()
    spec = LaunchSpec.create(gpus="0,2", strategy="ddp")
    with Pool(spec=spec, log_dir=tmp_path, sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool:
        seen = _rank_devices(pool)
        assert {k: v[0] for k, v in seen.items()} == {k: uuids[p] for k, p in enumerate(physical)}
        assert {v[1] for v in seen.values()} == {2}  # each rank sees exactly the chosen two
        assert f"CUDA_VISIBLE_DEVICES={','.join(map(str, physical))}" in pool.launch_path


def _gpu_files(pid: int) -> set[str]:
    """The NVIDIA device files process ``pid`` has open (``/dev/nvidia0``, ``/dev/nvidia-uvm``)."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/nvidia") and target != "/dev/nvidiactl":
            found.add(target)
    return found


def test_only_the_ranks_hold_cuda_contexts(tmp_path: Path) -> None:
    from jupyter_shard import Pool
    from jupyter_shard.gpus import nvidia_smi
    from jupyter_shard.pool.output import ConsoleSink

    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(nproc=visible_gpus(), device="cuda", log_dir=tmp_path, sink=sink) as pool:
        seen = _rank_devices(pool)
        text = nvidia_smi("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader")
        assert text is not None
        apps = [tuple(f.strip() for f in line.split(",")) for line in text.splitlines() if line.strip()]
        rank_pids = {v[2] for v in seen.values()}
        listed = [int(pid) for pid, _ in apps]
        zygotes = {v[3] for v in seen.values()} - {os.getpid()}
        if not rank_pids & set(listed):
            # nvidia-smi lists processes of another PID namespace (a container): look at each
            # process's open device files instead. A CUDA context holds /dev/nvidia<N> (and
            # /dev/nvidia-uvm) open; nothing else here opens them.
            assert not _gpu_files(os.getpid()), "the kernel holds a CUDA device open"
            for pid in zygotes:
                assert not _gpu_files(pid), f"the zygote {pid} holds a CUDA device open"
            for pid in rank_pids:
                assert any(f.rstrip("0123456789") == "/dev/nvidia" for f in _gpu_files(pid)), pid
            return
        assert pool.launch_path.startswith("zygote (fork server") == bool(zygotes)
        assert os.getpid() not in listed  # nothing from the kernel ...
        assert not zygotes & set(listed)  # ... or the zygote
        mine = [(int(pid), uuid.removeprefix("GPU-")) for pid, uuid in apps if int(pid) in rank_pids]
        assert sorted(pid for pid, _ in mine) == sorted(rank_pids)  # one context per rank
        assert len({uuid for _, uuid in mine}) == len(rank_pids)  # on a GPU of its own
