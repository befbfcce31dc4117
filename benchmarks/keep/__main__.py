"""Keeping a pool's state: attaching to a kept pool at 2, 4 and 8 ranks; what a kept pool costs while
no kernel holds it; suspending a 1.3 GB model at 2 ranks and resuming it at 2 and at 4, against
starting a pool and building and preparing the model again (which loses the training state).

Attach: a driving process starts a pool with ``keep``, gives it state and is killed with SIGKILL; this
process then attaches (``jupyter_shard.attach``) and lets go again, ``--repeats`` times; the time is
the call's, median over repeats. Cost while kept: each rank's CPU time over ``--idle`` seconds and its
resident memory, with no kernel attached and then held (idle) by this process. Suspend and resume:
fsdp on CPU ranks, ``--depth`` blocks of Linear(``--width``) with AdamW after one step; each phase
timed once (the model is large), the suspend's bytes on disk from the directory. Writes
``benchmarks/results/keep.md``. Run: ``.venv/bin/python -m benchmarks.keep [--quick]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import RESULTS, LoadWatch, cpu, format_loads, git_revision, target_table, write_section
from benchmarks.keep import disk

ATTACH_TARGET = 1.0  # seconds: attaching to a kept pool takes under a second

DRIVER = """
import json, os, signal, sys
from jupyter_shard import Pool
from jupyter_shard.launchers import resolve_spec
pool = Pool(spec=resolve_spec(device="cpu", strategy="ddp", **json.loads(sys.argv[1])), keep=600)
pool.start()
pool.run("import torch\\nstate = torch.ones(1000)")
print(json.dumps([r.handle.pid for r in pool.ranks]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

MODEL = """
import time, torch, torch.nn as nn
t0 = time.perf_counter()
torch.manual_seed(0)
net = nn.Sequential(*[nn.Linear({width}, {width}) for _ in range({depth})])
model, opt = shard.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
built = time.perf_counter() - t0
"""
STEP = """
x = torch.randn(4, {width}, generator=torch.Generator().manual_seed(shard.rank))
loss = model(x).pow(2).mean()
shard.backward(loss)
shard.step()
loss = loss.item()
"""


def _sink() -> Any:
    from jupyter_shard.pool.output import ConsoleSink

    return ConsoleSink(io.StringIO(), io.StringIO())


def _options(launcher: str, nproc: int) -> dict[str, Any]:
    """The pool: ``nproc`` ranks here, or two torchrun agents here with half of them each."""
    if launcher == "torchrun":
        return {"launcher": "torchrun", "hosts": "localhost,localhost", "nproc": nproc // 2}
    return {"nproc": nproc}


def attach_times(launcher: str, nproc: int, repeats: int, idle: float) -> dict[str, Any]:
    """Attach to a pool whose kernel was killed, ``repeats`` times; and its cost while kept."""
    from jupyter_shard.pool.keep import attach, kept_pools, stop

    options = json.dumps(_options(launcher, nproc))
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, options], capture_output=True, text=True, timeout=300
    )
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    time.sleep(0.5)
    kept = _cost(pids, idle)
    times = []
    pool = None
    for _ in range(repeats):
        began = time.perf_counter()
        pool = attach()
        times.append(time.perf_counter() - began)
        assert pool.run("int(state.sum())").value == {"text/plain": "1000"}
        pool.release()
        time.sleep(0.3)
    pool = attach()
    held = _cost(pids, idle)
    pool.release()
    for p in kept_pools():
        stop(p.id, force=True)
    return {"times": times, "kept": kept, "held": held}


def _cost(pids: list[int], seconds: float) -> dict[str, float]:
    """Mean CPU % per rank over ``seconds``, and the mean resident memory per rank (MiB)."""
    procs = [psutil.Process(pid) for pid in pids]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(seconds)
    after = [sum(p.cpu_times()[:2]) for p in procs]
    cpu_pct = statistics.mean((a - b) / seconds * 100 for a, b in zip(after, before, strict=True))
    rss = statistics.mean(p.memory_info().rss for p in procs) / 2**20
    return {"cpu": cpu_pct, "rss": rss}


def suspend_resume(width: int, depth: int, work: Path, repeats: int, check_bytes: int) -> dict[str, Any]:
    """Each measure a list over ``repeats`` rounds: in each, a fresh pool suspends, the disk's own
    rates are measured right after with as many bytes, and the suspend is resumed at 2 ranks (and,
    in the first round, at 4)."""
    from jupyter_shard import Pool
    from jupyter_shard.pool.suspend import resume, suspend
    from jupyter_shard.spec import LaunchSpec

    spec = LaunchSpec.create(nproc=2, device="cpu", strategy="fsdp")
    out: dict[str, Any] = {"model_bytes": depth * (width * width + width) * 4.0}
    lists: dict[str, list[float]] = {}
    directory = work / "suspended"
    for round_ in range(repeats):
        print(f"suspend and resume, round {round_ + 1} of {repeats} ...", flush=True)
        pool = Pool(spec=spec, sink=_sink())
        began = time.perf_counter()
        pool.start()
        pool.run(MODEL.format(width=width, depth=depth), timeout=1800)
        lists.setdefault("start_build_prepare", []).append(time.perf_counter() - began)
        pool.run(STEP.format(width=width), timeout=1800)
        out["loss_before"] = float(pool.pull("loss"))
        began = time.perf_counter()
        report = suspend(pool, directory)
        lists.setdefault("suspend", []).append(time.perf_counter() - began)
        out["disk_bytes"] = float(report.bytes)
        # the disk's own rates in this round, for as many bytes and writers as the suspend
        rate, files = disk.write_rate(work / "disk", int(report.bytes), writers=2)
        lists.setdefault("disk_write", []).append(rate)
        for key, fresh in (("disk_read", False), ("disk_read_fresh", True)):
            rate, cpu_per_gb = disk.read_cost(files, fresh=fresh)
            lists.setdefault(key, []).append(rate)
            lists.setdefault(f"{key}_cpu", []).append(cpu_per_gb)
        shutil.rmtree(work / "disk", ignore_errors=True)
        parts = [p for p in directory.rglob("*") if p.is_file()]
        for nproc in (2, 4) if round_ == 0 else (2,):
            disk.evict(parts)  # read from the disk, as the disk's read rate was
            began = time.perf_counter()
            resumed, resumed_report = resume(directory, {"nproc": nproc})
            lists.setdefault(f"resume_{nproc}", []).append(time.perf_counter() - began)
            lists.setdefault(f"load_{nproc}", []).append(resumed_report.load_seconds)
            resumed.run(STEP.format(width=width), timeout=1800)
            out[f"loss_after_resume_{nproc}"] = float(resumed.pull("loss"))
            resumed.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
    out["hash_cpu"], out["place_cpu"] = disk.check_cost(check_bytes)
    out["cores"] = len(os.sched_getaffinity(0))
    out.update(lists)
    size = out["disk_bytes"]
    out["write_shares"] = [size / t / r for t, r in zip(lists["suspend"], lists["disk_write"], strict=True)]
    out["read_shares"] = [size / t / r for t, r in zip(lists["load_2"], lists["disk_read"], strict=True)]
    out["fresh_shares"] = [
        size / t / r for t, r in zip(lists["load_2"], lists["disk_read_fresh"], strict=True)
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="attaches per world size")
    parser.add_argument(
        "--idle", type=float, default=10.0, help="seconds the cost while kept is measured over"
    )
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=19, help="19 × 4096² fp32: 1.28 GB")
    parser.add_argument("--sizes", default="2,4,8", help="world sizes to attach at (local ranks)")
    parser.add_argument(
        "--torchrun-sizes", default="2,4", help="world sizes to attach at, over two torchrun agents"
    )
    parser.add_argument(
        "--io-repeats", type=int, default=3, help="rounds of suspend, disk rates and resume (medians)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, a 34 MB model")
    parser.add_argument(
        "--results", default=str(RESULTS / "keep.md"), help="markdown file to write; - only prints"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.idle, args.width, args.depth, args.sizes = 2, 2.0, 1024, 8, "2"
        args.io_repeats = 1
        args.torchrun_sizes = "2"
    runs = [("local", int(n)) for n in args.sizes.split(",") if n]
    runs += [("torchrun", int(n)) for n in args.torchrun_sizes.split(",") if n]
    work = Path(tempfile.mkdtemp(prefix="jskeep-"))
    old_runtime = os.environ.get("JUPYTER_SHARD_RUNTIME_DIR")
    os.environ["JUPYTER_SHARD_RUNTIME_DIR"] = str(work)  # this run's kept pools only
    attaches: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        with LoadWatch() as watch:
            for launcher, n in runs:
                print(f"attach at {n} ranks ({launcher}) ...", flush=True)
                attaches[launcher, n] = attach_times(launcher, n, args.repeats, args.idle)
            check_bytes = (64 if args.quick else 512) << 20
            sr = suspend_resume(args.width, args.depth, work, args.io_repeats, check_bytes)
    finally:
        if old_runtime is None:
            os.environ.pop("JUPYTER_SHARD_RUNTIME_DIR", None)
        else:
            os.environ["JUPYTER_SHARD_RUNTIME_DIR"] = old_runtime
        shutil.rmtree(work, ignore_errors=True)
    write_section("\n".join(_report(attaches, sr, args, watch)) + "\n", args.results)
    return 0


def _report(
    attaches: dict[tuple[str, int], dict[str, Any]],
    sr: dict[str, Any],
    args: argparse.Namespace,
    watch: LoadWatch,
) -> list[str]:
    import torch

    loads = f"{format_loads(watch.before)} / {format_loads(watch.after)}"
    lines = [
        "# Keeping a pool's state: attach, the cost of a kept pool, suspend and resume",
        "",
        "Produced by `.venv/bin/python -m benchmarks.keep"
        + (" --quick" if args.quick else "")
        + "`; how to read it: "
        "`benchmarks/README.md`.",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; whole run {watch.seconds:.0f} s; "
        f"revision {git_revision()}",
        f"- CPU: {cpu()}; {platform.platform()}",
        f"- Python {platform.python_version()}; torch {torch.__version__}",
        f"- Load average (1, 5, 15 min) before / after: {loads}; other benchmarks or test runs seen: "
        f"{', '.join(sorted(watch.others)) or 'none'}",
        "",
        "## Attaching to a kept pool",
        "",
        "A pool (ddp, CPU ranks) kept by a process killed with SIGKILL; `jupyter_shard.attach()` from "
        f"another process, {args.repeats} times per world size (letting go in between); median and range "
        f"of the call. The cost of the kept pool: each rank's CPU time over {args.idle:g} s and its resident "
        "memory, mean over ranks, with no kernel attached and then attached and idle. `local`: ranks "
        "forked here; `torchrun`: two torchrun agents on this machine, half the ranks each, dialling back "
        "over TCP with CurveZMQ (the agents' own cost is not counted).",
        "",
        "| launcher | ranks | attach, median (s) | range (s) | CPU per rank, kept (%) "
        "| CPU per rank, attached idle (%) | RSS per rank (MiB) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    targets: list[tuple[str, str, bool | None]] = []
    for (launcher, n), a in attaches.items():
        t = a["times"]
        median = statistics.median(t)
        lines.append(
            f"| {launcher} | {n} | {median:.3f} | {min(t):.3f}–{max(t):.3f} | {a['kept']['cpu']:.2f} "
            f"| {a['held']['cpu']:.2f} | {a['kept']['rss']:.0f} |"
        )
        targets.append(
            (
                f"attach to a kept {launcher} pool of {n} CPU ranks in under {ATTACH_TARGET:g} s",
                f"{median:.3f} s",
                median < ATTACH_TARGET,
            )
        )
    m = sr["model_bytes"]
    sr = {
        **sr,
        **{f"{k}_gbs": [r / 1e9 for r in sr[k]] for k in ("disk_write", "disk_read", "disk_read_fresh")},
    }
    med = {k: statistics.median(v) for k, v in sr.items() if isinstance(v, list)}
    write_share, read_share = med["write_shares"], med["read_shares"]
    read_cpu = min(sr["disk_read_cpu"])  # the least seen, so that the ceiling stays an upper bound
    ceiling = disk.ceiling(read_cpu, sr["hash_cpu"], sr["place_cpu"], sr["cores"])
    size = sr["disk_bytes"]
    n = args.io_repeats

    def spread(key: str, fmt: str = "{:.1f}") -> str:
        values = sr[key]
        return fmt.format(med[key]) + (
            f" ({fmt.format(min(values))}–{fmt.format(max(values))})" if len(values) > 1 else ""
        )

    def share(key: str) -> str:
        values = sr[key]
        return f"{med[key]:.0%}" + (f" ({min(values):.0%}–{max(values):.0%})" if len(values) > 1 else "")

    targets += [
        ("suspend at 80 % of the disk's write rate or more", f"{write_share:.0%}", write_share >= 0.8),
        ("resume's load at 80 % of the disk's read rate or more", f"{read_share:.0%}", read_share >= 0.8),
    ]
    lines += [
        "",
        "## Suspend and resume",
        "",
        f"fsdp, {args.depth} × Linear({args.width}, {args.width}) = {m / 1e9:.2f} GB of fp32 parameters, "
        "AdamW after one step (its state twice the parameters). "
        + (
            f"{n} rounds, each with a fresh pool; median (range), the resharded resume once. "
            if n > 1
            else "Each phase once. "
        )
        + "The baseline is what a restart without a suspend costs: a fresh pool of 2 ranks that builds "
        "and prepares the model (the training state is then lost). A resume includes starting its pool.",
        "",
        "| | seconds | on disk (GB) |",
        "|---|---:|---:|",
        f"| start a pool of 2, build and prepare the model (baseline) | {spread('start_build_prepare')} | |",
        f"| `%dist_suspend` at 2 ranks (ranks end) | {spread('suspend')} | {size / 1e9:.2f} |",
        f"| `%dist_resume` at 2 ranks | {spread('resume_2')} | |",
        f"| `%dist_resume`, its load at 2 ranks | {spread('load_2')} | |",
        f"| `%dist_resume --nproc 4` (resharded) | {spread('resume_4')} | |",
        "",
        "Against the disk's own rate, measured in each round right after its suspend, with as many bytes "
        "and as many processes (`benchmarks/keep/disk.py`: written and fsynced in 16 MiB pieces; read back "
        "after the pages were dropped from the cache, as the suspend's files were before each resume). A "
        "resume's load is its time after its pool started (the ranks build the model while they check "
        "each file's digest, then DCP reads it). The share is each round's rate over that round's disk "
        "rate, median (range). The disk read into fresh memory (a buffer of each file's size, not written "
        "before, as a load must fill the model's new memory) is the floor any load meets on this machine; "
        "the target stays against the plain rate.",
        "",
        "| | GB/s | share of the disk's |",
        "|---|---:|---:|",
        f"| the disk, writing | {spread('disk_write_gbs', '{:.2f}')} | |",
        f"| `%dist_suspend` (all of it) | {size / med['suspend'] / 1e9:.2f} | {share('write_shares')} |",
        f"| the disk, reading | {spread('disk_read_gbs', '{:.2f}')} | |",
        f"| `%dist_resume`, its load at 2 ranks | {size / med['load_2'] / 1e9:.2f} "
        f"| {share('read_shares')} |",
        f"| the disk, reading into fresh memory | {spread('disk_read_fresh_gbs', '{:.2f}')} | |",
        f"| `%dist_resume`'s load, against that | {size / med['load_2'] / 1e9:.2f} "
        f"| {share('fresh_shares')} |",
        "",
        "What a load must do to each byte costs CPU time, here in CPU seconds per GB, the least seen: "
        "reading it from the disk with `read` (the readers above, user and system time charged to them; "
        "the block layer's interrupts and the host's work are not), checking its SHA-256 against the "
        "signed manifest (the project's own digest, one thread) and the first write of the fresh memory "
        "it lands in, 4 KiB pages (`touch`, which a resume runs on its targets while the files are "
        f"checked; torch on one thread). Paying these, no load can pass {sr['cores']} cores over their "
        "sum, even with every core busy all the time and the three overlapping perfectly. The resume "
        "does more than that: it reads each file twice (its digest from the disk, then its tensors from "
        "the page cache) and builds the model meanwhile.",
        "",
        "| | CPU s per GB | GB/s | share of the disk's read rate |",
        "|---|---:|---:|---:|",
        f"| reading the disk | {read_cpu:.2f} | | |",
        f"| reading the disk into fresh memory | {min(sr['disk_read_fresh_cpu']):.2f} | | |",
        f"| SHA-256 | {sr['hash_cpu']:.2f} | | |",
        f"| first write of fresh memory | {sr['place_cpu']:.2f} | | |",
        f"| the most a checked load can reach on {sr['cores']} cores | "
        f"{read_cpu + sr['hash_cpu'] + sr['place_cpu']:.2f} | {ceiling / 1e9:.2f} "
        f"| {ceiling / (med['disk_read_gbs'] * 1e9):.0%} |",
        f"| `%dist_resume`, its load at 2 ranks | | {size / med['load_2'] / 1e9:.2f} | {read_share:.0%} |",
        "",
        f"The step before the suspend had loss {sr['loss_before']:.6f}; the first step after resuming at 2 "
        f"and 4 ranks: {sr['loss_after_resume_2']:.6f} and {sr['loss_after_resume_4']:.6f} (each rank's own "
        "batch at 2; rank 0's namespace at 4).",
        "",
        "### Targets",
        "",
        *target_table(targets),
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
