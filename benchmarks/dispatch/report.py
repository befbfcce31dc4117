"""The dispatch report: the machine, the round-trip and start tables, and the targets, computed from
the numbers and written as a table and as target lines."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import ipyparallel
import torch
import zmq

from benchmarks.common import ROOT, LoadWatch, cpu, percentile, target_table
from benchmarks.dispatch import peers
from benchmarks.dispatch.results import COLD, FIRST_CELL, IDLE, NOOP, ROUND_TRIP, WARM, Results, Starts


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def machine(load_before: str, load_after: str, watch: LoadWatch, code: str, changed: list[str]) -> list[str]:
    ram = "unknown"
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jd = "not installed"
    if not peers.JD_MISSING:
        dist = peers.jupyter_distributed
        jd = f"{dist.__version__} (from {Path(dist.__file__).parent.parent})"
    return [
        f"- Date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- CPU: {cpu()} ({usable} usable by this process); RAM {ram}",
        f"- OS: {platform.system()} {platform.release()}; Python {platform.python_version()}",
        f"- torch {torch.__version__}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), "
        f"ipyparallel {ipyparallel.__version__}, jupyter-distributed {jd}, "
        f"jupyter_client {version('jupyter_client')}, ipykernel {version('ipykernel')}",
        f"- Load average (1, 5, 15 min) before the run: {load_before}; after: {load_after}; "
        f"1-min load during the run: {watch.describe()}. The run's own ranks, engines and kernels "
        "load the cores too; other processes skew the numbers, so compare ratios "
        "within one run",
        "- Other benchmarks seen running during the run: "
        + ("; ".join(sorted(watch.others)) if watch.others else "none"),
        f"- Code at the start: revision {code}"
        + (
            f"; changed during the run (later starts may have used the new code): {', '.join(changed)}"
            if changed
            else "; unchanged during the run"
        ),
    ]


def code_state() -> str:
    """The revision, and the package's files that differ from it (others edit the tree meanwhile)."""

    def git(*argv: str) -> str:
        with contextlib.suppress(OSError):
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.rstrip()
        return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "jupyter_shard").splitlines()
    return head + (f" with uncommitted changes in {', '.join(line[3:] for line in dirty)}" if dirty else "")


def changed_since(t0: float) -> list[str]:
    """Files of the package written after ``t0`` (epoch seconds)."""
    package = ROOT / "jupyter_shard"
    return sorted(str(f.relative_to(ROOT)) for f in package.rglob("*.py") if f.stat().st_mtime > t0)


@dataclass
class Target:
    name: str
    value: str
    ok: bool | None  # None: not measured


def targets(res: Results) -> list[Target]:
    """The dispatch targets (latency against the peers and the transport floor, restart and start
    times), computed from the numbers."""
    out: list[Target] = []
    t4 = res.trips.get(4, {})
    for key, path in (("shard", "`Pool.run`"), ("shard-nb", "`%%distributed` in a kernel")):
        if key in t4:
            p50 = percentile(t4[key], 50)
            out.append(Target(f"Round trip p50 ≤ 1 ms, 4 ranks, {path}", f"{ms(p50)} ms", p50 <= 1e-3))
        else:
            out.append(Target(f"Round trip p50 ≤ 1 ms, 4 ranks, {path}", "not measured", None))
    for ours, theirs, what in (
        ("shard", "ipp", "`Pool.run` vs `view.execute`"),
        ("shard-nb", "ipp-nb", "`%%distributed` vs `%%px`"),
    ):
        name = f"Round trip ≥ 10× faster than ipyparallel, 4 ranks p50, {what}"
        if ours in t4 and theirs in t4:
            ratio = percentile(t4[theirs], 50) / percentile(t4[ours], 50)
            out.append(Target(name, f"{ratio:.1f}×", ratio >= 10))
        else:
            out.append(Target(name, "not measured", None))
    for ours, what in (("shard", "`Pool.run`"), ("shard-nb", "`%%distributed` in a kernel")):
        name = f"Round trip ≤ 3× the pyzmq floor, 4 ranks p50, {what}"
        if ours in t4 and "floor" in t4:
            ratio = percentile(t4[ours], 50) / percentile(t4["floor"], 50)
            out.append(Target(name, f"{ratio:.1f}×", ratio <= 3))
        else:
            out.append(Target(name, "not measured", None))
    w4 = res.warm.get(4, {})
    for key, what in (("shard", "`Pool.restart` + first run"), ("shard-nb", "`%dist_restart` + first cell")):
        name = f"Warm restart to first result ≤ 1 s, 4 CPU ranks, {what} (median)"
        if key in w4:
            out.append(Target(name, f"{w4[key].median:.2f} s", w4[key].median <= 1.0))
        else:
            out.append(Target(name, "not measured", None))
    for n, trips in sorted(res.trips.items()):
        extra = magic_overhead(trips)
        if extra is not None:
            name = f"`%%distributed` no-op p50 ≤ ipykernel `pass` + `Pool.run` + 1 ms, {n} ranks"
            out.append(Target(name, f"{extra * 1e3:+.2f} ms", extra <= 1e-3))
        own = magic_overhead(trips, run="shard-nb-run")
        if own is not None:
            name = f"`%%distributed` no-op p50 ≤ a cell calling `Pool.run` + 1 ms, {n} ranks"
            out.append(Target(name, f"{own * 1e3:+.2f} ms", own <= 1e-3))
    for n, cold in sorted(res.cold.items()):
        name = f"Cold start no slower than ipyparallel, {n} ranks (median, zygote)"
        if "shard" in cold and "ipp" in cold:
            shard_s, ipp_s = cold["shard"].median, cold["ipp"].median
            out.append(Target(name, f"{shard_s:.2f} s vs {ipp_s:.2f} s", shard_s <= ipp_s))
    return out


