"""jupyter_shard.export.render: a transcript becomes a torchrun script (and an sbatch file). No processes."""

from __future__ import annotations

import ast
import shlex
import sys
from pathlib import Path

import pytest

from jupyter_shard.export.render import render_sbatch
from jupyter_shard.launchers.slurm import SlurmOptions
from jupyter_shard.spec import Device, LaunchSpec
from tests.unit.export._helpers import WHEN, _cell, _push, _render, _run_script


def test_cells_and_pushes_come_in_the_order_they_ran_under_their_execution_counts() -> None:
    text = _render(
        _cell("a = 1", 3),
        _push(lr=0.5),
        _cell("b = a + lr", 4),
        _cell("c = b * 2", 7),
    )
    marks = [line for line in text.splitlines() if line.startswith("# --- ")]
    assert marks == [
        "# --- cell [3] ---",
        "# --- %dist_push lr ---",
        "# --- cell [4] ---",
        "# --- cell [7] ---",
    ]
    assert text.index("a = 1") < text.index("lr = 0.5") < text.index("b = a + lr") < text.index("c = b * 2")
    assert text.index("shard = start(") < text.index("a = 1") and text.rstrip().endswith("finish()")


def test_the_script_starts_the_pools_strategy_with_its_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = LaunchSpec(strategy="ddp", accumulate=4, clip_grad_norm=1.5, timeout=90.0)
    text = _render(_cell("x = shard.rank", 1), spec=spec)
    ns = _run_script(text, 0, monkeypatch, tmp_path)
    assert ns["_started"] == [
        {"strategy": "ddp", "device": "cpu", "timeout": 90.0, "options": spec.rank_options()}
    ]
    assert "jupyter_shard: a session" not in text and "Source: nb" in text
    assert "    torchrun --nproc-per-node 2 train.py" in text


def test_failed_cells_are_left_out_with_a_comment() -> None:
    text = _render(_cell("good = 1", 1), _cell("broken_call()", 2, status="error"), _cell("also = 2", 3))
    assert "broken_call" not in text
    assert "# --- cell [2] failed in the notebook: left out ---" in text
    assert "good = 1" in text and "also = 2" in text


def test_pushes_to_some_ranks_are_assigned_only_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    text = _render(_push(ranks=(1,), only=7), _cell("x = globals().get('only')", 1))
    assert "# --- %dist_push only to rank 1 ---\nif shard.rank == 1:\n    only = 7\n" in text
    assert _run_script(text, 1, monkeypatch, tmp_path)["x"] == 7
    assert _run_script(text, 0, monkeypatch, tmp_path)["x"] is None


def test_a_strategy_registered_in_the_notebook_is_registered_in_the_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from jupyter_shard import strategies
    from jupyter_shard.strategies.base import NoStrategy

    monkeypatch.setattr(strategies, "_registered", {"mine": (NoStrategy, {"bucket": 3})})
    text = _render(_cell("x = 1", 1), spec=LaunchSpec(strategy="mine"))
    monkeypatch.setattr(strategies, "_registered", {})
    ns = _run_script(text, 0, monkeypatch, tmp_path)
    assert strategies.registered("mine") == (NoStrategy, {"bucket": 3})
    assert ns["_started"][0]["strategy"] == "mine"
    assert text.index('register_strategy("mine"') < text.index("shard = start(")


def test_sbatch_asks_slurm_for_the_pools_shape_and_starts_torchrun_per_node() -> None:
    spec = LaunchSpec(
        nproc=4,
        device=Device.CUDA,
        nodes=2,
        launcher="slurm",
        strategy="fsdp",
        launcher_options=SlurmOptions(partition="gpu", time_limit="01:30:00", account="proj"),
    )
    text = render_sbatch(spec, "train.py", when=WHEN, name="job.sbatch")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=train",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=01:30:00",
        "#SBATCH --account=proj",
        "#SBATCH --output=train-%j.out",
    ]
    assert text.startswith("#!/bin/bash\n")
    assert (
        'mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")\n'
        'export TORCHRUN head="${hosts[0]}"' in text
    )
    srun = shlex.split(text[text.index("srun ") :].replace("\\\n", " "))
    assert srun[:3] == ["srun", "bash", "-c"] and len(srun) == 4
    # each task's own shell expands its node's index: static rendezvous, nothing pickled
    assert shlex.split(srun[3]) == [
        "exec", '$TORCHRUN', "--nnodes", '$SLURM_JOB_NUM_NODES', "--nproc-per-node", "4",
        "--rdzv-backend", "static", "--node-rank", '$SLURM_NODEID', "--master-addr", '$head',
        "--master-port", '$port', "--rdzv-id", '$SLURM_JOB_ID', "--tee", "3", "train.py",
    ]  # fmt: skip
    assert f'TORCHRUN="${{TORCHRUN:-{Path(sys.executable).with_name("torchrun")}}}"' in text


def test_sbatch_on_cpu_asks_for_no_gpus_and_leaves_out_options_the_spec_lacks() -> None:
    text = render_sbatch(LaunchSpec(nproc=2), "sub dir/train.py", when=WHEN)
    assert "--gpus-per-node" not in text and "--partition" not in text and "--time" not in text
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --cpus-per-task=2\n" in text
    inner = shlex.split(shlex.split(text[text.index("srun ") :].replace("\\\n", " "))[3])
    assert inner[-3:] == ["--tee", "3", "sub dir/train.py"]


def test_the_header_says_how_to_run_on_several_nodes() -> None:
    text = _render(_cell("x = 1", 1), spec=LaunchSpec(nproc=4, nodes=2, launcher="torchrun"))
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert "1 cell run on 2 nodes × 4 CPU ranks (none)" in doc
    assert "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend static \\\n" in doc
    assert "--node-rank NODE --master-addr HEAD --master-port 29500 --rdzv-id RUN" in doc
