"""The streaming report: per mode, the training slowdown, the UI messages a notebook receives, the
kernel's CPU and what reached the disk and the history, summarised from the run's raw records; the
targets; and the timeline of messages and kernel CPU per second."""

from __future__ import annotations

import argparse
import bisect
import itertools
import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import pyplot, target_table

UI_TYPES = ("stream", "display_data", "update_display_data", "comm_msg")
MODES = {"notebook": "plain notebook (cell streams)", "lab": "JupyterLab extension attached"}
TARGET_MSGS, TARGET_CPU = 20, 10.0  # UI messages a second; kernel CPU, % of one core
BLOCKS = ("baseline", "flood", "plain")


def interpolate(samples: list[tuple[float, float]], t: float) -> float:
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0 or 1.0)
    return samples[-1][1] if t > samples[-1][0] else samples[0][1]


def busiest_window(stamps: list[float], start: float, end: float) -> tuple[float, int]:
    """Where the 1-second window holding the most stamps starts (at a stamp in the span), and how many."""
    inside = sorted(t for t in stamps if start <= t < end)
    counts = [(bisect.bisect_left(inside, t + 1.0) - i, -t) for i, t in enumerate(inside)]
    n, at = max(counts, default=(0, -start))
    return -at, n


def per_second(stamps: list[float], start: float, end: float) -> list[int]:
    bins = [0] * max(1, int(end - start + 0.999))
    for t in stamps:
        if start <= t < end:
            bins[int(t - start)] += 1
    return bins


def machine_line(load_before: tuple[float, float, float], load_after: tuple[float, float, float]) -> str:
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {platform.platform()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; load average (1 min) before "
        f"{load_before[0]:.2f}, after {load_after[0]:.2f}"
    )


def _windows(records: list[dict[str, Any]], tags: list[str], kind: str) -> list[tuple[float, float]]:
    """Per cell, from the first rank's start of a block to the last rank's end of it."""
    return [
        (
            min(r[kind]["start"] for r in records if r["tag"] == t),
            max(r[kind]["end"] for r in records if r["tag"] == t),
        )
        for t in tags
    ]


def _ratio(records: list[dict[str, Any]], over: str, under: str) -> list[float]:
    return [statistics.median(r[over]["times"]) / statistics.median(r[under]["times"]) for r in records]


def summarise_mode(
    tags: list[str],
    span: tuple[float, float],
    all_records: list[dict[str, Any]],
    messages: list[tuple[float, str, str]],
    cpu_between: Callable[[float, float], float],
) -> dict[str, Any]:
    """One mode's figures from its cells' records, the iopub messages (arrival time, type, what they
    carried) and the kernel's CPU seconds between two times."""
    records = [r for r in all_records if r["tag"] in tags]
    ui = [m for m in messages if m[1] in UI_TYPES]
    stamps = [t for t, _, _ in ui]
    floods = _windows(records, tags, "flood")
    flood_s = sum(b - a for a, b in floods)
    busiest_at, busiest = busiest_window(stamps, *span)
    in_floods = Counter(kind for t, kind, _ in ui if any(a <= t < b for a, b in floods))
    flood_records = [r["flood"] for r in records]
    return {
        "step": {k: statistics.median(d for r in records for d in r[k]["times"]) for k in BLOCKS},
        "slowdown": _ratio(records, "flood", "baseline"),
        "plain_slowdown": _ratio(records, "plain", "baseline"),
        "capture": _ratio(records, "flood", "plain"),
        "flood_s": statistics.median(f["end"] - f["start"] for f in flood_records),
        "plain_s": statistics.median(r["plain"]["end"] - r["plain"]["start"] for r in records),
        "lines_per_s": statistics.median(f["printed"] / (f["end"] - f["start"]) for f in flood_records),
        "logs_per_s": statistics.median(f["logged"] / (f["end"] - f["start"]) for f in flood_records),
        "msg_max": max(busiest_window(stamps, a, b)[1] for a, b in floods),
        "msg_median": statistics.median(n for a, b in floods for n in per_second(stamps, a, b)),
        "kinds": {k: v / flood_s for k, v in in_floods.items()},
        "msg_max_all": busiest,
        "busiest_kinds": Counter(
            f"{kind} {detail}".strip() for t, kind, detail in ui if busiest_at <= t < busiest_at + 1.0
        ),
        "busiest_at": busiest_at,
        "cpu": {
            k: 100
            * sum(cpu_between(a, b) for a, b in _windows(records, tags, k))
            / sum(b - a for a, b in _windows(records, tags, k))
            for k in BLOCKS
        },
        "cpu_all": 100 * cpu_between(*span) / (span[1] - span[0]),
        "windows": floods,
        "plain_windows": _windows(records, tags, "plain"),
    }


