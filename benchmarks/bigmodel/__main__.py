"""Peak memory per rank while a big model is built, prepared and trained a step: ``fsdp`` and ZeRO-3,
built under ``shard.init_module()`` and built normally, side by side, against each strategy's formula.

The model is ``--depth`` blocks of a ``Linear(--width, --width)`` and a ``LayerNorm`` (22 × 4096: 1.48 GB
in fp32), SGD, one step on a batch of 4; 2 CPU ranks (gloo). Each repeat starts one pool per
strategy, warms it up with a small model (the strategies' one-time state), then runs the cell built
under ``shard.init_module()`` and the cell built normally, one after the other. A phase's peak is the
rank's resident memory above the cell's start (``VmHWM``, reset at the start) once the phase is done,
so it includes the phases before it; the table gives the larger rank's, median over repeats, in GB
and as a multiple of the model's bytes ``M``. Writes ``benchmarks/results/bigmodel.md``.
Run: ``.venv/bin/python -m benchmarks.bigmodel [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import io
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import RESULTS, LoadWatch, cpu, format_loads, target_table, write_section

NPROC = 2
PHASES = ("build", "prepare", "step")
STRATEGIES = {"fsdp": ("fsdp", {}), "ZeRO-3": ("deepspeed", {"zero_stage": 3})}
TARGET = 0.6  # building and preparing under init_module raises a rank's peak by ≤ 60 % of M


def formula(strategy: str, sharded: bool, n: int, layer: float) -> dict[str, str]:
    """Each phase's peak as the strategy keeps its tensors (fp32, SGD: no optimizer state), in M."""
    whole = "M"
    if strategy == "fsdp":
        build = "0" if sharded else whole
        return {
            "build": build,
            "prepare": f"M/{n} + L" if sharded else "M",
            "step": f"2 × M/{n} + a few L (parameter and gradient shards)",
        }
    return {
        "build": f"M/{n} + L" if sharded else whole,
        "prepare": f"3 × M/{n} (parameter, gradient and fp32 master partitions)",
        "step": f"3 × M/{n} + buffers of a few L",
    }


def measure(strategy: str, options: dict[str, Any], width: int, depth: int) -> dict[bool, dict[int, Any]]:
    """Both ways of building in one pool; by sharded, each rank's record (see ``BIG_MODEL``)."""
    from jupyter_shard import Pool
    from jupyter_shard.pool.output import ConsoleSink
    from jupyter_shard.spec import LaunchSpec
    from tests.integration.test_bigmodel import WARM_UP
    from tests.integration.training_cells import BIG_MODEL

    spec = LaunchSpec.create(nproc=NPROC, device="cpu", strategy=strategy, **options)
    runs: dict[bool, dict[int, Any]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="jsbench-") as tmp,
        Pool(spec=spec, log_dir=tmp, sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool,
    ):
        pool.run(BIG_MODEL + WARM_UP, timeout=600)
        for sharded in (True, False):
            pool.run(f"big = train_big({width}, {depth}, sharded={sharded})", timeout=600)
            runs[sharded] = pool.pull_all("big")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3, help="pools per strategy")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=22)
    parser.add_argument("--quick", action="store_true", help="smoke run: one repeat of a 34 MB model")
    parser.add_argument(
        "--results", default=str(RESULTS / "bigmodel.md"), help="markdown file to write; - only prints"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.width, args.depth = 1, 1024, 8
    results: dict[str, list[dict[bool, dict[int, Any]]]] = {name: [] for name in STRATEGIES}
    with LoadWatch() as watch:
        for repeat in range(args.repeats):
            for name, (strategy, options) in STRATEGIES.items():
                print(f"repeat {repeat + 1}/{args.repeats}: {name} ...", flush=True)
                results[name].append(measure(strategy, options, args.width, args.depth))
    write_section("\n".join(_report(results, args, watch)) + "\n", args.results)
    return 0


def _peak(repeats: list[dict[bool, dict[int, Any]]], sharded: bool, phase: str) -> float:
    """The larger rank's peak in a phase, median over repeats, in bytes."""
    return statistics.median(max(r["peaks"][phase] for r in run[sharded].values()) for run in repeats)


def _report(
    results: dict[str, list[dict[bool, dict[int, Any]]]], args: argparse.Namespace, watch: LoadWatch
) -> list[str]:
    import deepspeed
    import torch

    first = next(iter(results["fsdp"][0][True].values()))
    m = float(first["model_bytes"])
    layer = 4.0 * args.width * args.width
    loads = f"{format_loads(watch.before)} / {format_loads(watch.after)}"
    lines = [
        "# Big models: peak memory per rank, built under `shard.init_module()` and built normally",
        "",
        "Produced by `.venv/bin/python -m benchmarks.bigmodel"
        + (" --quick" if args.quick else f" --repeats {args.repeats}")
        + "`; how to read it: `benchmarks/README.md`.",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; whole run {watch.seconds:.0f} s",
        f"- CPU: {cpu()}; {platform.platform()}; Python {platform.python_version()}",
        f"- torch {torch.__version__}, deepspeed {deepspeed.__version__}",
        f"- Load average (1, 5, 15 min) before / after: {loads}; other benchmarks or test runs seen: "
        f"{', '.join(sorted(watch.others)) or 'none'}",
        "",
        f"Model: {args.depth} blocks of Linear({args.width}, {args.width}) + LayerNorm, "
        f"M = {m / 1e9:.2f} GB in fp32, largest layer L = {layer / 1e6:.0f} MB; SGD, one step on a batch "
        f"of 4; {NPROC} CPU ranks (gloo); {args.repeats} repeat(s), a new pool per strategy and repeat. "
        "A phase's peak is the rank's resident memory above the cell's start once the phase is done "
        "(phases before it included): the larger rank's, median over repeats, in GB and in M. fsdp "
        "defaults to one FSDP unit per block. ZeRO-3's buffers are sized by the largest layer.",
        "",
        "| strategy | built | phase | peak (GB) | peak (M) | formula |",
        "|---|---|---|---:|---:|---|",
    ]
    targets: list[tuple[str, str, bool | None]] = []
    for name, repeats in results.items():
        losses = {run[s][0]["loss"] for run in repeats for s in (True, False)}
        for sharded in (True, False):
            expected = formula("fsdp" if name == "fsdp" else "zero3", sharded, NPROC, layer)
            built = "`init_module`" if sharded else "normally"
            for phase in PHASES:
                peak = _peak(repeats, sharded, phase)
                lines.append(
                    f"| {name} | {built} | {phase} | {peak / 1e9:.2f} | {peak / m:.2f} | {expected[phase]} |"
                )
        shown = ", ".join(f"{v:.9f}" for v in sorted(losses))
        lines.append(f"| {name} | | loss, every run and both ways | {shown} | | |")
        prepared = _peak(repeats, True, "prepare") / m
        if name == "fsdp":
            targets.append(
                (
                    f"fsdp under init_module: build and prepare raise a rank's peak by ≤ {TARGET:.0%} of the "
                    f"model, {NPROC} CPU ranks",
                    f"{prepared:.2f} M",
                    prepared <= TARGET,
                )
            )
        targets.append(
            (
                f"{name}: the same loss built under init_module and built normally",
                f"{len(losses)} value(s)",
                len(losses) == 1,
            )
        )
    return [*lines, "", "### Targets", "", *target_table(targets)]


if __name__ == "__main__":
    sys.exit(main())
