"""jupyter_shard.planner.free_memory: the pool's report, then nvidia-smi, psutil for host RAM; no CUDA."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from jupyter_shard.errors import PoolError
from jupyter_shard.planner import free_memory
from jupyter_shard.planner.free_memory import (
    FreeMemory,
    MemorySnapshot,
    parse_nvidia_smi,
    probe_memory,
    run_nvidia_smi,
)
from jupyter_shard.pool.ranks import RankSnapshot, RankState
from jupyter_shard.spec import Device

MIB = 2**20
SMI = "81037, 81559\n40000, 81559\n[N/A], [N/A]\n\n"


def rank(k: int, **memory: int) -> RankSnapshot:
    return RankSnapshot(
        rank=k, pid=100 + k, host="host", device="cuda:0", state=RankState.IDLE, memory={"rss": 1, **memory}
    )


class FakePool:
    def __init__(self, rows: Sequence[RankSnapshot] | Exception) -> None:
        self.rows = rows

    def status(self) -> Sequence[RankSnapshot]:
        if isinstance(self.rows, Exception):
            raise self.rows
        return self.rows


def no_smi() -> str | None:
    raise AssertionError("nvidia-smi must not run when the pool reports GPU memory")


def test_parse_nvidia_smi_in_mib() -> None:
    assert parse_nvidia_smi(SMI) == ((81037 * MIB, 81559 * MIB), (40000 * MIB, 81559 * MIB))


@pytest.mark.parametrize(
    ("visible", "free"),
    [
        ("1", (40000,)),
        ("1,0", (40000, 81037)),
        ("", ()),
        ("GPU-1234-abcd", (81037, 40000)),
        ("0,7", (81037,)),
    ],
)
def test_parse_nvidia_smi_follows_cuda_visible_devices(visible: str, free: tuple[int, ...]) -> None:
    assert tuple(f for f, _ in parse_nvidia_smi(SMI, visible)) == tuple(x * MIB for x in free)


def test_garbage_from_nvidia_smi_is_no_gpus() -> None:
    assert parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver") == ()


def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(exe) if name == "nvidia-smi" else None)


def test_run_nvidia_smi_passes_the_query(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, 'echo "$@"')
    assert run_nvidia_smi() == "--query-gpu=memory.free,memory.total --format=csv,noheader,nounits\n"


@pytest.mark.parametrize("body", ["echo 'no devices' >&2; exit 9", "exec sleep 5"])
def test_run_nvidia_smi_failing_or_hanging_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str
) -> None:
    fake_smi(tmp_path, monkeypatch, body)
    assert run_nvidia_smi(timeout=0.5) is None


def test_run_nvidia_smi_missing_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert run_nvidia_smi() is None


def test_the_running_pool_comes_first() -> None:
    pool = FakePool(
        [rank(1, cuda_free=30 * MIB, cuda_total=80 * MIB), rank(0, cuda_free=50 * MIB, cuda_total=80 * MIB)]
    )
    snap = probe_memory(pool, smi=no_smi, host=lambda: 64 * MIB)
    assert snap == MemorySnapshot(((50 * MIB, 80 * MIB), (30 * MIB, 80 * MIB)), 64 * MIB, "the running pool")
    assert snap.free_for(Device.CUDA, 2) == FreeMemory(Device.CUDA, 30 * MIB, 64 * MIB, "the running pool")
    assert snap.free_for(Device.CUDA, 1) == FreeMemory(Device.CUDA, 50 * MIB, 64 * MIB, "the running pool")


@pytest.mark.parametrize(
    "rows", [[rank(0), rank(1)], PoolError("the pool is not running")], ids=["cpu", "dead"]
)
def test_a_cpu_or_dead_pool_falls_back_to_nvidia_smi(
    rows: list[RankSnapshot] | Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    snap = probe_memory(FakePool(rows), smi=lambda: SMI, host=lambda: None)
    assert snap == MemorySnapshot(((40000 * MIB, 81559 * MIB),), None, "nvidia-smi")


def test_no_source_means_unknown() -> None:
    snap = probe_memory(None, smi=lambda: None, host=lambda: None)
    assert snap == MemorySnapshot()
    assert snap.free_for(Device.CUDA, 2) is None
    assert snap.free_for(Device.CPU, 2) is None


def test_cpu_ranks_share_host_ram() -> None:
    snap = MemorySnapshot((), 90 * MIB, "")
    assert snap.free_for(Device.CPU, 3) == FreeMemory(Device.CPU, 30 * MIB, 90 * MIB, "psutil")


def test_host_available_is_psutil() -> None:
    import psutil

    found = free_memory.host_available()
    assert found is not None and abs(found - psutil.virtual_memory().available) < 2**30


def test_the_kernel_side_imports_no_torch() -> None:
    code = (
        "import sys, jupyter_shard.planner.free_memory, jupyter_shard.planner.estimate;"
        "import jupyter_shard.notebook.picker;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# `nvidia-smi --query-gpu=compute_cap --format=csv,noheader` on a mixed machine (A100, V100, T4, H100)
CAPS = "8.0\n7.0\n7.5\n9.0\n"


def test_parse_compute_caps() -> None:
    assert free_memory.parse_compute_caps(CAPS) == ((8, 0), (7, 0), (7, 5), (9, 0))
    assert free_memory.parse_compute_caps(CAPS, "3,1") == ((9, 0), (7, 0))
    assert free_memory.parse_compute_caps("8.6\n[N/A]\n") == ((8, 6), None)
    assert free_memory.parse_compute_caps("12.0\n") == ((12, 0),)  # Blackwell: not "1" < "8"


def test_an_old_driver_refuses_the_compute_cap_query(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, "echo 'Field \"compute_cap\" is not a valid field to query.'; exit 2")
    assert free_memory.run_compute_caps() is None


def test_run_compute_caps_passes_the_query(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, 'echo "$@"')
    assert free_memory.run_compute_caps() == "--query-gpu=compute_cap --format=csv,noheader\n"


def test_compute_caps_come_with_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    snap = probe_memory(None, smi=lambda: SMI, host=lambda: None, caps=lambda: "8.0\n7.5\n")
    assert snap.capabilities == ((7, 5),)
    assert snap.capabilities_of([0, 1]) == ((7, 5), None)


def test_no_gpus_no_compute_cap_query() -> None:
    def refuse() -> str | None:
        raise AssertionError("nvidia-smi must not be asked for compute capabilities without GPUs")

    assert probe_memory(None, smi=lambda: None, host=lambda: None, caps=refuse).capabilities == ()
