"""jupyter_shard.launchers.slurm: the interface it needs, job names, the srun command line; no SLURM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_shard.launchers import slurm as slurm_mod
from jupyter_shard.launchers.commands import agent_args as torchrun_args
from jupyter_shard.launchers.slurm import SlurmLauncher
from jupyter_shard.spec import SpecError
from tests.unit.launchers._helpers import _lo_address, _one_line, _rank_launches, _Spawned, _spec


def test_slurm_without_interface_is_refused() -> None:
    with pytest.raises(SpecError) as info:
        SlurmLauncher().bind_address(_spec(launcher="slurm"))
    msg = _one_line(info)
    assert msg.startswith("SLURM may place the ranks on other machines")
    assert "--interface" in msg and f"lo {_lo_address()}" in msg


# -- slurm: the srun command -------------------------------------------------------------------------


def test_slurm_job_names_are_unique() -> None:
    a, b = SlurmLauncher().job_name, SlurmLauncher().job_name
    assert a != b and a.startswith("jupyter_shard-") and b.startswith("jupyter_shard-")


def test_slurm_start_builds_one_srun_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spawned = _Spawned()
    monkeypatch.setattr(slurm_mod, "spawn_agent", spawned)
    monkeypatch.setattr(slurm_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    fake_python = tmp_path / "bin" / "python"
    fake_python.parent.mkdir()
    fake_python.write_text('#!/bin/sh\necho "NODE=$JUPYTER_SHARD_NODE"\nfor a; do echo "$a"; done\n')
    fake_python.chmod(0o755)
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "nodeA\\nnodeB\\n"\n')
    scontrol.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))

    spec = _spec(
        launcher="slurm", gpus=4, nproc=None, nodes=2, partition="gpu", time_limit="1:00:00", account="proj"
    )
    launcher = SlurmLauncher()
    handles = launcher.start(spec, _rank_launches(tmp_path, 8), lifeline_fd=99)
    assert len(handles) == 8
    (call,) = spawned.calls
    assert (call["node"], call["host"]) == (None, "slurm")
    command = call["command"]
    assert command[0] == "srun"
    srun = command[: command.index("bash")]
    for flag in (
        f"--job-name={launcher.job_name}",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--gpus-per-node=4",
        "--partition=gpu",
        "--time=1:00:00",
        "--account=proj",
    ):
        assert flag in srun
    assert command[-3:-1] == ["bash", "-c"]
    assert call["cancel"] == ["scancel", f"--name={launcher.job_name}"]
    assert call["log"] == tmp_path / "srun.log"
    for name in ("RANK", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert name not in call["env"]

    # what each task runs, with SLURM's variables as srun sets them on node 1
    env = {
        "PATH": f"{fake_python.parent}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "nodeA,nodeB",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "77",
    }
    out = subprocess.run(
        ["bash", "-c", command[-1]], capture_output=True, text=True, env=env, timeout=10, check=True
    ).stdout.splitlines()
    assert out[0] == "NODE=1"
    assert out[1:] == [
        "-m",
        "jupyter_shard.launchers.node_agent",
        *torchrun_args("2", 4, "1", "nodeA", "29400", "77"),  # node 1 told so: static rendezvous
        "-m",
        "jupyter_shard.rank",
    ]


def test_slurm_cpu_pool_asks_for_no_gpus_and_no_unset_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned = _Spawned()
    monkeypatch.setattr(slurm_mod, "spawn_agent", spawned)
    monkeypatch.setattr(slurm_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    SlurmLauncher().start(_spec(launcher="slurm", nproc=2), _rank_launches(tmp_path, 2), lifeline_fd=99)
    srun = spawned.calls[0]["command"]
    srun = srun[: srun.index("bash")]
    assert "--nodes=1" in srun and "--cpus-per-task=2" in srun
    assert not [a for a in srun if a.startswith(("--gpus", "--partition", "--time", "--account"))]


def test_slurm_start_without_srun_is_a_spec_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_mod.shutil, "which", lambda name: None)
    with pytest.raises(SpecError, match="needs SLURM's srun on PATH"):
        SlurmLauncher().start(_spec(launcher="slurm"), _rank_launches(tmp_path, 1), lifeline_fd=99)