def magic_overhead(trips: dict[str, list[float]], run: str = "shard") -> float | None:
    """What a no-op ``%%distributed`` cell costs (p50s, seconds) over ipykernel's own ``pass`` cell
    and ``Pool.run`` run back to back (``run="shard"``) or after the ranks sat idle
    (``run="shard-paced"``), or over a kernel cell that calls ``Pool.run`` on the same pool
    (``run="shard-nb-run"``: the magic's own work, the wake-up of ranks idle between cells counted on
    both sides); None when one of them was not measured."""
    if run == "shard-nb-run":
        keys: tuple[str, ...] = ("shard-nb", "shard-nb-run")
    else:
        keys = ("shard-nb", "kernel", run)
    if not all(k in trips for k in keys):
        return None
    cell, *rest = (percentile(trips[k], 50) for k in keys)
    return cell - sum(rest)


def overhead_lines(res: Results) -> list[str]:
    """The ``%%distributed`` cell against ``pass`` + ``Pool.run``, per rank count."""
    out = []
    for n, trips in sorted(res.trips.items()):
        extra = magic_overhead(trips)
        if extra is not None:
            out.append(
                f"- {n} ranks: `%%distributed` overhead p50 {extra * 1e3:+.2f} ms "
                f"(= {ms(percentile(trips['shard-nb'], 50))} − ipykernel `pass` "
                f"{ms(percentile(trips['kernel'], 50))} − `Pool.run` {ms(percentile(trips['shard'], 50))})"
            )
        own = magic_overhead(trips, run="shard-nb-run")
        if own is not None:
            cell, run, kernel = (percentile(trips[k], 50) for k in ("shard-nb", "shard-nb-run", "kernel"))
            out.append(
                f"- {n} ranks: the magic's own work p50 {own * 1e3:+.2f} ms (= {ms(cell)} − a cell calling "
                f"`Pool.run` {ms(run)}; that cell − ipykernel `pass` = {ms(run - kernel)}: `Pool.run` once "
                "per cell, after the ranks sat idle)"
            )
        paced = magic_overhead(trips, run="shard-paced")
        if paced is not None:
            run, b2b = (percentile(trips[k], 50) for k in ("shard-paced", "shard"))
            out.append(
                f"- {n} ranks: `Pool.run` with no kernel, ranks idle {IDLE * 1e3:g} ms before each run, p50 "
                f"{ms(run)} against {ms(b2b)} back to back ({(run - b2b) * 1e3:+.2f} ms); the cell over "
                f"ipykernel `pass` + that run: {paced * 1e3:+.2f} ms"
            )
    return [*out, ""] if out else []


def ab_lines(res: Results) -> list[str]:
    """This tree against ``--baseline``: the ratio of their p50s, per rank count."""
    out = []
    for n, trips in sorted(res.trips.items()):
        if "shard-tree" in trips and "shard-base" in trips:
            tree, base = percentile(trips["shard-tree"], 50), percentile(trips["shard-base"], 50)
            out.append(
                f"- {n} ranks: this tree p50 {ms(tree)} ms, baseline p50 {ms(base)} ms; "
                f"baseline / this tree = {base / tree:.3f}"
            )
    return [*out, ""] if out else []


