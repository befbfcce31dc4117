"""The method of comparing training under ``%%distributed`` with the same script under ``torchrun``.

Each round trains the same model (about 50M parameters by default) on 2 CPU
ranks two ways at once, taking turns step by step:

- **jupyter_shard**: a :class:`jupyter_shard.Pool` runs the training cell (what ``%%distributed``
  does), with output capture, the I/O thread and the lifeline all live;
- **torchrun**: ``python -m torch.distributed.run --nproc-per-node 2`` runs a worker that builds
  the same ``shard`` helper directly (no pool) and runs the identical training code.

Both run at once; before each step a side's rank 0 waits for its turn on a named pipe and after
it hands the turn over, so no two steps overlap and each of ``--steps`` timed steps (after
``--warmup`` untimed ones) of one side lies between two of the other's. A shared VM's speed drifts
by tens of percent between minutes; interleaved this way, both sides see the same drift. While a
side steps, the other side's ranks are stopped (SIGSTOP), so their threads take no CPU from it. Which
side starts and takes the first turn alternates from round to round (the second starts once the
first one's ranks are in the training cell).

Shared by ``strategies`` (per strategy, ``__main__.py``) and ``frameworks`` (a Lightning Trainer),
with the per-round figures both report: the paired ratio, step times and training-thread CPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
}

THROUGHPUT_TARGET = 0.98  # at least this share of torchrun's throughput, every strategy
PATIENCE = 600  # seconds one side waits for the other's turn (a step plus the other side's start)

TRAIN = """
import contextlib, glob, json, os, resource, select, signal, time, torch
from torch import nn
torch.manual_seed(0)
width, depth, batch = {width}, {depth}, {batch}
model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
model, opt = shard.prepare(model, opt)
x = torch.randn(batch, width, generator=torch.Generator().manual_seed(shard.rank))
# Turns: this side's rank 0 waits for the turn on its pipe, freezes the other side's ranks
# (SIGSTOP: none of their threads runs during this side's step), and after the step wakes them and
# hands the turn over through their pipe. Each rank leaves its pid for the other side to freeze.
turns, me, other = {turns!r}, {me!r}, {other!r}
with open(os.path.join(turns, f"{{me}}.{{shard.rank}}.pid.tmp"), "w") as fh:
    fh.write(str(os.getpid()))
os.replace(fh.name, fh.name[:-4])
turn = os.open(os.path.join(turns, me), os.O_RDWR) if shard.rank == 0 else -1
handoff = os.open(os.path.join(turns, other), os.O_RDWR) if shard.rank == 0 else -1
peers = []

def wait_turn():
    global peers
    if shard.rank == 0:
        if not select.select([turn], [], [], {patience})[0]:
            raise TimeoutError("the other side of the benchmark never handed over its turn")
        os.read(turn, 1)
        peers = [int(open(f).read()) for f in glob.glob(os.path.join(turns, f"{{other}}.*.pid"))]
        for pid in peers:
            with contextlib.suppress(ProcessLookupError):  # the other side may have failed and gone
                os.kill(pid, signal.SIGSTOP)
    shard.barrier()  # brings rank 1 along

def pass_turn():
    if shard.rank == 0:
        for pid in peers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        os.write(handoff, b"x")

times, cpu = [], []
for step in range({warmup} + {steps}):
    wait_turn()
    started, cpu_started = time.perf_counter(), time.thread_time()
    loss = model(x).pow(2).mean()
    shard.backward(loss)
    if step == {warmup} + {steps} - 1:
        held = shard.memory()  # gradients still held: between backward and step
    shard.step()
    cpu.append(time.thread_time() - cpu_started)  # the training thread's own CPU, barrier excluded
    shard.barrier()
    times.append(time.perf_counter() - started)
    pass_turn()
wait_turn()  # one more turn: this side winds down only after the other side's last step
pass_turn()
report = json.dumps({{
    "times": times[{warmup}:],
    "cpu": cpu[{warmup}:],
    "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "held": {{k: held.get(k, 0) for k in ("parameters", "gradients", "optimizer")}},
}})
"""

WORKER = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from jupyter_shard.rank.shard import Shard, set_current
dist.init_process_group("gloo")
rank = dist.get_rank()
shard = Shard(rank, int(os.environ["LOCAL_RANK"]), dist.get_world_size(), torch.device("cpu"),
              {strategy!r}, lambda *a: None, {options!r})
set_current(shard)
exec(compile({train!r}, "train", "exec"))
with open(os.path.join({out!r}, f"rank-{{rank}}.json"), "w") as fh:
    fh.write(report)
dist.destroy_process_group()
"""


def _options(entry: dict[str, Any]) -> dict[str, Any]:
    return {"precision": "32", "accumulate": 1, "zero_stage": entry.get("zero_stage"), "offload": "none"}


