"""Run every benchmark, then assemble their sections into ``benchmarks/RESULTS.md`` with a summary of targets.

Each benchmark is a folder here, run as ``python -m benchmarks.<name>``, that takes ``--results PATH``
(the markdown section it writes) and ``--quick`` (a smoke run with few repeats), draws its plots
beside that file as
``<name>-*.png`` linked relatively, and ends its section with one machine-readable line per target::

    <!-- target: <what is promised> | <measured value> | met -->

(the last field is ``met``, ``not met`` or ``n/a``; see ``benchmarks/README.md``). This runs them
one after another (never two at once), collects those lines into one table at the top of
``RESULTS.md`` and appends every section, headings demoted one level and links rewritten to stay
valid. Sections of ``strategies`` written before it wrote target lines have their targets read from
its table here.

    .venv/bin/python -m benchmarks.run_all                  # everything, full settings
    .venv/bin/python -m benchmarks.run_all --only dispatch  # one benchmark; RESULTS.md keeps the others
    .venv/bin/python -m benchmarks.run_all --quick          # smoke run into a temporary folder
    .venv/bin/python -m benchmarks.run_all --assemble-only  # rebuild RESULTS.md from results/
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import TARGET_LINE, cpu, git_revision, load_average, other_runs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    quick: tuple[str, ...] = ("--quick",)  # arguments of a smoke run
    optional: bool = False  # written by someone else; skipped (and said so) while absent
    args: tuple[str, ...] = ()  # arguments of a full run
    module: str = ""  # the benchmark's folder, when several sections come from one benchmark
    elsewhere: str = ""  # how it runs when it cannot run here (run_all only assembles its section)

    @property
    def script(self) -> Path:
        return HERE / (self.module or self.name) / "__main__.py"

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", f"benchmarks.{self.module or self.name}"]


BENCHMARKS = (
    Benchmark("dispatch", "Dispatch round trip, cold start, warm restart"),
    Benchmark(
        "strategies",
        "Training throughput against torchrun",
        quick=("--width", "512", "--steps", "2", "--warmup", "1", "--rounds", "1", "--strategies", "ddp"),
    ),
    Benchmark("streaming", "Streaming output and metrics", optional=True),
    Benchmark("memory", "Memory per rank against torchrun", optional=True),
    Benchmark("many_ranks", "A notebook at 16 to 64 ranks: output, error, status, no-op cost", optional=True),
    Benchmark("frameworks", "A Lightning Trainer against the same script under torchrun", quick=("--quick",)),
    Benchmark("bigmodel", "Peak memory per rank of a 1.5 GB model, sharded initialisation or not"),
    Benchmark("transfer", "Moving values: push and pull against ipyparallel and memcpy"),
    Benchmark("dry_run", "Dry run: predicted against measured peak per rank (CPU pools)"),
    Benchmark("keep", "Keeping a pool's state: attach, the cost of a kept pool, suspend and resume"),
    Benchmark(
        "gpu_check",
        "One GPU: a training step against torchrun, cold start, warm restart, the GPU tests",
        elsewhere="on a GPU machine: `make gpu-bundle` here, `make gpu-check` there (docs/development.md)",
    ),
    *(
        Benchmark(
            f"soak-{n}",
            f"Faults injected for 30 minutes at {n} ranks: time back to a working cell",
            quick=("--minutes", "1", "--nproc", str(n)),
            args=("--minutes", "30", "--nproc", str(n), "--seed", "19"),
            module="soak",
        )
        for n in (3, 4)
    ),
)
NAMES = [b.name for b in BENCHMARKS]

STRATEGY_THROUGHPUT = 0.98  # training throughput ≥ 0.98 of torchrun's, every strategy


@dataclass
class Target:
    benchmark: str
    name: str
    value: str
    met: str


# -- running ------------------------------------------------------------------------------------------


def run_one(bench: Benchmark, out: Path, quick: bool) -> str:
    """Run one benchmark script; '' when it succeeded, otherwise why not."""
    if not bench.script.exists():
        return f"`{bench.script.relative_to(ROOT)}` is not there yet"
    if quick and bench.quick == ("--quick",) and "--quick" not in bench.script.read_text():
        return "it has no `--quick` option yet, so a quick run leaves it out"
    argv = [*bench.command, "--results", str(out / f"{bench.name}.md")]
    argv += list(bench.quick if quick else bench.args)
    print(f"== {bench.name}: {' '.join(argv[1:])}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.wait()  # the child got the same Ctrl-C and stops what it started
        raise
    print(f"== {bench.name}: exit {code} after {time.monotonic() - t0:.0f} s", flush=True)
    return "" if code == 0 else f"exited with status {code}"


# -- assembling ---------------------------------------------------------------------------------------


def targets_of(bench: Benchmark, text: str) -> list[Target]:
    found = [
        Target(bench.name, m["name"], m["value"], m["met"])
        for m in map(TARGET_LINE.match, text.splitlines())
        if m
    ]
    if bench.name == "strategies" and not found:
        found = strategy_targets(text)
    return found


def strategy_targets(text: str) -> list[Target]:
    """A ``strategies`` section without target lines: its throughput ratio column, against the target."""
    found, column = [], -1
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "throughput ratio" in cells:
            column = cells.index("throughput ratio")
        elif column > 0 and len(cells) > column and re.fullmatch(r"\d+\.\d+", cells[column]):
            ratio = float(cells[column])
            name = f"Training throughput ≥ {STRATEGY_THROUGHPUT} of torchrun's, {cells[0]}"
            found.append(
                Target(
                    "strategies", name, f"{ratio:.3f}", "met" if ratio >= STRATEGY_THROUGHPUT else "not met"
                )
            )
        elif not line.strip():
            column = -1
    return found


def demote(text: str, folder: Path, summary_dir: Path) -> str:
    """Headings one level down; relative links to files of ``folder`` made relative to the summary."""

    def relink(m: re.Match[str]) -> str:
        target = m["target"]
        if re.match(r"^[a-z]+:|^/|^#", target) or not (folder / target).exists():
            return m[0]
        return f"]({os.path.relpath(folder / target, summary_dir)})"

    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            line = "#" + line
        out.append(re.sub(r"\]\((?P<target>[^)\s]+)\)", relink, line))
    return "\n".join(out)


_DATED = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d) UTC")


def written(path: Path) -> dt.datetime:
    """When a section was written: the date its head states (``- Date: 2026-11-23 20:47 UTC``), else
    its last commit's time while the file is as committed (a fresh clone's files all carry the
    clone's time), else its modification time."""
    head = "\n".join(path.read_text().splitlines()[:10])
    stated = _DATED.search(head)
    if stated:
        return dt.datetime.strptime(stated.group(1), "%Y-%m-%d %H:%M").replace(tzinfo=dt.timezone.utc)
    stamp = path.stat().st_mtime
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        where = ["-C", str(path.parent), "--no-pager"]
        changed = subprocess.run(
            ["git", *where, "status", "--porcelain", "--", path.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not changed:
            committed = subprocess.run(
                ["git", *where, "log", "-1", "--format=%ct", "--", path.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            stamp = float(committed) if committed else stamp
    return dt.datetime.fromtimestamp(stamp, dt.timezone.utc)


def assemble(
    out: Path,
    summary: Path,
    ran: dict[str, str],
    skipped: dict[str, str],
    loads: tuple[str, str],
    others: list[str],
) -> str:
    sections, goals, status = [], [], []
    for bench in BENCHMARKS:
        path = out / f"{bench.name}.md"
        if ran.get(bench.name):
            status.append(f"- **{bench.name}**: failed in this run, {ran[bench.name]}")
        if bench.name in skipped:
            status.append(f"- **{bench.name}**: not run, {skipped[bench.name]}")
        if not path.exists():
            if bench.name not in ran and bench.name not in skipped:
                where = os.path.relpath(path, summary.parent)
                how = f"; it runs {bench.elsewhere}" if bench.elsewhere else ""
                status.append(f"- **{bench.name}**: no results yet (`{where}`){how}")
            continue
        when = written(path).strftime("%Y-%m-%d %H:%M UTC")
        origin = "this run" if ran.get(bench.name) == "" else "an earlier run"
        status.append(f"- **{bench.name}**: {bench.title}; from {origin}, written {when}")
        text = path.read_text()
        goals += targets_of(bench, text)
        sections.append(demote(text, out, summary.parent))
    lines = [
        "# Benchmark results",
        "",
        "Assembled by `.venv/bin/python -m benchmarks.run_all` from the sections in "
        f"`{os.path.relpath(out, summary.parent)}/`; each section describes its machine, settings and load.",
        "",
        f"- Assembled: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"revision {git_revision()}; {cpu()}",
        f"- Load average (1, 5, 15 min) when run_all started: {loads[0]}; when it finished: {loads[1]}",
    ]
    if others:
        lines.append(f"- Other benchmark processes running when it started: {'; '.join(others)}")
    lines += ["", *status, "", "## Targets", ""]
    if goals:
        lines += ["| benchmark | target | measured | |", "|---|---|---:|---|"]
        lines += [
            f"| {g.benchmark} | {g.name} | {g.value} | {'**' + g.met + '**' if g.met != 'n/a' else g.met} |"
            for g in goals
        ]
        met = sum(g.met == "met" for g in goals)
        missed = sum(g.met == "not met" for g in goals)
        lines += ["", f"{met} met, {missed} not met, {len(goals) - met - missed} not measured."]
    else:
        lines.append("No section reported a target.")
    lines.append("")
    for text in sections:
        lines += [text.rstrip(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--only", nargs="+", choices=NAMES, help="run only these benchmarks")
    parser.add_argument("--skip", nargs="+", choices=NAMES, default=[], help="run all but these")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: few repeats, into a temporary folder"
    )
    parser.add_argument("--assemble-only", action="store_true", help="run nothing; rebuild the summary")
    parser.add_argument(
        "--out", type=Path, help="folder for the sections and plots (default benchmarks/results)"
    )
    parser.add_argument("--summary", type=Path, help="the assembled file (default benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)

    if args.quick and args.out is None:  # a smoke run must not replace measured results
        args.out = Path(tempfile.mkdtemp(prefix="jshard-bench-quick-")) / "results"
    out = (args.out or HERE / "results").resolve()
    summary = (args.summary or (out.parent / "RESULTS.md" if args.quick else HERE / "RESULTS.md")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    chosen = [
        b
        for b in BENCHMARKS
        if (not args.only or b.name in args.only) and b.name not in args.skip and not b.elsewhere
    ]
    load_before, others = load_average(), [] if args.assemble_only else sorted(other_runs())
    if others:
        print(f"warning: other benchmarks are running and will skew these numbers: {'; '.join(others)}")
    ran: dict[str, str] = {}  # name -> '' (succeeded) or why it failed
    skipped: dict[str, str] = {}
    try:
        for bench in [] if args.assemble_only else chosen:
            why = run_one(bench, out, args.quick)
            if why and not why.startswith("exited"):
                print(f"== {bench.name}: skipped, {why}")
                skipped[bench.name] = why
                continue
            ran[bench.name] = why
    except KeyboardInterrupt:
        print("interrupted: RESULTS.md not written", file=sys.stderr)
        return 130
    summary.write_text(assemble(out, summary, ran, skipped, (load_before, load_average()), others))
    print(f"written to {summary}")
    return 1 if any(ran.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
