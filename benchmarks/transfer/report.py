"""The transfer report: rates per size and rank count against ipyparallel and memcpy, the kernel's peak
memory, the targets computed from the numbers, and the rates plotted by size."""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cpu, pyplot, target_table

RATE_TARGET = 4.0  # GB/s, at 256 MiB
RATIO_TARGET = 10.0  # × ipyparallel's rate
RSS_TARGET = 1.2  # GiB of kernel peak RSS for 1 GiB to 4 ranks, or from one
IDLE, IDLE_SIZE = 5.0, 256  # s of pause before each "after idle" run, and at what size (MiB)


def report(res: dict[Any, Any], args: argparse.Namespace, machine: dict[str, Any], plots: list[str]) -> str:
    import ipyparallel
    import torch

    lines = [
        "# Moving values: push and pull against ipyparallel and memcpy",
        "",
        f"Produced by `.venv/bin/python -m benchmarks.transfer {' '.join(machine['argv'])}`; rates in GB/s "
        f"(10^9 bytes/s), median of {args.repeats} ({args.big_repeats} at 1 GiB) after one untimed run; "
        "push counts what all ranks received (N × size). How to read it: the docstring of the script.",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; whole run {machine['seconds']:.0f} s",
        f"- CPU: {cpu()}; {platform.platform()}; Python {platform.python_version()}",
        f"- torch {torch.__version__}, ipyparallel {ipyparallel.__version__}",
        f"- Load average before / after: {machine['loads']}; other runs seen: {machine['others'] or 'none'}",
        "",
    ]
    for n in args.ranks:
        lines += [
            f"## {n} ranks",
            "",
            "| size | push | ipyparallel push | ratio | pull | ipyparallel pull | ratio | push, messages | "
            "pull, messages | memcpy warm / fresh |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for size in args.sizes:
            row = res.get(n, {}).get(size, {})
            warm, fresh = res.get("memcpy", {}).get(size, (0.0, 0.0))
            lines.append(
                f"| {size} MiB | {_f(row, 'push')} | {_f(row, 'ipp-push')} | {_ratio(row, 'push')} | "
                f"{_f(row, 'pull')} | {_f(row, 'ipp-pull')} | {_ratio(row, 'pull')} | "
                f"{_f(row, 'push-msg')} | {_f(row, 'pull-msg')} | {warm:.1f} / {fresh:.1f} |"
            )
        lines.append("")
        idle = res.get(n, {}).get(IDLE_SIZE, {})
        if "push-idle" in idle:
            lines += [
                f"After {IDLE:.0f} s idle before each (as between notebook cells), {IDLE_SIZE} MiB: push "
                f"{idle['push-idle']:.2f} GB/s, pull {idle['pull-idle']:.2f} GB/s; memcpy into fresh "
                f"memory {res.get('memcpy-idle', 0.0):.2f} GB/s (back to back: {_f(idle, 'push')}, "
                f"{_f(idle, 'pull')} and {res.get('memcpy', {}).get(IDLE_SIZE, (0.0, 0.0))[1]:.2f}).",
                "",
            ]
        gathered = [(s, res.get(n, {}).get(s, {})) for s in args.gather_sizes]
        if any(any(k.startswith("gather-") for k in row) for _, row in gathered):
            lines += [
                "| gathered pull | to the kernel, GB/s | all-gather on the ranks, s | whole call, s | "
                "first call past its all-gather, s |",
                "|---|---:|---:|---:|---:|",
            ]
            for size, row in gathered:
                for label in ("fsdp", "ZeRO-3"):
                    if f"gather-{label}" in row:
                        rate, gather, total, first = row[f"gather-{label}"]
                        lines.append(
                            f"| {label}, {size} MiB | {rate:.2f} | {gather:.2f} | {total:.2f} | {first:.2f} |"
                        )
            lines.append("")
        big = res.get(n, {}).get(max(args.sizes), {})
        if "rss-push" in big:
            lines += [
                f"Kernel peak RSS above its RSS before, {max(args.sizes)} MiB: push to {n} ranks "
                f"{big['rss-push'] / 2**30:.2f} GiB, pull {big['rss-pull'] / 2**30:.2f} GiB "
                "(the pulled value itself included, every page read). A push is copied from the value "
                "itself into memory each rank offers: the kernel holds no copy of it.",
                "",
            ]
    tcp = res.get("tcp", {})
    if tcp:
        lines += [
            "## Over TCP: a torchrun pool of two one-rank nodes on this machine, shared memory off",
            "",
            "The path of ranks on other machines: values in 16 MiB parts, each acknowledged, over the "
            "pool's CurveZMQ-encrypted TCP socket.",
            "",
            "| size | push to 2 ranks | pull |",
            "|---|---:|---:|",
            *[f"| {size} MiB | {_f(row, 'push')} | {_f(row, 'pull')} |" for size, row in sorted(tcp.items())],
            "",
        ]
    if res.get("refused"):
        lines += ["Not measured: the pull was refused (the machine had no room for it then):", ""]
        lines += [f"- {line}" for line in res["refused"]] + [""]
    lines += [f"![Transfer rates]({p})" for p in plots] + [""]
    lines += ["## Targets, computed from the numbers above", "", *target_table(targets(res, args))]
    return "\n".join(lines) + "\n"


def _f(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "–"


def _ratio(row: dict[str, Any], what: str) -> str:
    if what in row and f"ipp-{what}" in row and row[f"ipp-{what}"] > 0:
        return f"{row[what] / row[f'ipp-{what}']:.1f}×"
    return "–"


def targets(res: dict[Any, Any], args: argparse.Namespace) -> list[tuple[str, str, bool | None]]:
    out: list[tuple[str, str, bool | None]] = []
    for n in args.ranks:
        row = res.get(n, {}).get(256, {})
        for what, label in (("push", f"push to {n} ranks"), ("pull", f"pull ({n}-rank pool)")):
            if what not in row or (what == "pull" and n != args.ranks[0]):
                continue
            rate = row[what]
            out.append((f"256 MiB {label} ≥ {RATE_TARGET:.0f} GB/s", f"{rate:.2f} GB/s", rate >= RATE_TARGET))
            if f"ipp-{what}" in row:
                ratio = rate / row[f"ipp-{what}"]
                out.append((f"256 MiB {label} ≥ 10× ipyparallel", f"{ratio:.1f}×", ratio >= RATIO_TARGET))
        big = res.get(n, {}).get(1024, {})
        if n == 4 and "rss-push" in big:
            for what in ("push", "pull"):
                rise = big[f"rss-{what}"] / 2**30
                out.append(
                    (
                        f"Kernel peak RSS, 1 GiB {what}, 4 ranks ≤ {RSS_TARGET} GiB",
                        f"{rise:.2f} GiB",
                        rise <= RSS_TARGET,
                    )
                )
    return out


def plot(res: dict[Any, Any], args: argparse.Namespace, folder: Path, stem: str) -> list[str]:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for ax, what in zip(axes, ("push", "pull"), strict=True):
        for n, style in zip(args.ranks, ("o-", "s--", "^:"), strict=False):
            rows = res.get(n, {})
            sizes = [s for s in args.sizes if what in rows.get(s, {})]
            for key, colour, label in (
                (what, "tab:blue", "jupyter_shard"),
                (f"ipp-{what}", "tab:red", "ipyparallel"),
                (f"{what}-msg", "tab:cyan", "jupyter_shard, messages"),
            ):
                xs = [s for s in sizes if key in rows[s]]
                if xs:
                    ax.plot(xs, [rows[s][key] for s in xs], style, color=colour, label=f"{label}, {n} ranks")
        memcpy = res.get("memcpy", {})
        xs = sorted(memcpy)
        ax.plot(xs, [memcpy[s][0] for s in xs], "k-", lw=0.8, label="memcpy, warm")
        ax.plot(xs, [memcpy[s][1] for s in xs], "k--", lw=0.8, label="memcpy, fresh memory")
        ax.axhline(RATE_TARGET, color="black", ls=":", lw=0.8, label=f"{RATE_TARGET:.0f} GB/s target")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(args.sizes, [f"{s} MiB" for s in args.sizes])
        ax.set_title("push: what all ranks received together" if what == "push" else "pull from rank 0")
        ax.set_ylabel("GB/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / f"{stem}-rates.png", dpi=120)
    plt.close(fig)
    return [f"{stem}-rates.png"]
