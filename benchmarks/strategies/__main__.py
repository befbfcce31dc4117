"""Training under ``%%distributed`` against the same script under ``torchrun``, per strategy: ddp,
fsdp and DeepSpeed's ZeRO-2 and ZeRO-3, interleaved step by step as ``interleave.py`` describes.

It reports the median step time, the throughput ratio (torchrun step time / jupyter_shard step
time; 1.0 means no overhead), the same ratio of the training thread's CPU time per step, peak RSS
per rank, and the bytes each rank holds for parameters, gradients and optimizer state next to what
the ZeRO paper's formulas predict for fp32 Adam (see :func:`predicted`).
Run: ``.venv/bin/python -m benchmarks.strategies [--strategies ddp fsdp zero2 zero3] [--width 3584]``
(writes ``benchmarks/results/strategies.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, LoadWatch, format_loads, target_line, write_section
from benchmarks.strategies.interleave import (
    STRATEGIES,
    THROUGHPUT_TARGET,
    cpu_per_step,
    paired_ratios,
    predicted,
    run_control,
    run_pair,
    step_times,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved runs per strategy")
    parser.add_argument(
        "--control",
        action="store_true",
        help="also run torchrun against itself, interleaved the same way: the comparison's noise floor",
    )
    parser.add_argument("--results", default=str(RESULTS / "strategies.md"))
    args = parser.parse_args(argv)
    psi = args.depth * (args.width * args.width + args.width)
    sizes = {"width": args.width, "depth": args.depth, "batch": args.batch}
    code = {**sizes, "warmup": args.warmup, "steps": args.steps}
    rows = []
    with LoadWatch() as watch, tempfile.TemporaryDirectory(prefix="jsbench-") as tmp:
        scratch = Path(tmp)
        for name in args.strategies:
            entry = STRATEGIES[name]
            ours: list[list[dict[str, Any]]] = []
            theirs: list[list[dict[str, Any]]] = []
            for round_ in range(args.rounds):  # which side takes the first turn alternates
                pool_first = round_ % 2 == 0
                print(
                    f"[{name}] round {round_ + 1} ({'pool' if pool_first else 'torchrun'} first) ...",
                    flush=True,
                )
                mine, other = run_pair(entry, code, scratch, pool_first)
                ours.append(mine)
                theirs.append(other)
                a, b = (statistics.median(step_times([r])) for r in (mine, other))
                print(f"[{name}] round {round_ + 1}: step {a:.3f} s against {b:.3f} s", flush=True)
            rows.append(_row(name, ours, theirs, predicted(name, psi, 2)))
            if args.control:
                rows[-1]["control"] = _control(name, entry, code, scratch, args.rounds)
    args.loads = (watch.before, watch.after)
    write_section("\n".join(_table(rows, psi, args)) + "\n", args.results)
    return 0


def _control(
    name: str, entry: dict[str, Any], params: dict[str, int], scratch: Path, rounds: int
) -> dict[str, Any]:
    """Rounds of torchrun against itself: what the ratio is when there is no difference at all."""
    firsts: list[list[dict[str, Any]]] = []
    seconds: list[list[dict[str, Any]]] = []
    for round_ in range(rounds):
        print(f"[{name}] control round {round_ + 1}: torchrun against torchrun ...", flush=True)
        a, b = run_control(entry, params, scratch, a_first=round_ % 2 == 0)
        firsts.append(a)
        seconds.append(b)
    paired = paired_ratios(firsts, seconds)
    return {
        "paired": statistics.median(paired),
        "paired_range": (min(paired), max(paired)),
        "cpu_ratio": statistics.median(cpu_per_step(seconds)) / statistics.median(cpu_per_step(firsts)),
    }


def _row(
    name: str, ours: list[list[dict[str, Any]]], theirs: list[list[dict[str, Any]]], pred: dict[str, float]
) -> dict[str, Any]:
    # Within a round the two sides' steps interleave: the ratio within a round is free of the
    # machine's drift (tens of percent on a shared VM between minutes), so the median of those is the
    # figure.
    paired = paired_ratios(ours, theirs)
    return {
        "name": name,
        "paired": statistics.median(paired),
        "paired_range": (min(paired), max(paired)),
        "ours": statistics.median(step_times(ours)),
        "theirs": statistics.median(step_times(theirs)),
        "cpu_ratio": statistics.median(cpu_per_step(theirs)) / statistics.median(cpu_per_step(ours)),
        "rss_ours": statistics.median(max(r["maxrss"] for r in ranks) for ranks in ours),
        "rss_theirs": statistics.median(max(r["maxrss"] for r in ranks) for ranks in theirs),
        "held": ours[0][0]["held"],
        "pred": pred,
    }


def _table(rows: list[dict[str, Any]], psi: int, args: argparse.Namespace) -> list[str]:
    mib = 2**20
    lines = [
        "# Strategies: `%%distributed` (jupyter_shard Pool) vs the same script under torchrun",
        "",
        f"Model: {args.depth} × Linear({args.width}, {args.width}) + ReLU, Ψ = {psi / 1e6:.1f}M parameters, "
        f"fp32 Adam, batch {args.batch} per rank, 2 CPU ranks (gloo); {args.rounds} rounds per strategy; "
        f"in each, jupyter_shard and torchrun run at the same time and take turns step by step (which "
        f"starts and goes first alternates), {args.steps} timed steps each after {args.warmup} warm-up. "
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{os.cpu_count()} cores; load average (1, 5, 15 min) before {format_loads(args.loads[0])}, "
        f"after {format_loads(args.loads[1])}.",
        "",
        "Throughput ratio = torchrun's step time / jupyter_shard's (1.0: no overhead), the median over "
        "rounds of the ratio within a round (the two sides' steps interleaved), with its range; the step "
        "columns and the pooled ratio are medians over all rounds, which the machine's drift between "
        "rounds moves. "
        "Training-thread CPU ratio = torchrun's / jupyter_shard's median CPU seconds per step on the "
        "thread that trains (`time.thread_time()`, barriers excluded): the work a step costs the rank, "
        "which other processes' load barely moves.",
        "",
        "| strategy | step, jupyter_shard (s) | step, torchrun (s) | throughput ratio | range over rounds "
        "| pooled ratio | training-thread CPU ratio | peak RSS/rank, ours (MiB) "
        "| peak RSS/rank, torchrun (MiB) | RSS ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lo, hi = r["paired_range"]
        lines.append(
            f"| {r['name']} | {r['ours']:.3f} | {r['theirs']:.3f} | {r['paired']:.3f} | {lo:.3f}–{hi:.3f} "
            f"| {r['theirs'] / r['ours']:.3f} | {r['cpu_ratio']:.3f} "
            f"| {r['rss_ours'] / mib:.0f} | {r['rss_theirs'] / mib:.0f} "
            f"| {r['rss_ours'] / r['rss_theirs']:.3f} |"
        )
    lines += [
        "",
        "Bytes held per rank (measured by `shard.memory()` on rank 0) against the ZeRO paper's formulas:",
        "",
        "| strategy | parameters MiB (formula) | gradients MiB (formula) | optimizer MiB (formula) |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            f"{r['held'][k] / mib:.1f} ({r['pred'][k] / mib:.1f})"
            for k in ("parameters", "gradients", "optimizer")
        ]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    controls = [r for r in rows if "control" in r]
    if controls:
        lines += [
            "",
            "Control: torchrun against itself, the same rounds interleaved the same way (the second "
            "side's step time over the first's). A ratio away from 1.0 here is the machine, not the "
            "pool: read the throughput ratio against this spread.",
            "",
            "| strategy | ratio, torchrun against itself | range over rounds | training-thread CPU ratio |",
            "|---|---:|---:|---:|",
        ]
        for r in controls:
            c = r["control"]
            lo, hi = c["paired_range"]
            lines.append(f"| {r['name']} | {c['paired']:.3f} | {lo:.3f}–{hi:.3f} | {c['cpu_ratio']:.3f} |")
    lines += [
        "",
        f"Targets: throughput ratio ≥ {THROUGHPUT_TARGET}; peak RSS per rank within 10% of torchrun's; "
        "held bytes match the formulas.",
        "",
    ]
    lines += [
        target_line(
            f"Training throughput ≥ {THROUGHPUT_TARGET} of torchrun's, {r['name']}",
            f"{r['paired']:.3f} ({r['paired_range'][0]:.3f}–{r['paired_range'][1]:.3f})",
            r["paired"] >= THROUGHPUT_TARGET,
        )
        for r in rows
    ]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
