"""What ``shard.log`` every step costs, and how many dashboard messages reach the notebook, in one run.

A real kernel (jupyter_client) with ``%load_ext jupyter_shard`` runs a 2-rank CPU pool. Each rank
times a loop of small steps (a matmul sized so that one step takes about 100 µs, i.e. 10k steps per
second) with and without ``shard.log(loss=t)`` (a 0-dim tensor) every step, two ways:

* **paired blocks** (the cost inside a rank): one cell alternates blocks of ``--block`` steps without
  and with logging, ``--pairs`` times (order swapped every pair), while the kernel receives the
  records and the cell's dashboard redraws; the ratio is the median over pairs of the two blocks'
  step times, then the median over ranks and ``--repeats`` cells. Drift between blocks a fraction
  of a second apart is small, so this resolves a 1–2% difference on a noisy machine.
* **separate cells** (cost to the whole machine): ``--steps`` steps per cell, cells without and with
  logging alternated ``--repeats`` times. With 2 ranks on 2 cores the kernel's work for the
  dashboard (receiving, drawing, sending) takes CPU from the ranks, which shows up here.

Also reported: the dashboard's redraws on iopub during the logging cells (``update_display_data``
messages with its figure; the most in any 1-second window, and the mean rate), and that every
logged record arrived in the kernel's history. The markdown table goes to stdout and to
``--results`` (default ``benchmarks/LOGGING.md``).

(Not named ``logging``: a ``benchmarks/logging.py`` would shadow the standard library's ``logging``
for any script run by path from this folder, whose own folder comes first on ``sys.path``.)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import queue
import re
import statistics
import sys
import tempfile
import time

from benchmarks.common import ROOT, LoadWatch, write_section
from benchmarks.common.kernel import start_kernel

SETUP = """%%distributed --nproc {nproc} --device cpu --no-dashboard
import time, torch
torch.set_num_threads(1)
a = torch.randn({size}, {size}) / {size}

def one_step():
    return (a @ a)[0, 0]

def timed(n, log):
    t0 = time.perf_counter()
    for _ in range(n):
        loss = one_step()
        if log:
            shard.log(loss=loss)
    return (time.perf_counter() - t0) / n

def paired(pairs, block):
    import statistics
    plain, logged, ratios = [], [], []
    for i in range(pairs):
        t = {{log: timed(block, log) for log in ((False, True) if i % 2 == 0 else (True, False))}}
        plain.append(t[False]); logged.append(t[True]); ratios.append(t[True] / t[False])
    return statistics.median(plain) * 1e6, statistics.median(logged) * 1e6, statistics.median(ratios)

for _ in range(3000):
    one_step()