def report(args: argparse.Namespace, s: dict[str, Any]) -> str:
    modes: dict[str, dict[str, Any]] = s["modes"]
    msg_max = max(m["msg_max_all"] for m in modes.values())
    cpu_max = max(m["cpu"]["flood"] for m in modes.values())
    lost = sum(s["lost"].values())

    targets = [
        (
            f"≤ {TARGET_MSGS} UI messages per second (busiest 1-s window, cell ends included)",
            f"{msg_max} msg/s",
            msg_max <= TARGET_MSGS,
        ),
        (
            f"kernel CPU ≤ {TARGET_CPU:g}% of one core while ranks flood (worse mode)",
            f"{cpu_max:.1f}% of one core",
            cpu_max <= TARGET_CPU,
        ),
        ("nothing lost on disk (every rank's log holds every line)", f"{lost} lines lost", lost == 0),
    ]

    def cells(fmt: str, get: Any) -> list[str]:
        return [fmt.format(get(m)) for m in modes.values()]

    rows = [
        ("step time, training alone (median ms)", cells("{:.2f}", lambda m: m["step"]["baseline"] * 1e3)),
        (
            "step time, flood captured by jupyter_shard (median ms)",
            cells("{:.2f}", lambda m: m["step"]["flood"] * 1e3),
        ),
        (
            "step time, same flood to a plain file (median ms)",
            cells("{:.2f}", lambda m: m["step"]["plain"] * 1e3),
        ),
        (
            "**training slowdown, captured flood** (median over ranks and cells)",
            cells("**{:+.1f}%**", lambda m: (statistics.median(m["slowdown"]) - 1) * 100),
        ),
        (
            "training slowdown, flood to a plain file (what any process printing this much pays)",
            cells("{:+.1f}%", lambda m: (statistics.median(m["plain_slowdown"]) - 1) * 100),
        ),
        (
            "captured / plain-file step time (jupyter_shard's own share)",
            cells("{:.3f}", lambda m: statistics.median(m["capture"])),
        ),
        (
            "flood duration, captured / plain file (median s)",
            cells("{}", lambda m: f"{m['flood_s']:.1f} / {m['plain_s']:.1f}"),
        ),
        ("lines printed per second per rank, captured flood", cells("{:,.0f}", lambda m: m["lines_per_s"])),
        ("shard.log calls per second per rank, captured flood", cells("{:,.0f}", lambda m: m["logs_per_s"])),
        ("UI messages, busiest 1-s window during a flood", cells("{}", lambda m: m["msg_max"])),
        ("UI messages per second, median of the floods' 1-s bins", cells("{:g}", lambda m: m["msg_median"])),
        (
            "UI messages per second during floods, by type (mean)",
            cells("{}", lambda m: ", ".join(f"{k} {v:.2f}" for k, v in sorted(m["kinds"].items())) or "none"),
        ),
        (
            "**UI messages, busiest 1-s window of the whole mode**",
            cells("**{}**", lambda m: m["msg_max_all"]),
        ),
        (
            "… what that window held",
            cells("{}", lambda m: ", ".join(f"{k} {v}" for k, v in m["busiest_kinds"].most_common())),
        ),
        ("**kernel CPU, captured floods (% of one core)**", cells("**{:.1f}**", lambda m: m["cpu"]["flood"])),
        (
            "kernel CPU, plain-file floods: shard.log records only (%)",
            cells("{:.1f}", lambda m: m["cpu"]["plain"]),
        ),
        ("kernel CPU, training alone (%)", cells("{:.1f}", lambda m: m["cpu"]["baseline"])),
        ("kernel CPU over the whole mode (%)", cells("{:.1f}", lambda m: m["cpu_all"])),
    ]
    table = [
        "| measure | " + " | ".join(MODES[m] for m in modes) + " |",
        "|---|" + "---:|" * len(modes),
        *[f"| {a} | " + " | ".join(b) + " |" for a, b in rows],
    ]
    disk = [
        f"| {rank} | {sum(counts.values()):,} | {len(counts) * args.lines:,} | {s['lost'][rank]} |"
        for rank, counts in sorted(s["on_disk"].items())
    ]
    per_cell = "; ".join(
        f"{mode}: "
        + ", ".join(f"{r:.2f}" for r in m["slowdown"])
        + " (plain file: "
        + ", ".join(f"{r:.2f}" for r in m["plain_slowdown"])
        + ")"
        for mode, m in modes.items()
    )
    lines = [
        "# Streaming: ranks flooding output while they train",
        "",
        machine_line(s["load_before"], s["load_after"])
        + f"; during the run mean {statistics.mean(s['loads']):.2f}, max {max(s['loads']):.2f}"
        + (f" (also running: {', '.join(sorted(s['others']))})" if s["others"] else "")
        + f"; whole run {s['run_s']:.0f} s.",
        "",
        f"{args.nproc} CPU ranks (gloo, ddp), MLP {args.width}-{args.width}-{args.width}-1, "
        f"batch {args.batch}, "
        f"training in each rank's main thread. {args.repeats} cells per mode; each cell has three blocks, "
        "their order rotated from cell to cell: training alone; training while a thread on each rank "
        f"prints {args.lines:,} numbered lines (~60 bytes, one `print` each, paced over {args.seconds:g} s, "
        "caught up in slices of 1,000 when behind) and calls `shard.log` "
        f"{args.log_rate:,} times a second as long as it prints (**captured flood**: `sys.stdout` of the "
        "rank, which jupyter_shard tees to the rank log and the kernel); and the same flood with `print` "
        "writing to a plain buffered file instead (**plain file**: what a torchrun worker with redirected "
        "output does; `shard.log` unchanged). UI messages: `stream`, `display_data`, "
        "`update_display_data` and `comm_msg` on iopub, as the client receives them.",
        "",
        *table,
        "",
        "Lines on disk (each rank's log file; every captured flood line counted by its number):",
        "",
        "| rank | flood lines found | printed | lost |",
        "|---|---:|---:|---:|",
        *disk,
        "",
        f"`shard.log` records in `jupyter_shard.history()`: {s['history']:,} of {s['logged']:,} logged.",
        "",
        "Rank RSS growth from the end of the setup cell to the end of the last cell (MB): "
        + ", ".join(f"rank {k} {v / 1e6:+.0f}" for k, v in sorted(s["rss_growth"].items()))
        + f" (after {sum(map(len, s['tags'].values()))} cells, each printing {args.lines:,} captured lines "
        "per rank).",
        "",
        f"Per rank and cell, flood / training-alone step time: {per_cell}.",
        "",
        "![UI messages per second and kernel CPU over the run](streaming-timeline.png)",
        "",
        "## Targets",
        "",
        *target_table(targets),
    ]
    return "\n".join(lines) + "\n"


