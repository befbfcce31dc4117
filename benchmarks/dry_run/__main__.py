"""The dry run's predicted per-rank peak against the peak measured in a real pool of CPU ranks.

For each model of :mod:`benchmarks.dry_run.models` (an MLP, a small GPT, a model with a large
embedding), each world size (2 and 4) and each strategy (``ddp``, ``fsdp`` FULL_SHARD and
SHARD_GRAD_OP, ``deepspeed`` ZeRO-3), ``jupyter_shard.planner.dry_run`` predicts the peak bytes one rank
holds over two training steps (forward, mean of the output, backward, AdamW step); then a real
``Pool(nproc=N, device="cpu", strategy=...)`` builds the same model, ``shard.prepare``\\ s it and runs
the same two steps in a cell, under torch's ``MemTracker`` (``torch.distributed._tools``) on the real
tensors, which counts every tensor storage allocated or written during the steps, and the parameters,
optimizer and batch registered before them. The measured figure is the largest peak over the ranks.

Also times the dry run of a 7B GPT at world size 8 (the plans measured here). Writes
``benchmarks/results/dry_run.md`` (``--results PATH`` elsewhere, ``-`` only prints), the section
``python -m benchmarks.run_all`` assembles into ``benchmarks/RESULTS.md``.
Run: ``.venv/bin/python -m benchmarks.dry_run [--world-sizes 2 4] [--skip-7b] [--quick]``
(``--quick``: world size 2 only, no 7B).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.common import RESULTS, LoadWatch, cpu, load_average, target_table, write_section
from benchmarks.dry_run.models import CASES, Case, gpt_7b, parameter_count
from jupyter_shard.planner.dry_run import STRATEGIES, dry_run

#: the plans compared with real pools here (the offload plans keep state on the host: no pool figure)
MEASURED = [name for name in STRATEGIES if "offload" not in name]

TOLERANCE = 0.10
RESULTS_FILE = RESULTS / "dry_run.md"
POOLS = {"ddp": ["ddp"], "fsdp": ["fsdp FULL_SHARD", "fsdp SHARD_GRAD_OP"], "deepspeed": ["deepspeed ZeRO-3"]}

MEASURE = """
import torch
from torch.distributed._tools.mem_tracker import MemTracker
{source}
torch.manual_seed(0)
model = build()
opt = torch.optim.AdamW(model.parameters())
model, opt = shard.prepare(model, opt)
batch = {batch}

def held(obj, depth=2):
    # the tensors a DeepSpeed optimizer holds (its partitions and buffers): it is no torch Optimizer
    values = vars(obj).values() if hasattr(obj, "__dict__") else obj
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif depth and isinstance(value, (list, tuple)):
            found += held(value, depth - 1)
        elif depth and isinstance(value, dict):
            found += held(list(value.values()), depth - 1)
    return found

external = [model, batch, *(p.ds_tensor for p in model.parameters() if hasattr(p, "ds_tensor"))]
external += [opt] if isinstance(opt, torch.optim.Optimizer) else held(opt)
tracker = MemTracker()
tracker.track_external(*external)
with tracker:
    for _ in range(2):
        loss = model(batch).float().mean()
        shard.backward(loss)
        shard.step()
        tracker.reset_mod_stats()
peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
del model, opt, tracker, loss, external
"""


def measure(world_size: int, pool_strategy: str, cases: tuple[Case, ...]) -> dict[tuple[str, str], int]:
    """The measured peak (largest over ranks) per (case, plan name), from one pool per strategy."""
    from jupyter_shard import Pool
    from jupyter_shard.pool.output import ConsoleSink
    from jupyter_shard.spec import LaunchSpec

    out: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "options.json"
        config.write_text("{}")
        if pool_strategy == "deepspeed":
            spec = LaunchSpec.create(nproc=world_size, device="cpu", strategy=pool_strategy, zero_stage=3)
        else:
            spec = LaunchSpec.create(nproc=world_size, device="cpu", strategy=pool_strategy, config=config)
        sink = ConsoleSink(io.StringIO(), io.StringIO())
        with Pool(spec=spec, log_dir=Path(scratch) / "logs", sink=sink) as pool:
            for name in POOLS[pool_strategy]:
                config.write_text(json.dumps(dict(STRATEGIES[name])) if pool_strategy == "fsdp" else "{}")
                for case in cases:
                    pool.run(MEASURE.format(source=case.source, batch=case.batch))
                    out[case.name, name] = max(pool.pull_all("peak").values())
    return out


def predict(world_size: int, cases: tuple[Case, ...]) -> tuple[dict[tuple[str, str], int], float]:
    start = time.perf_counter()
    out = {}
    for case in cases:
        for name, plan in dry_run(
            case.builder(), case.batch, world_size, device="cpu", strategies=MEASURED
        ).items():
            out[case.name, name] = plan.peak_bytes
    return out, time.perf_counter() - start


def time_7b(world_size: int = 8) -> tuple[int, float, dict[str, int]]:
    start = time.perf_counter()
    plans = dry_run(gpt_7b, "torch.randint(0, 32000, (1, 2048))", world_size, strategies=MEASURED)
    elapsed = time.perf_counter() - start
    import torch

    with torch.device("meta"):
        count = parameter_count(gpt_7b())
    return count, elapsed, {name: plan.peak_bytes for name, plan in plans.items()}


def report(
    rows: list[tuple[str, int, str, int, int]],
    seconds: dict[int, float],
    big: tuple[int, float, dict[str, int]] | None,
    load: str,
    before: str,
    whole: float,
) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Dry run: predicted against measured peak per rank",
        "",
        f"{stamp}: {platform.platform()}, {cpu()}, Python {platform.python_version()}; load average "
        f"(1 min) before {before}, during the run {load}; whole run {whole:.0f} s.",
        "",
        'Predicted: `jupyter_shard.planner.dry_run(build, batch, world_size, device="cpu")`, peak bytes of '
        "rank 0 over two steps (forward, mean of the output, backward, AdamW; ZeRO-3 is modelled, not "
        "traced: full sharding with DeepSpeed's flat float32 optimizer partition and reduce bucket). "
        "Measured: a real "
        '`Pool(nproc=N, device="cpu")` of that strategy runs the same two steps in a cell after '
        "`shard.prepare`, under torch's `MemTracker` on the real tensors (it counts every tensor storage "
        "allocated or written during the steps, plus the parameters, optimizer and batch registered "
        "before them); the largest peak over the ranks. MB = 10⁶ bytes.",
        "",
        "| model | N | strategy | predicted MB | measured MB | predicted / measured | within 10% |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for model, n, name, predicted, measured in rows:
        ratio = predicted / measured if measured else float("inf")
        ok = abs(ratio - 1) <= TOLERANCE
        lines.append(
            f"| {model} | {n} | {name} | {predicted / 1e6:.2f} | {measured / 1e6:.2f} | {ratio:.3f} | "
            f"{'yes' if ok else '**no**'} |"
        )
    within = sum(abs(p / m - 1) <= TOLERANCE for *_, p, m in rows if m)
    lines += ["", "Dry-run time for all of the table's cases per world size: "]
    lines[-1] += ", ".join(f"N={n}: {s:.1f} s" for n, s in sorted(seconds.items()))
    targets: list[tuple[str, str, bool | None]] = [
        ("predicted peak within 10% of measured", f"{within} of {len(rows)} cases", within == len(rows))
    ]
    if big is not None:
        count, elapsed, peaks = big
        lines += [
            "",
            f"7B GPT ({count / 1e9:.2f}B parameters, batch 1 x 2048 tokens) at world size 8, the four "
            f"plans above: {elapsed:.1f} s. Predicted peak per rank: "
            + ", ".join(f"{n} {b / 2**30:.1f} GiB" for n, b in peaks.items())
            + ".",
        ]
        targets.append(("7B at world size 8 planned in under a minute", f"{elapsed:.1f} s", elapsed < 60))
    return "\n".join([*lines, "", *target_table(targets), ""])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dry_run", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(POOLS), choices=list(POOLS))
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: world size 2, no 7B")
    parser.add_argument("--results", default=str(RESULTS_FILE), help="'-' prints only")
    args = parser.parse_args()
    if args.quick:
        args.world_sizes, args.skip_7b = [2], True
    start, before = time.perf_counter(), load_average()
    rows: list[tuple[str, int, str, int, int]] = []
    seconds: dict[int, float] = {}
    with LoadWatch() as watch:
        big = None if args.skip_7b else time_7b()
        for n in args.world_sizes:
            predicted, seconds[n] = predict(n, CASES)
            for pool_strategy in args.strategies:
                measured = measure(n, pool_strategy, CASES)
                for case in CASES:
                    for name in POOLS[pool_strategy]:
                        rows.append(
                            (case.name, n, name, predicted[case.name, name], measured[case.name, name])
                        )
                        print(rows[-1], flush=True)
    text = report(rows, seconds, big, watch.describe(), before, time.perf_counter() - start)
    write_section(text, args.results)


if __name__ == "__main__":
    main()
