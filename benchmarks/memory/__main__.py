"""Memory per rank: a ``jupyter_shard`` pool rank against a bare torchrun worker running the same code.

The same small DDP training script (plain ``torch.nn.parallel.DistributedDataParallel``, Adam,
``--steps`` steps, then ``gc.collect()``) runs three ways on 2 CPU ranks, alternating over
``--rounds`` rounds so drift on the machine hits each alike:

* **pool, zygote**: as three cells (setup, training, measurement) on
  ``jupyter_shard.Pool(nproc=2, device="cpu", strategy="ddp")``, ranks forked from the preloaded
  zygote (the default);
* **pool, spawn**: the same with ``JUPYTER_SHARD_ZYGOTE=0`` (each rank a fresh interpreter);
* **torchrun**: ``python -m torch.distributed.run --standalone --nproc-per-node 2`` running a worker
  that only calls ``init_process_group("gloo")`` and then the same code.

Each rank reads its own ``psutil.Process().memory_full_info()`` after the last step: RSS (resident
pages, shared ones counted in full), USS (pages only this process holds) and PSS (shared pages split
among the processes sharing them). Forked ranks share the zygote's pages, so their USS and PSS fall
while RSS does not. The helper beside the ranks is measured too: the zygote, and torchrun's agent.
Writes ``benchmarks/results/memory.md`` and ``memory-per-rank.png``.
Run: ``.venv/bin/python -m benchmarks.memory [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import RESULTS, LoadWatch, pyplot, target_table, write_section

NPROC = 2
TARGET_MB = 50.0
METRICS = ("rss", "uss", "pss")
SPLIT = ("RssAnon", "RssFile")
VARIANTS = {"zygote": "pool, zygote (default)", "spawn": "pool, spawn", "torchrun": "torchrun"}

SETUP = """
import gc, json, os, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
torch.manual_seed(0)
torch.set_num_threads(1)
model = DistributedDataParallel(
    nn.Sequential(nn.Linear({width}, {width}), nn.ReLU(), nn.Linear({width}, {width}), nn.ReLU(),
                  nn.Linear({width}, 1))
)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn({batch}, {width}), torch.randn({batch}, 1)
"""
TRAIN = """
for _ in range({steps}):
    opt.zero_grad(set_to_none=True)
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
"""
MEASURE = """
import psutil

from benchmarks.common import RESULTS, LoadWatch, pyplot, target_table, write_section
gc.collect()
mem = psutil.Process().memory_full_info()
split = dict(line.split(":") for line in open("/proc/self/status") if line.startswith(("RssAnon", "RssFile")))
report = json.dumps({"rank": dist.get_rank(), "pid": os.getpid(),
                     "rss": mem.rss, "uss": mem.uss, "pss": mem.pss,
                     **{k: int(v.split()[0]) * 1024 for k, v in split.items()}})
"""
WORKER = """
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
{code}
with open(os.path.join({out!r}, f"rank-{{dist.get_rank()}}.json"), "w") as fh:
    fh.write(report)
while not os.path.exists({release!r}):  # stay alive while the agent is measured
    time.sleep(0.05)
dist.destroy_process_group()
"""


def _memory(proc: psutil.Process) -> dict[str, int]:
    mem = proc.memory_full_info()
    return {"rss": mem.rss, "uss": mem.uss, "pss": mem.pss}


def run_pool(cells: list[str], scratch: Path, zygote: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Per-rank memory after the cells, and the zygote's (empty when ranks are spawned)."""
    from jupyter_shard import Pool
    from jupyter_shard.launchers import zygote as zygotes
    from jupyter_shard.pool.output import ConsoleSink

    os.environ["JUPYTER_SHARD_ZYGOTE"] = "1" if zygote else "0"
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(nproc=NPROC, device="cpu", strategy="ddp", log_dir=scratch / "logs", sink=sink) as pool:
        for cell in cells:
            pool.run(cell)
        ranks = [json.loads(v) for _, v in sorted(pool.pull_all("report").items())]
        helper: dict[str, int] = {}
        if zygote:
            found = [
                p
                for p in psutil.Process().children(recursive=True)
                if "jupyter_shard.launchers.zygote" in " ".join(p.cmdline())
            ]
            helper = _memory(found[0]) if found else {}
    zygotes.close_all()  # a zygote left alive would share pages with the next variant's ranks
    return ranks, helper