def trip_table(res: Results) -> list[str]:
    out = [
        "| ranks | system | p50 | p90 | p50 / pyzmq floor | p50 / ipykernel `pass` "
        "| ipyparallel / this, p50 (same path) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    pair = {"shard": "ipp", "jd": "ipp", "shard-nb": "ipp-nb", "shard-nb-bare": "ipp-nb", "jd-nb": "ipp-nb"}
    for n, trips in sorted(res.trips.items()):
        floor = percentile(trips["floor"], 50) if "floor" in trips else None
        kernel = percentile(trips["kernel"], 50) if "kernel" in trips else None
        for name in (k for k in ROUND_TRIP if k in trips):
            p50, p90 = percentile(trips[name], 50), percentile(trips[name], 90)
            vs_floor = f"{p50 / floor:.1f}×" if floor else ""
            vs_kernel = f"{p50 / kernel:.1f}×" if kernel and (name.endswith(("-nb", "-bare"))) else ""
            other = pair.get(name, "")
            vs_ipp = f"{percentile(trips[other], 50) / p50:.1f}×" if other in trips else ""
            out.append(
                f"| {n} | {ROUND_TRIP[name]} | {ms(p50)} | {ms(p90)} | {vs_floor} | {vs_kernel} | {vs_ipp} |"
            )
    return out


def start_table(
    table: dict[int, dict[str, Starts]], labels: dict[str, str], parts: tuple[str, str]
) -> list[str]:
    out = [
        f"| ranks | system | total, median (min–max) | {parts[0]} + {parts[1]} (medians) "
        "| vs jupyter_shard |",
        "|---:|---|---:|---:|---:|",
    ]
    for n, rows in sorted(table.items()):
        ours = rows.get("shard")
        for name, s in rows.items():
            total = s.total
            ratio = f"{s.median / ours.median:.2f}×" if ours and name != "shard" else ""
            out.append(
                f"| {n} | {labels[name]} "
                f"| {statistics.median(total):.2f} ({min(total):.2f}–{max(total):.2f}) "
                f"| {statistics.median(s.startup):.2f} + {statistics.median(s.first_cell):.3f} | {ratio} |"
            )
    return out


def report(res: Results, plots: list[str], stem: str = "dispatch") -> str:
    settings = res.settings
    out = [
        "# Dispatch: round trip, cold start and warm restart against ipyparallel and jupyter-distributed",
        "",
        f"Produced by `{res.command}`; how to read it: `benchmarks/README.md`. "
        f"Raw samples: `{stem}.json` beside this file.",
        "",
        "## Machine",
        "",
        *res.machine,
        "",
    ]
    if res.skipped:
        out += [f"- `{name}` has no numbers: {why}" for name, why in res.skipped.items()] + [""]
    if res.trips:
        out += [
            f"## No-op cell round trip (`{NOOP}`), ms: {settings['repeats']} timed "
            f"after {settings['warmup']} warm-up",
            "",
            "The kernel rows include the frontend hop (execute_request → iopub idle); "
            "the ratio column compares each system with ipyparallel on the same path "
            "(API with `view.execute`, kernel with `%%px`).",
            "",
            *trip_table(res),
            "",
            *overhead_lines(res),
            *ab_lines(res),
        ]
        out += [
            f"![Round trip p50 and p90 by rank count]({n})" for n in plots if n.endswith("-roundtrip.png")
        ]
        out += [""]
    if any(res.cold.values()):
        out += [
            f"## Cold start to first result, s: {settings['cold_repeats']} each, alternated",
            "",
            f"First cell `{FIRST_CELL}`; start = until every rank/engine answers, then the first cell.",
            "",
            *start_table(res.cold, COLD, ("start", "first cell")),
            "",
        ]
    if any(res.warm.values()):
        out += [
            f"## Warm restart to first result, s: {settings['warm_repeats']} each, alternated",
            "",
            *start_table(res.warm, WARM, ("restart", "first cell")),
            "",
        ]
    starts = [n for n in plots if n.endswith("-start.png")]
    out += [f"![Cold start and warm restart to first result]({n})" for n in starts] + ([""] if starts else [])
    out += [
        "## Targets, computed from the numbers above",
        "",
        *target_table((t.name, t.value, t.ok) for t in targets(res)),
    ]
    if res.leftovers:
        out += ["", "Processes still alive after their system was stopped (killed by the benchmark):", ""]
        out += [f"- {line}" for line in res.leftovers]
    return "\n".join(out) + "\n"