def run_pool(entry: dict[str, Any], code: str, scratch: Path) -> list[dict[str, Any]]:
    from jupyter_shard import LaunchSpec, Pool
    from jupyter_shard.pool.output import ConsoleSink

    spec = LaunchSpec.create(
        nproc=2, device="cpu", strategy=entry["strategy"], zero_stage=entry.get("zero_stage")
    )
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(spec=spec, log_dir=scratch / "logs", sink=sink) as pool:
        pool.run(code)
        return [json.loads(v) for _, v in sorted(pool.pull_all("report").items())]


def start_torchrun(
    entry: dict[str, Any], code: str, scratch: Path, stderr: Any = subprocess.PIPE
) -> tuple[subprocess.Popen[bytes], Path]:
    out = Path(tempfile.mkdtemp(dir=scratch))
    worker = out / "worker.py"
    worker.write_text(
        WORKER.format(
            root=str(ROOT), strategy=entry["strategy"], options=_options(entry), train=code, out=str(out)
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(worker),
    ]
    # a session of its own, so that killpg ends the agent (its workers, in sessions of their own,
    # are ended through the pids they leave)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    return proc, out


def train_code(params: dict[str, int], turns: Path, me: str, other: str) -> str:
    """The training cell, identical on both sides but for which side it names itself."""
    return textwrap.dedent(TRAIN).format(**params, patience=PATIENCE, turns=str(turns), me=me, other=other)


def _turn_pipes(turns: Path, sides: tuple[str, str], first: str) -> dict[str, int]:
    """One named pipe per side, held open here, with the first turn already in ``first``'s."""
    fds = {}
    for side in sides:
        os.mkfifo(turns / side)
        fds[side] = os.open(turns / side, os.O_RDWR)
    os.write(fds[first], b"x")  # the first turn is there before either side is
    return fds


def _kill_torchrun(turns: Path, side: str, proc: subprocess.Popen[bytes]) -> None:
    """End a torchrun side still running: its agent's group, and its workers (sessions of their own)."""
    if proc.poll() is None:
        _signal_ranks(turns, side, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _signal_ranks(turns: Path, side: str, sig: signal.Signals) -> None:
    """Signal every rank of a side that has left its pid (after a failure: none is left frozen)."""
    for f in turns.glob(f"{side}.*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(f.read_text()), sig)


def run_pair(
    entry: dict[str, Any], params: dict[str, int], scratch: Path, pool_first: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One round of ``entry``'s training, pool against torchrun (see :func:`interleave`)."""
    return interleave(
        lambda turns, me, other: train_code(params, turns, me, other),
        lambda code: run_pool(entry, code, scratch),
        lambda code: start_torchrun(entry, code, scratch),
        2 * params["warmup"] + 2 * params["steps"] + 2,
        scratch,
        pool_first,
    )


def interleave(
    code: Callable[[Path, str, str], str],
    run_in_pool: Callable[[str], list[dict[str, Any]]],
    start_in_torchrun: Callable[[str], tuple[subprocess.Popen[bytes], Path]],
    turns_in_a_run: int,
    scratch: Path,
    pool_first: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One round: both sides run at once and take turns step by step; returns (pool, torchrun).

    ``code(turns, me, other)`` is the side's training code, taking its turns in ``turns``; the pool
    runs it as a cell, torchrun as a script whose ranks leave ``rank-<k>.json`` in the returned
    directory. Each side's rank 0 waits on its own pipe for the turn and hands it over through the
    other's, so no two steps ever overlap and every step of one side sits between two of the other's:
    drift on a shared machine over seconds and minutes reaches both sides alike. While one side
    steps, the other's ranks are stopped (SIGSTOP), so their background threads cost the stepping
    side nothing; the process that owns the pool and torchrun's agent keep running throughout. The
    side with the first turn also starts first: the other starts once its ranks are in the training
    cell. If torchrun fails, the pool's ranks are woken and given all ``turns_in_a_run`` turns so its
    cell ends; if the pool fails, torchrun is killed.
    """
    turns = Path(tempfile.mkdtemp(dir=scratch))
    fds = _turn_pipes(turns, ("pool", "torchrun"), "pool" if pool_first else "torchrun")
    started, abandoned = threading.Event(), threading.Event()
    torchrun: list[tuple[subprocess.Popen[bytes], Path]] = []
    err: list[bytes] = []

    def start_and_watch() -> None:  # starts torchrun and reads its stderr; if it fails, wakes the pool
        if pool_first and not _wait_for_ranks(turns, "pool", gone=abandoned):
            return
        proc, out = start_in_torchrun(code(turns, "torchrun", "pool"))
        torchrun.append((proc, out))
        started.set()
        err.append(proc.communicate()[1])
        if proc.returncode != 0:
            _signal_ranks(turns, "pool", signal.SIGCONT)
            os.write(fds["pool"], b"x" * turns_in_a_run)

    watcher = threading.Thread(target=start_and_watch, daemon=True)
    watcher.start()
    try:
        if not pool_first:
            if not started.wait(PATIENCE):
                raise RuntimeError("torchrun did not start")
            _wait_for_ranks(turns, "torchrun", gone=torchrun[0][0])
        mine = run_in_pool(code(turns, "pool", "torchrun"))
        watcher.join(PATIENCE)
    finally:
        abandoned.set()  # a torchrun side not started yet never will be
        if torchrun:  # still running: nothing hands it turns any more
            _kill_torchrun(turns, "torchrun", torchrun[0][0])
        watcher.join()
        for fd in fds.values():
            os.close(fd)
    proc, out = torchrun[0]
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{err[0].decode(errors='replace')[-4000:]}")
    return mine, [json.loads((out / f"rank-{k}.json").read_text()) for k in range(2)]


def _wait_for_ranks(turns: Path, side: str, gone: subprocess.Popen[bytes] | threading.Event) -> bool:
    """Wait until both ranks of a side are in the training cell; False if it is ``gone`` first."""
    deadline = time.monotonic() + PATIENCE
    while len(list(turns.glob(f"{side}.*.pid"))) < 2:
        ended = gone.is_set() if isinstance(gone, threading.Event) else gone.poll() is not None
        if ended or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_control(
    entry: dict[str, Any], params: dict[str, int], scratch: Path, a_first: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One round of torchrun against itself, interleaved exactly as :func:`run_pair`: the noise floor."""
    turns = Path(tempfile.mkdtemp(dir=scratch))
    fds = _turn_pipes(turns, ("a", "b"), "a" if a_first else "b")
    started: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for me, other in ("ab", "ba") if a_first else ("ba", "ab"):
            with open(turns / f"{me}.log", "wb") as log:
                started[me] = start_torchrun(entry, train_code(params, turns, me, other), scratch, log)
            if len(started) == 1 and not _wait_for_ranks(turns, me, gone=started[me][0]):
                break
        deadline = time.monotonic() + PATIENCE + 60 * (params["warmup"] + params["steps"])
        while any(proc.poll() is None for proc, _ in started.values()):
            failed = [me for me, (proc, _) in started.items() if proc.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for me, (proc, _) in started.items():
            _kill_torchrun(turns, me, proc)
        for fd in fds.values():
            os.close(fd)
    for me, (proc, _) in started.items():
        if proc.returncode != 0:
            log_tail = (turns / f"{me}.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"torchrun (control side {me}) failed ({proc.returncode}):\n{log_tail}")
    if len(started) < 2:
        raise RuntimeError("torchrun (control) did not start")
    a_ranks, b_ranks = (
        [json.loads((started[me][1] / f"rank-{k}.json").read_text()) for k in range(2)] for me in "ab"
    )
    return a_ranks, b_ranks


def predicted(name: str, psi: int, n: int) -> dict[str, float]:
    """Bytes per rank for fp32 training with Adam, by where each part lives.

    torch's Adam (ddp, fsdp) keeps two moments: 8Ψ. DeepSpeed's ZeRO optimizer also keeps an fp32
    master copy of the parameters, so its optimizer state is the paper's K = 12 bytes per parameter.
    """
    p, g = 4.0 * psi, 4.0 * psi
    table = {
        "ddp": (p, g, 8.0 * psi),
        "fsdp": (p / n, g / n, 8.0 * psi / n),
        "zero2": (p, g / n, 12.0 * psi / n),
        "zero3": (p / n, g / n, 12.0 * psi / n),
    }
    params, grads, optimizer = table[name]
    return {"parameters": params, "gradients": grads, "optimizer": optimizer}


def paired_ratios(ours: list[list[dict[str, Any]]], theirs: list[list[dict[str, Any]]]) -> list[float]:
    """Per round, the other side's median step time over this side's."""
    return [
        statistics.median(step_times([b])) / statistics.median(step_times([a]))
        for a, b in zip(ours, theirs, strict=True)
    ]


def step_times(runs: list[list[dict[str, Any]]]) -> list[float]:
    """Per step, the slowest rank's time (the step is done when every rank is), over all runs."""
    return [max(r["times"][i] for r in ranks) for ranks in runs for i in range(len(ranks[0]["times"]))]


def cpu_per_step(runs: list[list[dict[str, Any]]]) -> list[float]:
    """Every rank's training-thread CPU seconds per step (forward, backward, optimizer step)."""
    return [t for ranks in runs for r in ranks for t in r["cpu"]]