def run_torchrun(code: str, scratch: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Per-rank memory of bare torchrun workers, and the agent's while they are still alive."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    release = out / "release"
    worker = out / "worker.py"
    worker.write_text(WORKER.format(code=code, out=str(out), release=str(release)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC)]
    agent = subprocess.Popen(
        [*cmd, str(worker)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        paths = [out / f"rank-{k}.json" for k in range(NPROC)]
        deadline = time.monotonic() + 600
        while not all(p.exists() for p in paths):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"torchrun ended or hung before reporting:\n{agent.communicate()[1]}")
            time.sleep(0.05)
        time.sleep(0.2)  # a report file exists once its contents are written and closed
        helper = _memory(psutil.Process(agent.pid))
        release.touch()
        _, err = agent.communicate(timeout=120)
        if agent.returncode != 0:
            raise RuntimeError(f"torchrun failed ({agent.returncode}):\n{err}")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    return [json.loads(p.read_text()) for p in paths], helper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each variant")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--results", default=str(RESULTS / "memory.md"), help="'-' prints only")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round of 5 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 5
    cells = [
        textwrap.dedent(SETUP).format(width=args.width, batch=args.batch),
        textwrap.dedent(TRAIN).format(steps=args.steps),
        textwrap.dedent(MEASURE),
    ]
    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in VARIANTS}
    helpers: dict[str, list[dict[str, int]]] = {v: [] for v in VARIANTS}
    with LoadWatch() as watch, tempfile.TemporaryDirectory(prefix="jsbench-mem-") as tmp:
        scratch = Path(tmp)
        for round_ in range(args.rounds):
            for variant in VARIANTS:
                print(f"round {round_ + 1}/{args.rounds}: {VARIANTS[variant]} …", flush=True)
                if variant == "torchrun":
                    ranks, helper = run_torchrun("\n".join(cells), scratch)
                else:
                    ranks, helper = run_pool(cells, scratch, zygote=variant == "zygote")
                runs[variant].append(ranks)
                helpers[variant].append(helper)
    os.environ.pop("JUPYTER_SHARD_ZYGOTE", None)
    medians = {
        v: {
            rank: {m: statistics.median(r[rank][m] for r in rs) for m in (*METRICS, *SPLIT)}
            for rank in range(NPROC)
        }
        for v, rs in runs.items()
    }
    helper_medians = {
        v: {m: statistics.median(h[m] for h in hs) for m in METRICS} for v, hs in helpers.items() if all(hs)
    }
    meta = {
        "loads": watch.loads,
        "others": watch.others,
        "load_before": watch.before,
        "load_after": watch.after,
        "run_s": watch.seconds,
    }
    write_section(report(args, medians, helper_medians, meta), args.results)
    if args.results != "-":
        plot(medians, Path(args.results).with_name("memory-per-rank.png"))
    return 0


def overheads(medians: dict[str, dict[int, dict[str, float]]], variant: str) -> dict[str, float]:
    """The larger per-rank difference (pool − torchrun), in MB (10⁶ bytes), for each metric."""
    return {
        m: max(medians[variant][k][m] - medians["torchrun"][k][m] for k in range(NPROC)) / 1e6
        for m in (*METRICS, *SPLIT)
    }


