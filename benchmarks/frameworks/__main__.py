"""A Lightning ``Trainer`` fit under ``%%distributed`` against the same script under ``torchrun``.

Each round fits the same model (an MLP of ``--depth`` Linear(``--width``, ``--width``) layers built
from a fixed seed, on synthetic data made from a fixed seed; about 4M parameters by default) with
``lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp")``, Lightning unchanged, two ways at
once:

- **jupyter_shard**: a :class:`jupyter_shard.Pool` of 2 CPU ranks (what ``%%distributed`` runs on)
  runs the code as one cell; to Lightning its ranks are torchrun workers;
- **torchrun**: ``python -m torch.distributed.run --standalone --nproc-per-node 2`` runs a script
  made of the identical code.

The two take turns step by step as in ``strategies/interleave.py`` (whose helpers this script imports): a
Lightning callback on each side's rank 0 waits for its turn on a named pipe, stops the other side's
ranks (SIGSTOP) while its own step runs, and hands the turn over after it. Which side starts and takes
the first turn alternates from round to round. A timed step is one whole turn of Lightning's training
loop, from the end of one step (after a barrier) to the end of the next: fetching the batch, every
callback's hooks, the forward, backward and optimizer step, and logging (``self.log`` every step; in a
pool Lightning also feeds the dashboard's logger). ``--warmup`` steps are not timed.

It reports the median step time on each side per round and over all rounds, and the throughput ratio
torchrun step time / jupyter_shard step time (1.0: no overhead; target ≥ 0.98), taken within each
round and given as the median over rounds. Run:
``.venv/bin/python -m benchmarks.frameworks [--rounds 10] [--steps 30] [--warmup 5] [--width 1024]``
(writes ``benchmarks/results/frameworks.md``; ``--results -`` only prints).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, LoadWatch, cpu, format_loads, target_table, write_section
from benchmarks.strategies.interleave import (
    PATIENCE,
    THROUGHPUT_TARGET,
    cpu_per_step,
    interleave,
    paired_ratios,
    run_pool,
    step_times,
)

# The code both sides run: a cell on the pool, a script under torchrun. It ends with ``report`` (JSON)
# on every rank. The ``Turns`` callback does the turn-taking and the timing (see the module docstring).
FIT = """
import contextlib, glob, json, os, resource, select, signal, time
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

group_before_fit = torch.distributed.is_initialized()
width, depth, batch, warmup, steps = {width}, {depth}, {batch}, {warmup}, {steps}
turns, me, other, patience = {turns!r}, {me!r}, {other!r}, {patience}


class MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Turns(L.Callback):
    # Rank 0 waits for this side's turn on its pipe, stops the other side's ranks (SIGSTOP: none of
    # their threads runs during this side's step), and after the step wakes them and hands the turn
    # over through their pipe. A timed step runs from one step's end (after a barrier) to the next
    # one's: all of Lightning's loop between them is in it.
    def __init__(self):
        self.times, self.cpu, self.peers = [], [], []

    def on_train_start(self, trainer, pl_module):
        self.rank = trainer.global_rank
        pid = os.path.join(turns, f"{{me}}.{{self.rank}}.pid")
        with open(pid + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(pid + ".tmp", pid)
        if self.rank == 0:
            self.turn = os.open(os.path.join(turns, me), os.O_RDWR)
            self.handoff = os.open(os.path.join(turns, other), os.O_RDWR)

    def wait_turn(self):
        if self.rank == 0:
            if not select.select([self.turn], [], [], patience)[0]:
                raise TimeoutError("the other side of the benchmark never handed over its turn")
            os.read(self.turn, 1)
            self.peers = []
            for path in glob.glob(os.path.join(turns, f"{{other}}.*.pid")):
                with open(path) as fh:
                    self.peers.append(int(fh.read()))
            for peer in self.peers:
                with contextlib.suppress(ProcessLookupError):  # the other side may have failed and gone
                    os.kill(peer, signal.SIGSTOP)
        torch.distributed.barrier()  # brings rank 1 along
        self.started, self.cpu_started = time.perf_counter(), time.thread_time()

    def pass_turn(self):
        if self.rank == 0:
            for peer in self.peers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(peer, signal.SIGCONT)
            os.write(self.handoff, b"x")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.times:
            self.wait_turn()  # the first turn; later ones are taken at the end of the step before

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.cpu.append(time.thread_time() - self.cpu_started)  # the training thread's own CPU
        torch.distributed.barrier()
        self.times.append(time.perf_counter() - self.started)
        self.pass_turn()
        if len(self.times) < warmup + steps:
            self.wait_turn()

    def on_train_end(self, trainer, pl_module):
        self.wait_turn()  # one more turn: this side winds down only after the other side's last step
        self.pass_turn()
        if self.rank == 0:
            os.close(self.turn)
            os.close(self.handoff)


g = torch.Generator().manual_seed(0)
xs = torch.randn(2 * batch * (warmup + steps), width, generator=g)
data = TensorDataset(xs, xs[:, :8].sum(1, keepdim=True) + 0.1 * torch.randn(len(xs), 1, generator=g))
turns_callback = Turns()
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, max_steps=warmup + steps,
    log_every_n_steps=1, callbacks=[turns_callback], enable_progress_bar=False,
    enable_model_summary=False, logger=False, enable_checkpointing=False,
)
model = MLP()
trainer.fit(model, DataLoader(data, batch_size=batch))
report = json.dumps({{
    "times": turns_callback.times[warmup:],
    "cpu": turns_callback.cpu[warmup:],
    "global_step": trainer.global_step,
    "threads": torch.get_num_threads(),
    "group_before_fit": group_before_fit,
    "strategy": type(trainer.strategy).__name__,
    "environment": type(trainer.strategy.cluster_environment).__name__,
    "loggers": [type(logger).__name__ for logger in trainer.loggers],
    "parameters": sum(p.numel() for p in model.parameters()),
    "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}})
"""

# What the torchrun script adds after the code: each rank leaves its report in a file.
SAVE = """
with open(os.path.join({out!r}, f"rank-{{trainer.global_rank}}.json"), "w") as fh:
    fh.write(report)
"""


def fit_code(params: dict[str, int], turns: Path, me: str, other: str) -> str:
    """The Lightning code, identical on both sides but for which side it names itself."""
    return textwrap.dedent(FIT).format(**params, patience=PATIENCE, turns=str(turns), me=me, other=other)


def start_torchrun(code: str, scratch: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """``torchrun --standalone --nproc-per-node 2`` on a script of ``code``; reports land in the folder."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    script = out / "fit.py"
    script.write_text(code + textwrap.dedent(SAVE).format(out=str(out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # a session of its own, so that killpg ends the agent (its workers are ended through their pids)
    proc = subprocess.Popen(
        [*cmd, str(script)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    return proc, out


def run_round(
    params: dict[str, int], scratch: Path, pool_first: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One round, both sides at once taking turns step by step (``strategies.interleave``)."""
    return interleave(
        lambda turns, me, other: fit_code(params, turns, me, other),
        lambda code: run_pool({"strategy": "none"}, code, scratch),
        lambda code: start_torchrun(code, scratch),
        2 * params["warmup"] + 2 * params["steps"] + 2,
        scratch,
        pool_first,
    )


def _command(argv: list[str]) -> str:
    python = Path(sys.executable)
    shown = os.path.relpath(python, ROOT) if python.is_relative_to(ROOT) else str(python)
    return shlex.join([shown, "-m", "benchmarks.frameworks", *argv])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved runs, each with new processes")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 4 small steps")
    parser.add_argument(
        "--results", default=str(RESULTS / "frameworks.md"), help="markdown file to write; - only prints"
    )
    args = parser.parse_args(argv)
    command = _command(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.width = 2, 4, 2, 256
    params = {k: getattr(args, k) for k in ("width", "depth", "batch", "warmup", "steps")}
    ours: list[list[dict[str, Any]]] = []
    theirs: list[list[dict[str, Any]]] = []
    firsts: list[str] = []
    with LoadWatch() as watch, tempfile.TemporaryDirectory(prefix="jsbench-") as tmp:
        for round_ in range(args.rounds):  # which side starts and takes the first turn alternates
            pool_first = round_ % 2 == 0
            firsts.append("jupyter_shard" if pool_first else "torchrun")
            print(f"round {round_ + 1}/{args.rounds} ({firsts[-1]} first) ...", flush=True)
            mine, other = run_round(params, Path(tmp), pool_first)
            ours.append(mine)
            theirs.append(other)
            a, b = (statistics.median(step_times([r])) for r in (mine, other))
            print(f"round {round_ + 1}: step {a * 1e3:.1f} ms against {b * 1e3:.1f} ms", flush=True)
    write_section("\n".join(_report(ours, theirs, firsts, args, command, watch)) + "\n", args.results)
    return 0


def _report(
    ours: list[list[dict[str, Any]]],
    theirs: list[list[dict[str, Any]]],
    firsts: list[str],
    args: argparse.Namespace,
    command: str,
    watch: LoadWatch,
) -> list[str]:
    import lightning
    import torch

    paired = paired_ratios(ours, theirs)
    ratio, lo, hi = statistics.median(paired), min(paired), max(paired)
    step_ours, step_theirs = statistics.median(step_times(ours)), statistics.median(step_times(theirs))
    cpu_ratio = statistics.median(cpu_per_step(theirs)) / statistics.median(cpu_per_step(ours))
    pool_rank, torchrun_rank = ours[0][0], theirs[0][0]
    others = ", ".join(sorted(watch.others)) or "none"
    lines = [
        "# Frameworks: a Lightning Trainer under `%%distributed` vs the same script under torchrun",
        "",
        f"Produced by `{command}`; how to read it: `benchmarks/README.md`.",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; whole run {watch.seconds:.0f} s",
        f"- CPU: {cpu()}; {platform.platform()}; Python {platform.python_version()}",
        f"- torch {torch.__version__}, lightning {lightning.__version__}",
        f"- Load average (1, 5, 15 min) before {format_loads(watch.before)}, "
        f"after {format_loads(watch.after)}; other benchmarks or test runs seen: {others}",
        "",
        '`lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp", '
        f"max_steps={args.warmup + args.steps}, log_every_n_steps=1, logger=False, ...).fit(...)` "
        "of an MLP of "
        f"{args.depth} × Linear({args.width}, {args.width}) + ReLU and Linear({args.width}, 1), "
        f"{pool_rank['parameters'] / 1e6:.2f}M parameters from a fixed seed, Adam, MSE on synthetic data "
        f"from a fixed seed, batch {args.batch} per rank, `self.log` every step; 2 CPU ranks (gloo). "
        f"{args.rounds} rounds; in each, jupyter_shard (a `Pool` running the code as a cell) and torchrun "
        f"(`torch.distributed.run --standalone --nproc-per-node 2` running it as a script) run at the same "
        f"time and take turns step by step, the other side's ranks stopped during each step; which side "
        f"starts and goes first alternates. {args.steps} timed steps per side and round after "
        f"{args.warmup} warm-up. A step is one turn of Lightning's training loop, end of a step to end of "
        "the next (batch fetch, callback hooks, forward, backward, optimizer step, logging), the slower "
        "rank's time.",
        "",
        f"Lightning saw, jupyter_shard / torchrun: strategy {pool_rank['strategy']} / "
        f"{torchrun_rank['strategy']}, cluster environment {pool_rank['environment']} / "
        f"{torchrun_rank['environment']}, torch threads per rank {pool_rank['threads']} / "
        f"{torchrun_rank['threads']}, process group already initialized before the fit "
        f"{pool_rank['group_before_fit']} / {torchrun_rank['group_before_fit']}, loggers "
        f"{pool_rank['loggers'] or 'none'} / {torchrun_rank['loggers'] or 'none'}; optimizer steps "
        f"{pool_rank['global_step']} / {torchrun_rank['global_step']}.",
        "",
        "Throughput ratio = torchrun's step time / jupyter_shard's (1.0: no overhead), within each round "
        "(the two sides' steps interleaved, so drift of the machine's speed reaches both); the median "
        "row gives the median over all steps of all rounds for the step columns, and the median over "
        "rounds of the ratio (pooled: the ratio of the step medians). Training-thread CPU ratio: the "
        "same for the CPU seconds of the thread that trains (`time.thread_time()`, barriers excluded).",
        "",
        "| round | first | step, jupyter_shard (ms) | step, torchrun (ms) | throughput ratio "
        "| training-thread CPU ratio |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for i, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        a, b = statistics.median(step_times([mine])), statistics.median(step_times([other]))
        c = statistics.median(cpu_per_step([other])) / statistics.median(cpu_per_step([mine]))
        lines.append(f"| {i + 1} | {firsts[i]} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.3f} | {c:.3f} |")
    lines += [
        f"| **median** | | **{step_ours * 1e3:.1f}** | **{step_theirs * 1e3:.1f}** | **{ratio:.3f}** "
        f"({lo:.3f}–{hi:.3f}; pooled {step_theirs / step_ours:.3f}) | {cpu_ratio:.3f} |",
        "",
        "Peak RSS per rank (the larger rank, median over rounds): jupyter_shard "
        f"{statistics.median(max(r['maxrss'] for r in ranks) for ranks in ours) / 2**20:.0f} MiB, torchrun "
        f"{statistics.median(max(r['maxrss'] for r in ranks) for ranks in theirs) / 2**20:.0f} MiB.",
        "",
        "### Targets",
        "",
    ]
    name = f"Lightning Trainer throughput ≥ {THROUGHPUT_TARGET} of torchrun's, ddp, 2 CPU ranks"
    return [*lines, *target_table([(name, f"{ratio:.3f} ({lo:.3f}–{hi:.3f})", ratio >= THROUGHPUT_TARGET)])]


if __name__ == "__main__":
    raise SystemExit(main())