print("STEP_US", timed(3000, False) * 1e6)
"""
RUN = "%%distributed\nprint('STEP_US', timed({steps}, {log}) * 1e6)\n"
FIGURE_MIME = "application/vnd.jupyter-shard.figure+json"  # what a dashboard redraw carries
PAIRED = "%%distributed\nprint('PAIRED', *paired({pairs}, {block}))\n"
STEP_LINE = re.compile(r"\[rank (\d+)\] STEP_US ([0-9.]+)")
PAIRED_LINE = re.compile(r"\[rank (\d+)\] PAIRED ([0-9.]+) ([0-9.]+) ([0-9.]+)")


class Kernel:
    def __init__(self) -> None:
        self.km, self.kc = start_kernel({"JUPYTER_SHARD_LOG_DIR": tempfile.mkdtemp()})

    def execute(self, code: str) -> tuple[str, list[float]]:
        """Run a cell; its stdout, and the arrival times of dashboard redraws during it."""
        msg_id = self.kc.execute(code)
        out, updates = [], []
        while True:
            msg = self.kc.get_iopub_msg(timeout=600)
            kind, content = msg["msg_type"], msg["content"]
            if kind == "update_display_data" and FIGURE_MIME in content["data"]:
                updates.append(time.monotonic())  # a dashboard redraw
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if kind == "error":
                raise RuntimeError("\n".join(content["traceback"]))
            if kind == "stream" and content["name"] == "stdout":
                out.append(content["text"])
            if kind == "status" and content["execution_state"] == "idle":
                break
        with contextlib.suppress(queue.Empty):
            self.kc.get_shell_msg(timeout=5)
        return "".join(out), updates

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def step_times(text: str) -> dict[int, float]:
    return {int(rank): float(us) for rank, us in STEP_LINE.findall(text)}


def busiest_second(times: list[float]) -> int:
    return max((sum(1 for u in times if t <= u < t + 1.0) for t in times), default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30_000, help="steps per separate cell")
    parser.add_argument("--repeats", type=int, default=3, help="cells of each kind")
    parser.add_argument("--pairs", type=int, default=60, help="block pairs per paired cell")
    parser.add_argument("--block", type=int, default=2000, help="steps per block")
    parser.add_argument("--size", type=int, default=0, help="matmul size (0: pick for ~100 µs a step)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "LOGGING.md"))
    args = parser.parse_args(argv)
    watch = LoadWatch().start()
    kernel = Kernel()
    try:
        kernel.execute("%load_ext jupyter_shard")
        size = args.size or 64
        while True:
            text, _ = kernel.execute(SETUP.format(nproc=args.nproc, size=size))
            base = statistics.median(step_times(text).values())
            if args.size or 80 <= base <= 130 or size <= 8 or size >= 512:
                break
            size = max(8, int(size * (100 / base) ** (1 / 3)))
        plain: list[float] = []
        logged: list[float] = []
        updates: list[float] = []
        spans: list[float] = []
        paired: list[tuple[float, float, float]] = []
        for _ in range(args.repeats):
            text, _ = kernel.execute(PAIRED.format(pairs=args.pairs, block=args.block))
            paired.extend((float(a), float(b), float(c)) for _, a, b, c in PAIRED_LINE.findall(text))
        for _ in range(args.repeats):
            for log in (False, True):
                started = time.monotonic()
                text, seen = kernel.execute(RUN.format(steps=args.steps, log=log))
                (logged if log else plain).extend(step_times(text).values())
                if log:
                    updates.extend(seen)
                    spans.append(time.monotonic() - started)
        count, _ = kernel.execute("import jupyter_shard\nprint(len(jupyter_shard.history()))")
        expected = args.repeats * args.nproc * (args.steps + args.pairs * args.block)
    finally:
        kernel.close()
        watch.stop()
    plain_us, logged_us = statistics.median(plain), statistics.median(logged)
    ratio = statistics.median(r for _, _, r in paired)
    rows = [
        (
            "paired blocks: step time, no logging (median µs)",
            f"{statistics.median(a for a, _, _ in paired):.1f}",
        ),
        (
            "paired blocks: step time, shard.log every step (median µs)",
            f"{statistics.median(b for _, b, _ in paired):.1f}",
        ),
        ("**paired blocks: logging / no logging**", f"**{ratio:.3f} ({(ratio - 1) * 100:+.1f}%)**"),
        ("separate cells: step time, no logging (median µs)", f"{plain_us:.1f}"),
        ("separate cells: step time, shard.log every step (median µs)", f"{logged_us:.1f}"),
        (
            "separate cells: logging / no logging",
            f"{logged_us / plain_us:.3f} ({(logged_us / plain_us - 1) * 100:+.1f}%)",
        ),
        ("shard.log calls per second per rank", f"{1e6 / logged_us:,.0f}"),
        ("dashboard redraws on iopub, busiest second", str(busiest_second(updates))),
        ("dashboard redraws on iopub, mean per second", f"{len(updates) / sum(spans):.1f}"),
        ("records in the kernel's history / logged", f"{int(count.strip())} / {expected}"),
    ]
    table = "\n".join(["| measure | value |", "|---|---|", *[f"| {a} | {b} |" for a, b in rows]])
    machine = (
        f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{args.nproc} CPU ranks, matmul {size}×{size}, "
        f"{args.repeats} paired cells of {args.pairs} × 2 blocks of {args.block} steps, "
        f"{args.repeats} separate cells of {args.steps} steps each way; "
        f"load average before {watch.before[0]:.2f}, after {watch.after[0]:.2f}; other benchmarks or "
        f"test runs seen: {', '.join(sorted(watch.others)) or 'none'}"
    )
    report = (
        f"# shard.log overhead and dashboard message rate\n\n{dt.date.today()}: {machine}\n\n{table}\n\n"
        f"Paired-block ratios per rank and cell: {', '.join(f'{r:.3f}' for _, _, r in paired)}\n\n"
        f"Separate-cell step times (µs), no logging: {', '.join(f'{t:.1f}' for t in plain)}\n\n"
        f"Separate-cell step times (µs), logging: {', '.join(f'{t:.1f}' for t in logged)}\n"
    )
    write_section(report, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