def report(
    args: argparse.Namespace,
    medians: dict[str, dict[int, dict[str, float]]],
    helpers: dict[str, dict[str, float]],
    meta: dict[str, Any],
) -> str:
    mb = 1e6
    rows = [
        f"| {VARIANTS[v]} | {k} | " + " | ".join(f"{medians[v][k][m] / mb:.1f}" for m in METRICS) + " |"
        for v in VARIANTS
        for k in range(NPROC)
    ]
    split_rows = [
        f"| {VARIANTS[v]} | {k} | {medians[v][k]['RssAnon'] / mb:.1f} | {medians[v][k]['RssFile'] / mb:.1f} |"
        for v in VARIANTS
        for k in range(NPROC)
    ]
    helper_rows = [
        f"| {'zygote' if v == 'zygote' else 'torchrun agent'} | "
        + " | ".join(f"{h[m] / mb:.1f}" for m in METRICS)
        + " |"
        for v, h in helpers.items()
    ]
    shared = {
        v: max(medians[v][k]["pss"] for k in range(NPROC)) / mb
        + helpers.get(v, {}).get("pss", 0.0) / mb / NPROC
        for v in VARIANTS
    }
    shared_rows = [f"| {VARIANTS[v]} | {p:.1f} | {p - shared['torchrun']:+.1f} |" for v, p in shared.items()]
    over = {v: overheads(medians, v) for v in ("zygote", "spawn")}
    over_rows = [
        f"| {VARIANTS[v]} | " + " | ".join(f"{o[m]:+.1f}" for m in (*METRICS, *SPLIT)) + " |"
        for v, o in over.items()
    ]
    lines = [
        "# Memory per rank: jupyter_shard pool vs a bare torchrun worker",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {platform.platform()}, {os.cpu_count()} "
        f"cores, Python {platform.python_version()}; load average (1 min) before "
        f"{meta['load_before'][0]:.2f}, after {meta['load_after'][0]:.2f}, during the run max "
        f"{max(meta['loads']):.2f}"
        + (f" (also running: {', '.join(sorted(meta['others']))})" if meta["others"] else "")
        + f"; whole run {meta['run_s']:.0f} s.",
        "",
        f"{NPROC} CPU ranks (gloo). Same code on every side: DDP over an MLP {args.width}-{args.width}-"
        f"{args.width}-1 with Adam, batch {args.batch}, {args.steps} steps, then `gc.collect()` and "
        "`psutil.Process().memory_full_info()` in the rank. Pool: three cells on "
        '`Pool(nproc=2, device="cpu", strategy="ddp")`; torchrun: `init_process_group("gloo")` and the '
        f"same code. Median of {args.rounds} alternating rounds per variant. MB = 10⁶ bytes.",
        "",
        "| variant | rank | RSS (MB) | USS (MB) | PSS (MB) |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        "RSS split (Linux `/proc/self/status`): anonymous pages (heap, tensors, copied-on-write) and "
        "file-backed pages (shared libraries, mapped files):",
        "",
        "| variant | rank | RssAnon (MB) | RssFile (MB) |",
        "|---|---:|---:|---:|",
        *split_rows,
        "",
        "The process beside the ranks (one per pool or job, not per rank):",
        "",
        "| process | RSS (MB) | USS (MB) | PSS (MB) |",
        "|---|---:|---:|---:|",
        *helper_rows,
        "",
        "Overhead per rank, pool − torchrun (the larger of the two ranks):",
        "",
        "| variant | RSS (MB) | USS (MB) | PSS (MB) | RssAnon (MB) | RssFile (MB) |",
        "|---|---:|---:|---:|---:|---:|",
        *over_rows,
        "",
        "How to read it: a forked rank's RSS is lower than a spawned one's mostly in RssFile: fork copies no "
        "page-table entries for shared file mappings (the torch libraries), which fill in only as pages are "
        "touched, so RSS flatters the zygote. RssAnon (heap, tensors, interpreter state) is counted alike "
        "in all three and is the closest like-for-like figure for what a rank adds; USS and PSS show what "
        "sharing the zygote's pages saves.",
        "",
        "Counting the helper too: the larger rank's PSS plus the helper's PSS divided by the ranks it serves "
        "(the kernel, which a notebook has anyway, is not counted):",
        "",
        "| variant | PSS per rank + helper share (MB) | − torchrun (MB) |",
        "|---|---:|---:|",
        *shared_rows,
        "",
        "![RSS, USS and PSS per rank](memory-per-rank.png)",
        "",
        "## Targets",
        "",
    ]
    targets = [
        (
            f"RSS overhead per rank ≤ {TARGET_MB:g} MB over a bare torchrun worker, {VARIANTS[v]}",
            f"{o['rss']:+.1f} MB (USS {o['uss']:+.1f}, PSS {o['pss']:+.1f})",
            o["rss"] <= TARGET_MB,
        )
        for v, o in over.items()
    ]
    lines += target_table(targets)
    return "\n".join(lines) + "\n"


def plot(medians: dict[str, dict[int, dict[str, float]]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = [(v, k) for v in VARIANTS for k in range(NPROC)]
    width = 0.8 / len(bars)
    colors = {"zygote": "tab:blue", "spawn": "tab:green", "torchrun": "tab:gray"}
    for i, (v, k) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(METRICS))]
        ys = [medians[v][k][m] / 1e6 for m in METRICS]
        ax.bar(
            xs,
            ys,
            width,
            color=colors[v],
            hatch="//" if k else None,
            edgecolor="white",
            label=f"{VARIANTS[v]}, rank {k}",
        )
    ax.set_xticks(range(len(METRICS)), [m.upper() for m in METRICS])
    ax.set_ylabel("MB per rank")
    ax.set_title("Memory per rank after the same DDP training steps (median of rounds)")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
