"""jupyter_shard.launchers.local: the devices a CUDA pool's ranks see, and the line saying how they came."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from jupyter_shard.launchers.base import RankLaunch
from jupyter_shard.launchers.local import LocalLauncher, _one_line, _path
from jupyter_shard.spec import LaunchSpec

PRINT_DEVICES = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"


def _start(spec: LaunchSpec, tmp_path: Path) -> tuple[LocalLauncher, list[str]]:
    """Start every rank of ``spec`` as a tiny command printing its CUDA_VISIBLE_DEVICES; what each printed."""
    launches = [
        RankLaunch(
            rank=k,
            env=dict(os.environ),
            log_path=tmp_path / f"rank-{k}.log",
            cwd=tmp_path,
            argv=[sys.executable, "-c", PRINT_DEVICES],
        )
        for k in range(spec.nproc)
    ]
    lifeline_r, lifeline_w = os.pipe()
    launcher = LocalLauncher()
    try:
        handles = launcher.start(spec, launches, lifeline_r)
        assert [h.wait(30) for h in handles] == [0] * spec.nproc
    finally:
        os.close(lifeline_r)
        os.close(lifeline_w)
    return launcher, [launch.log_path.read_text().strip() for launch in launches]


@pytest.mark.parametrize(
    ("kernel", "gpus", "seen"),
    [
        (None, "1,3", "1,3"),
        ("4,5,6,7", "1,3", "5,7"),
        ("4,5,6,7", "2", "4,5"),
        ("GPU-a,GPU-b", "1,", "GPU-b"),
    ],
)
def test_cuda_ranks_see_the_chosen_devices_by_physical_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str | None, gpus: str, seen: str
) -> None:
    if kernel is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", kernel)
    spec = LaunchSpec.create(gpus=gpus, gpu_count=4)
    launcher, printed = _start(spec, tmp_path)
    assert printed == [seen] * spec.nproc
    assert launcher.launch_path() == f"spawned: the ranks run their own command · CUDA_VISIBLE_DEVICES={seen}"
    assert launcher.started_note() == ""  # no zygote failed: nothing to announce


def test_cpu_ranks_keep_the_kernels_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    launcher, printed = _start(LaunchSpec.create(nproc=2, device="cpu", gpu_count=0), tmp_path)
    assert printed == ["3", "3"]
    assert launcher.launch_path() == "spawned: the ranks run their own command"


def test_the_launch_path_in_one_line() -> None:
    assert _path([0, 1], [], 4242, "") == "zygote (fork server, pid 4242)"
    assert _path([], [0, 1], 0, "JUPYTER_SHARD_ZYGOTE=0 turns the zygote off") == (
        "spawned: JUPYTER_SHARD_ZYGOTE=0 turns the zygote off"
    )
    assert _path([0, 1], [2, 3], 4242, "the zygote ended") == (
        "zygote (fork server, pid 4242) for ranks 0-1; spawned ranks 2-3: the zygote ended"
    )


def test_a_zygote_traceback_becomes_one_line() -> None:
    output = (
        "the zygote ended (its socket closed): Traceback (most recent call last):\n"
        '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
        "ModuleNotFoundError: No module named 'zmq'\n"
    )
    assert _one_line(output) == (
        "the zygote ended (its socket closed): Traceback (most recent call last): … "
        "ModuleNotFoundError: No module named 'zmq'"
    )
    assert len(_one_line("x" * 1000)) == 240
    assert _one_line("") == "no reason given"
