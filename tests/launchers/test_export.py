"""``%dist_export`` end to end: a notebook trains on 2 CPU ranks, the exported script then runs under
torchrun and as a SLURM job, and each rank prints the losses the notebook's ranks printed.

One kernel serves the module: its cells seed torch, build a small model on synthetic data (different on
each rank, so DDP really averages), push a float and a tensor, run a cell on rank 1 only, fail one cell,
train 5 steps printing every loss in full precision, and export with ``--sbatch``.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard import Pool
from jupyter_shard.export.files import export
from jupyter_shard.pool.output import ConsoleSink
from tests.launchers.conftest import SlurmCluster

pytestmark = pytest.mark.timeout(240)

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LOSS = re.compile(r"rank (\d+) step (\d+) loss (\S+)$", re.MULTILINE)

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
g = torch.Generator().manual_seed(100 + shard.rank)
x = torch.randn(32, 8, generator=g)
"""
TARGETS = "y = x.sum(1, keepdim=True) * scale\nx_mean = %time float(x.mean())\n"
PREPARE = (
    "opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)\nmodel, opt = shard.prepare(model, opt)\n"
)
TRAIN = """
for i in range(5):
    loss = nn.functional.mse_loss(model(x), y)
    shard.backward(loss)
    shard.step()
    shard.log(loss=loss)
    print(f"rank {shard.rank} step {i} loss {loss.item()!r}")
"""


def env() -> dict[str, str]:
    """This process's environment (with the SLURM fixture's job key) and the pool's thread count for
    2 ranks on a 2-CPU machine."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def losses(text: str) -> dict[tuple[int, int], str]:
    found = {(int(r), int(s)): v for r, s, v in LOSS.findall(text)}
    assert len(found) == 10, f"expected 5 losses from each of 2 ranks in:\n{text}"
    return found


def torchrun(script: Path) -> str:
    """The script's output under torchrun, each line labelled ``[default<rank>]:`` (not interleaved)."""
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--tee", "3", script.name],
        cwd=script.parent,
        env=env(),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    # finish() ends each worker without the interpreter teardown in which torch 2.13's gloo can
    # abort (pytorch/pytorch#190489): an exported run exits 0
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@dataclass
class Notebook:
    folder: Path
    losses: dict[tuple[int, int], str]
    message: str


@pytest.fixture(scope="module")
def notebook(shared_kernel: Any, tmp_path_factory: pytest.TempPathFactory) -> Notebook:
    folder = tmp_path_factory.mktemp("export")
    k = shared_kernel

    def ok(code: str) -> Any:
        run = k.execute(code)
        assert run.ok, run.outputs
        return run

    ok("import os, torch\nos.environ['OMP_NUM_THREADS'] = '1'\nlr, scale = 0.05, torch.tensor(0.5)")
    ok(f"%%distributed --nproc 2 --device cpu --strategy ddp\n{SETUP}")
    ok("%dist_push lr scale")
    ok(f"%%distributed\n{TARGETS}")
    assert not k.execute("%%distributed\nraise ValueError('left out of the export')").ok
    ok("%%rank 1\nprint(f'only on rank {shard.rank}')")
    ok(f"%%distributed\n{PREPARE}")
    trained = ok(f"%%distributed\n{TRAIN}")
    exported = ok(f"%dist_export {folder / 'train.py'} --sbatch {folder / 'job.sbatch'}")
    return Notebook(folder, losses(trained.stream()), exported.stream())


def test_the_magic_writes_the_script_and_the_sbatch_file(notebook: Notebook) -> None:
    assert notebook.message.startswith(
        f"jupyter_shard: wrote {notebook.folder / 'train.py'} (5 cells and 2 pushed values, in the "
        "order they ran; 1 failed cell left out). Run it with `torchrun --nproc-per-node 2 train.py`"
    ), notebook.message
    text = (notebook.folder / "train.py").read_text()
    assert "left out of the export" not in text and "lr = 0.05\nscale = unpickle(" in text
    assert "#SBATCH --nodes=1" in (notebook.folder / "job.sbatch").read_text()


def test_the_script_under_torchrun_prints_the_notebooks_losses(notebook: Notebook) -> None:
    out = torchrun(notebook.folder / "train.py")
    assert losses(out) == notebook.losses
    assert "only on rank 1" in out and "only on rank 0" not in out
    runs = list((notebook.folder / "train.metrics").iterdir())
    logged = [json.loads(line) for line in (runs[-1] / "rank-1.jsonl").read_text().splitlines()]
    assert [(r["step"], repr(r["loss"])) for r in logged] == [
        (i + 1, notebook.losses[(1, i)]) for i in range(5)
    ]


def test_the_sbatch_job_prints_the_notebooks_losses(notebook: Notebook, slurm: SlurmCluster) -> None:
    done = subprocess.run(
        ["sbatch", "--wait", "--parsable", f"--partition={slurm.partition}", "job.sbatch"],
        cwd=notebook.folder,
        env=env(),
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    job = done.stdout.strip().split(";")[0]
    output = notebook.folder / f"train-{job}.out"
    log = output.read_text() if output.exists() else "(no output file)"
    assert done.returncode == 0, f"sbatch exited {done.returncode}: {done.stderr}\n{log}"
    assert losses(log) == notebook.losses
    assert re.search(r"^\[default1\]:only on rank 1$", log, re.MULTILINE), log  # labelled by --tee 3


def test_an_fsdp_pool_exported_through_the_api_trains_the_same_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(nproc=2, device="cpu", strategy="fsdp", log_dir=tmp_path / "logs", sink=sink) as pool:
        for cell in (SETUP, "import torch\nscale = torch.tensor(0.5)\ny = x.sum(1, keepdim=True) * scale"):
            pool.run(cell)
        pool.push(lr=0.05)
        pool.run(PREPARE)
        result = pool.run(TRAIN)
        export(pool.transcript, pool.spec, tmp_path / "train.py")
    notebook = losses("".join(r.stdout for r in result.ranks.values()))
    assert losses(torchrun(tmp_path / "train.py")) == notebook