def plot(
    s: dict[str, Any], messages: list[tuple[float, str, str]], cpu: list[tuple[float, float]], path: Path
) -> None:
    plt = pyplot()
    start = min(a for a, _ in s["spans"].values())
    end = max(b for _, b in s["spans"].values())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for kind in UI_TYPES:
        bins = per_second([t for t, k, _ in messages if k == kind], start, end)
        if any(bins):
            top.step(range(len(bins)), bins, where="post", label=kind, linewidth=1)
    total = per_second([t for t, k, _ in messages if k in UI_TYPES], start, end)
    top.step(range(len(total)), total, where="post", color="black", linewidth=1.5, label="all four")
    top.axhline(TARGET_MSGS, color="red", linestyle="--", linewidth=1, label=f"target {TARGET_MSGS}/s")
    top.set_ylabel("iopub messages / s")
    top.legend(loc="upper right", fontsize=8)
    seconds = range(int(end - start))
    used = [100 * (interpolate(cpu, start + i + 1) - interpolate(cpu, start + i)) for i in seconds]
    bottom.step(seconds, used, where="post", linewidth=1, label="kernel CPU, 1-s bins")
    bottom.axhline(TARGET_CPU, color="red", linestyle="--", linewidth=1, label=f"target {TARGET_CPU:g}%")
    bottom.set_ylabel("% of one core")
    bottom.set_xlabel("seconds since the first timed cell")
    bottom.legend(loc="upper right", fontsize=8)
    for m in s["modes"].values():
        for a, b in m["plain_windows"]:
            for ax in (top, bottom):
                ax.axvspan(a - start, b - start, alpha=0.08, color="gray")
    for mode, m in s["modes"].items():
        for a, b in m["windows"]:
            for ax in (top, bottom):
                ax.axvspan(
                    a - start, b - start, alpha=0.12, color="tab:orange" if mode == "lab" else "tab:blue"
                )
    top.set_title(
        "Captured floods shaded (blue: plain notebook, orange: JupyterLab extension attached), "
        "plain-file floods grey; "
        "1-s bins from the first timed cell",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
