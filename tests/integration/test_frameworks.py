"""Code people already have, unchanged in ``%%distributed`` cells, through a real kernel (2 CPU ranks):
a torchrun script with its own ``init_process_group`` / ``destroy_process_group``, Lightning's
Trainer (several strategies and options) and Fabric, the Hugging Face Trainer and Accelerate.

Each checks what the framework reports (world size, steps), that training really synchronised
(replicas identical, loss down), that what it logged reached ``jupyter_shard.history()``, and that
the pool is usable afterwards. One kernel and pool serve the module, in order, as a notebook would.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)

TORCHRUN_SCRIPT = """\
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    print(f"rank {rank} of {dist.get_world_size()} launched by torchrun: {dist.is_torchelastic_launched()}")
    if os.environ.get("WEIGHTS_OUT"):
        torch.save(weights, f"{os.environ['WEIGHTS_OUT']}-{rank}.pt")
    dist.destroy_process_group()
    return weights


if __name__ == "__main__":
    weights = main()
"""

LIGHTNING_SETUP = """\
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

class Regressor(L.LightningModule):
    def __init__(self, name):
        super().__init__()
        self.name = name
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log(self.name, loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

g = torch.Generator().manual_seed(0)
xs = torch.randn(128, 8, generator=g)
data = TensorDataset(xs, xs.sum(1, keepdim=True) + 0.1 * torch.randn(128, 1, generator=g))

def full_loss(module):
    with torch.no_grad():
        return torch.nn.functional.mse_loss(module.net(data.tensors[0]), data.tensors[1]).item()

def flat(module):
    return torch.cat([p.detach().float().flatten() for p in module.parameters()])

def trainer(**options):
    settings = dict(accelerator="cpu", max_epochs=3, log_every_n_steps=1, enable_model_summary=False,
                    enable_progress_bar=False, logger=False, enable_checkpointing=False)
    settings.update(options)
    return L.Trainer(**settings)
"""


@pytest.fixture(scope="module")
def nb(shared_kernel: Any) -> Any:
    run = shared_kernel.execute("%%distributed --nproc 2 --device cpu\nimport os, sys\nstate = 'kept'")
    assert run.ok, run.outputs
    return shared_kernel


def _value(nb: Any, expression: str) -> Any:
    """A Python literal evaluated in the kernel (not on the ranks)."""
    run = nb.execute(expression)
    assert run.ok, run.outputs
    return ast.literal_eval(run.data("execute_result")[0]["text/plain"])


def _lines(run: Any, marker: str) -> list[str]:
    """The cell's stdout lines that contain ``marker``, sorted (ranks print in any order)."""
    return sorted(line for line in run.stream().splitlines() if marker in line)


def _replicas_identical(nb: Any, name: str) -> bool:
    run = nb.execute(
        f"%dist_pull {name} --all\nimport torch\nall(torch.equal(v, {name}[0]) for v in {name}.values())"
    )
    assert run.ok, run.outputs
    return bool(run.data("execute_result")[0]["text/plain"] == "True")


def _history(nb: Any, metric: str) -> list[tuple[int, int]]:
    """(rank, step) of every record of ``metric`` in ``jupyter_shard.history()``."""
    found = _value(
        nb,
        f"import jupyter_shard\n[(r['rank'], r['step']) for r in jupyter_shard.history() if {metric!r} in r]",
    )
    return [tuple(pair) for pair in found]


def _still_usable(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
        "print(state, int(t.item()))"
    )
    assert run.ok, run.outputs
    ranks = sorted(line for line in run.stream().splitlines() if line.startswith("[rank "))  # not notices
    assert ranks == ["[rank 0] kept 2", "[rank 1] kept 2"]


# -- torchrun scripts -----------------------------------------------------------------------------


def test_ranks_have_torchruns_environment_and_do_not_look_interactive(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "import torch.distributed as dist\n"
        "names = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'GROUP_WORLD_SIZE',\n"
        "         'ROLE_RANK', 'ROLE_NAME', 'ROLE_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT',\n"
        "         'TORCHELASTIC_RUN_ID', 'TORCHELASTIC_RESTART_COUNT', 'TORCHELASTIC_MAX_RESTARTS',\n"
        "         'TORCHELASTIC_USE_AGENT_STORE', 'TORCHELASTIC_ERROR_FILE']\n"
        "missing = [n for n in names if not os.environ.get(n)]\n"
        "(missing, dist.is_torchelastic_launched(), hasattr(sys, 'ps1'), bool(sys.flags.interactive),\n"
        " os.environ['ROLE_RANK'] == os.environ['RANK'], os.environ['GROUP_WORLD_SIZE'])"
    )
    assert run.ok, run.outputs
    shown = run.data("execute_result")[0]["text/plain"]
    assert shown == "([], True, False, False, True, '1')", shown
    # IPython's semantics stay: magics and the last expression's display
    run = nb.execute("%%distributed\n%time x = 1\nx + 1")
    assert run.ok, run.outputs
    assert run.data("execute_result")[0]["text/plain"] == "2"


GLOO_EXIT_ABORT = "terminate called without an active exception"


def _torchrun_reference(script: Path, weights: Path) -> None:
    """Run ``script`` under plain torchrun: the reference the pool's run is compared with.

    torch 2.13's gloo can abort a process while the interpreter shuts down, after the script has
    returned (std::terminate from a worker thread; pytorch/pytorch#190489): 5 of 30 plain torchrun
    runs of this script here, and torchrun then sends SIGTERM to the other rank, which may not
    have saved yet. That is torchrun's teardown, not the script: a run counts when both ranks
    printed their line and saved weights that load, and such a run is tried up to three times.
    Any other failure fails the test at once.
    """
    env = {**os.environ, "WEIGHTS_OUT": str(weights), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    files = [Path(f"{weights}-{r}.pt") for r in (0, 1)]
    for _attempt in range(3):
        for f in files:
            f.unlink(missing_ok=True)
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0 or GLOO_EXIT_ABORT in done.stderr, done.stderr[-3000:]
        # unbuffered, each print is two writes (text, then newline), so the ranks' lines can interleave
        printed = all(f"rank {r} of 2 launched by torchrun: True" in done.stdout for r in (0, 1))
        if printed and _load_all(files):
            return
    raise AssertionError(
        f"no whole reference run in 3 tries:\nstdout: {done.stdout[-1500:]}\nstderr: {done.stderr[-1500:]}"
    )


def _load_all(files: list[Path]) -> bool:
    """Whether every file is a whole ``torch.save`` (a file cut short by SIGTERM does not load)."""
    import torch

    try:
        return all(isinstance(torch.load(f), torch.Tensor) for f in files)
    except (OSError, RuntimeError, EOFError):
        return False


def test_a_torchrun_script_runs_unchanged_and_matches_torchrun(nb: Any, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    _torchrun_reference(script, tmp_path / "weights")

    run = nb.execute("%%distributed\n" + TORCHRUN_SCRIPT)
    assert run.ok, run.outputs
    assert _lines(run, "launched") == [
        "[rank 0] rank 0 of 2 launched by torchrun: True",
        "[rank 1] rank 1 of 2 launched by torchrun: True",
    ]
    assert "the cell closed the process group on rank 0-1 (destroy_process_group)" in run.stream()
    assert _replicas_identical(nb, "weights")
    same = _value(
        nb,
        f"all(torch.allclose(weights[0], torch.load({str(tmp_path / 'weights')!r} + f'-{{r}}.pt'), atol=1e-6)"
        " for r in (0, 1))",
    )
    assert same, "the pool's replicas differ from torchrun's"

    # The same script again: its init_process_group meets the rebuilt group.
    run = nb.execute("%%distributed\n" + TORCHRUN_SCRIPT)
    assert run.ok, run.outputs
    assert "rebuilt the process group after destroy_process_group" in run.stream()
    _still_usable(nb)


def test_init_process_group_that_does_not_match_the_pool_is_one_line(nb: Any) -> None:
    run = nb.execute(
        '%%distributed\nimport torch.distributed as dist\ndist.init_process_group(backend="nccl")'
    )
    assert not run.ok
    assert run.error["evalue"].startswith("rank ")
    last = run.error_text().strip().splitlines()[-1]
    assert last == (
        'ValueError: init_process_group(backend="nccl"): this pool\'s ranks run on CPU, where its process '
        'group uses gloo. Pass backend="gloo" or leave backend out, or start the pool with '
        "%%distributed --device cuda"
    ), last
    assert "PoolGroup.mismatch" not in run.error_text()  # the check itself is not a frame of its own
    run = nb.execute("%%distributed\ndist.init_process_group('gloo', init_method='env://', world_size=4)")
    assert not run.ok
    assert "this pool has 2 ranks" in run.error_text() and "--nproc 4" in run.error_text()
    # matching calls are accepted, keyword or positional, and change nothing
    run = nb.execute("%%distributed\ndist.init_process_group('gloo', world_size=2, rank=shard.rank)\nstate")
    assert run.ok, run.outputs
    _still_usable(nb)


# -- Lightning --------------------------------------------------------------------------------------


def _fit(nb: Any, name: str, trainer_options: str, fit_options: str = "") -> list[str]:
    """Fit a fresh Regressor logging ``name``; checks shared by every Lightning case."""
    run = nb.execute(
        "%%distributed\n"
        f"model = Regressor({name!r})\n"
        "before = full_loss(model)\n"
        f"t = trainer({trainer_options})\n"
        f"t.fit(model, DataLoader(data, batch_size=8){fit_options})\n"
        "after = full_loss(model)\n"
        f"{name} = flat(model)\n"
        "print('world', t.world_size, 'steps', t.global_step, 'down', after < before,\n"
        "      type(t.strategy).__name__)"
    )
    assert run.ok, run.outputs
    assert _replicas_identical(nb, name), "replicas differ after a DDP fit"
    return [line for line in run.stream().splitlines() if "world" in line]


def test_lightning_setup(nb: Any) -> None:
    run = nb.execute("%%distributed\n" + LIGHTNING_SETUP)
    assert run.ok, run.outputs


@pytest.mark.parametrize(
    ("name", "options", "steps"),
    [
        ("loss_ddp", 'devices=2, strategy="ddp"', 24),
        (
            "loss_options",
            'devices="auto", strategy="ddp", accumulate_grad_batches=2, gradient_clip_val=0.5,'
            ' precision="bf16-mixed"',
            12,
        ),
        (
            "loss_ddp_strategy",
            "devices=2, strategy=L.pytorch.strategies.DDPStrategy(static_graph=True,"
            " find_unused_parameters=False, gradient_as_bucket_view=True)",
            24,
        ),
        ("loss_notebook", 'devices=2, strategy="ddp_notebook"', 24),
    ],
)
def test_lightning_trainer_fits_on_the_pool(nb: Any, name: str, options: str, steps: int) -> None:
    lines = _fit(nb, name, options)
    assert sorted(lines) == [f"[rank {r}] world 2 steps {steps} down True DDPStrategy" for r in (0, 1)], lines
    # log_every_n_steps=1: one record per optimizer step on each rank, at Lightning's step numbers
    records = _history(nb, name)
    assert sorted(records) == sorted((r, s) for r in (0, 1) for s in range(steps)), records


def test_lightning_strategy_from_the_registry(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry\n"
        "if 'ddp_small_buckets' not in StrategyRegistry:\n"
        "    StrategyRegistry.register('ddp_small_buckets', DDPStrategy, description='DDP, 1 MB buckets',\n"
        "                              bucket_cap_mb=1)"
    )
    assert run.ok, run.outputs
    lines = _fit(nb, "loss_registry", 'devices=2, strategy="ddp_small_buckets"')
    assert sorted(lines) == [f"[rank {r}] world 2 steps 24 down True DDPStrategy" for r in (0, 1)]


def test_lightning_checkpoint_and_resume(nb: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    options = (
        f'devices=2, strategy="ddp", max_epochs=1, enable_checkpointing=True,'
        f" callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath={str(ckpt)!r}, save_last=True)]"
    )
    lines = _fit(nb, "loss_ckpt", options)
    assert sorted(lines) == [f"[rank {r}] world 2 steps 8 down True DDPStrategy" for r in (0, 1)]
    assert (ckpt / "last.ckpt").is_file()
    resumed = options.replace("max_epochs=1", "max_epochs=2")
    lines = _fit(nb, "loss_resumed", resumed, f", ckpt_path={str(ckpt / 'last.ckpt')!r}")
    # the second fit starts at step 8 (from the checkpoint) and ends after the second epoch
    assert sorted(lines) == [f"[rank {r}] world 2 steps 16 down True DDPStrategy" for r in (0, 1)], lines
    assert sorted(_history(nb, "loss_resumed")) == sorted((r, s) for r in (0, 1) for s in range(8, 16))


def test_lightning_asked_for_more_devices_than_the_pool_is_one_line(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\nt = trainer(devices=4, strategy='ddp')\nt.fit(Regressor('x'), DataLoader(data))"
    )
    assert not run.ok
    last = run.error_text().strip().splitlines()[-1]
    assert last == (
        "ValueError: Lightning was asked for 4 processes (devices × num_nodes), but this pool has 2 ranks: "
        'pass devices=2 or devices="auto", or start a pool of 4 ranks with %%distributed --nproc 4'
    ), last
    _still_usable(nb)


def test_lightning_progress_bar_is_a_live_line(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "from lightning.pytorch.callbacks import TQDMProgressBar\n"
        "t = trainer(devices=2, strategy='ddp', max_epochs=1, enable_progress_bar=True,"
        " callbacks=[TQDMProgressBar(refresh_rate=1)])\n"
        "import time\nfrom torch.utils.data import default_collate\n"
        "def slow(batch):  # long enough a step for the bar to be redrawn as it goes\n"
        "    time.sleep(0.05)\n"
        "    return default_collate(batch)\n"
        "t.fit(Regressor('loss_bar'), DataLoader(data, batch_size=8, collate_fn=slow))"
    )
    assert run.ok, run.outputs
    assert "it/s" not in run.stream("stderr") and "it/s" not in run.stream(), "bar updates leaked"
    bars = [
        o["data"]["text/plain"]
        for o in run.outputs
        if o["type"] in ("display_data", "update_display_data")
        and o["data"].get("text/plain", "").startswith("[rank 0] Epoch 0")
    ]
    assert len(bars) >= 2, run.outputs
    assert "8/8" in bars[-1], bars[-1]


def test_lightnings_default_rich_progress_bar_is_a_live_line(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "t = trainer(devices=2, strategy='ddp', max_epochs=1, enable_progress_bar=True)\n"
        "t.fit(Regressor('loss_rich'), DataLoader(data, batch_size=8, collate_fn=slow))\n"
        "type(t.progress_bar_callback).__name__"
    )
    assert run.ok, run.outputs
    assert run.data("execute_result")[0]["text/plain"] == "'RichProgressBar'"
    bars = [
        o["data"]["text/plain"]
        for o in run.outputs
        if o["type"] in ("display_data", "update_display_data")
        and o["data"].get("text/plain", "").startswith("[rank 0] Epoch 0/0")
    ]
    assert len(bars) >= 2, run.outputs
    assert "8/8" in bars[-1] and "\x1b[2K" not in bars[-1], bars[-1]
    assert "Epoch 0/0" not in run.stream() + run.stream("stderr"), "redraws leaked into the stream"


def test_fabric_runs_on_the_pool(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "fabric = L.Fabric(accelerator='cpu', devices=2, strategy='ddp')\n"
        "fabric.launch()\n"
        "module = Regressor('unused')\n"
        "before = full_loss(module)\n"
        "net, opt = fabric.setup(module.net, torch.optim.SGD(module.net.parameters(), lr=0.05))\n"
        "loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))\n"
        "for epoch in range(3):\n"
        "    for i, (x, y) in enumerate(loader):\n"
        "        opt.zero_grad()\n"
        "        loss = torch.nn.functional.mse_loss(net(x), y)\n"
        "        fabric.backward(loss)\n"
        "        opt.step()\n"
        "        fabric.log('fabric_loss', loss, step=epoch * len(loader) + i)\n"
        "fabric_weights = flat(module)\n"
        "print('fabric', fabric.world_size, fabric.global_rank, len(loader), full_loss(module) < before)"
    )
    assert run.ok, run.outputs
    lines = _lines(run, "fabric")
    assert lines == ["[rank 0] fabric 2 0 8 True", "[rank 1] fabric 2 1 8 True"]
    assert _replicas_identical(nb, "fabric_weights")
    assert sorted(_history(nb, "fabric_loss")) == sorted((r, s) for r in (0, 1) for s in range(24))


# -- Hugging Face and Accelerate --------------------------------------------------------------------


def test_hugging_face_trainer(nb: Any, tmp_path: Path) -> None:
    run = nb.execute(
        "%%distributed\n"
        "from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments\n"
        "torch.manual_seed(0)\n"
        "config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,\n"
        "                    bos_token_id=0, eos_token_id=0)\n"
        "lm = GPT2LMHeadModel(config)\n"
        "ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))\n"
        "rows = [{'input_ids': row, 'labels': row} for row in ids]\n"
        f"args = TrainingArguments(output_dir={str(tmp_path)!r}, per_device_train_batch_size=4,\n"
        "    max_steps=12,\n"
        "    logging_steps=2, report_to='none', use_cpu=True, learning_rate=3e-3, save_strategy='no',\n"
        "    disable_tqdm=True)\n"
        "hf = Trainer(model=lm, args=args, train_dataset=rows)\n"
        "result = hf.train()\n"
        "hf_weights = torch.cat([p.detach().flatten() for p in lm.parameters()])\n"
        "print('hf', hf.args.world_size, hf.state.global_step)"
    )
    assert run.ok, run.outputs
    assert _lines(run, "] hf ") == [
        "[rank 0] hf 2 12",
        "[rank 1] hf 2 12",
    ]
    assert _replicas_identical(nb, "hf_weights")
    losses = _value(
        nb,
        "import jupyter_shard\n"
        "[r['loss'] for r in jupyter_shard.history() if 'loss' in r and r['rank'] == 0]",
    )
    steps = sorted({s for r, s in _history(nb, "grad_norm")})
    assert steps == [2, 4, 6, 8, 10, 12], steps
    assert losses[-1] < losses[0], losses


@pytest.mark.timeout(600)  # the first DeepSpeed use on a machine may compile its shared-memory op
@pytest.mark.parametrize("stage", [2, 3])
def test_hugging_face_trainer_with_deepspeed_zero(nb: Any, tmp_path: Path, stage: int) -> None:
    run = nb.execute(
        "%%distributed\n"
        "lm = GPT2LMHeadModel(config)\n"
        f"zero = {{'zero_optimization': {{'stage': {stage}}}, 'bf16': {{'enabled': False}},\n"
        "        'train_micro_batch_size_per_gpu': 'auto', 'gradient_accumulation_steps': 'auto',\n"
        "        'train_batch_size': 'auto'}\n"
        f"args = TrainingArguments(output_dir={str(tmp_path)!r}, per_device_train_batch_size=4,\n"
        "    max_steps=6, logging_steps=2, report_to='none', use_cpu=True, learning_rate=3e-3,\n"
        "    save_strategy='no', disable_tqdm=True, deepspeed=zero)\n"
        "zero_trainer = Trainer(model=lm, args=args, train_dataset=rows)\n"
        "zero_trainer.train()\n"
        "engine = zero_trainer.model_wrapped\n"
        "print('zero', engine.zero_optimization_stage(), zero_trainer.args.world_size,\n"
        "      zero_trainer.state.global_step, type(engine).__name__)",
        timeout=540,
    )
    assert run.ok, run.outputs
    assert _lines(run, "] zero ") == [f"[rank {r}] zero {stage} 2 6 DeepSpeedEngine" for r in (0, 1)]


def test_accelerate(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "from accelerate import Accelerator\n"
        "acc = Accelerator(cpu=True)\n"
        "net = torch.nn.Linear(8, 1)\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.05)\n"
        "net, opt, loader = acc.prepare(net, opt, DataLoader(data, batch_size=8))\n"
        "for step, (x, y) in enumerate(loader):\n"
        "    loss = torch.nn.functional.mse_loss(net(x), y)\n"
        "    opt.zero_grad()\n"
        "    acc.backward(loss)\n"
        "    opt.step()\n"
        "    acc.log({'acc_loss': loss.item()}, step=step)\n"
        "acc_weights = torch.cat([p.detach().flatten() for p in acc.unwrap_model(net).parameters()])\n"
        "print('acc', acc.num_processes, acc.process_index,\n"
        "      acc.gather(torch.tensor([acc.process_index])).tolist())"
    )
    assert run.ok, run.outputs
    assert _lines(run, "] acc ") == [
        "[rank 0] acc 2 0 [0, 1]",
        "[rank 1] acc 2 1 [0, 1]",
    ]
    assert _replicas_identical(nb, "acc_weights")
    assert sorted(_history(nb, "acc_loss")) == sorted((r, s) for r in (0, 1) for s in range(8))
    _still_usable(nb)
