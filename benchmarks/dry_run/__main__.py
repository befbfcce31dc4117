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
from benchmarks.dry_run.models import CASES, ZOO, Case, gpt_7b, parameter_count, zoo_case
from jupyter_shard.errors import SpecError
from jupyter_shard.planner.dry_run import STRATEGIES, dry_run

#: the plans compared with real pools here (the offload plans keep state on the host: no pool figure)
MEASURED = [name for name in STRATEGIES if "offload" not in name]

TOLERANCE = 0.05
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

inputs = list(batch.values()) if isinstance(batch, dict) else [batch]
external = [model, *inputs, *(p.ds_tensor for p in model.parameters() if hasattr(p, "ds_tensor"))]
external += [opt] if isinstance(opt, torch.optim.Optimizer) else held(opt)
tracker = MemTracker()
tracker.track_external(*external)
with tracker:
    for _ in range(2):
        loss = {loss}
        shard.backward(loss)
        shard.step()
        tracker.reset_mod_stats()
peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
del model, opt, tracker, loss, external, inputs
"""


Row = tuple[str, int, str, str, int | None, int, str]  # model, N, precision, plan, predicted, measured, why


def measure(
    world_size: int, pool_strategy: str, cases: tuple[Case, ...], precision: str = "32"
) -> dict[tuple[str, str], int]:
    """The measured peak (largest over ranks) per (case, plan name), from one pool per strategy."""
    from jupyter_shard import Pool
    from jupyter_shard.pool.output import ConsoleSink
    from jupyter_shard.spec import LaunchSpec

    out: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "options.json"
        config.write_text("{}")
        common: dict[str, object] = {"nproc": world_size, "device": "cpu", "precision": precision}
        if pool_strategy == "deepspeed":
            spec = LaunchSpec.create(strategy=pool_strategy, zero_stage=3, **common)  # type: ignore[arg-type]
        else:
            spec = LaunchSpec.create(strategy=pool_strategy, config=config, **common)  # type: ignore[arg-type]
        sink = ConsoleSink(io.StringIO(), io.StringIO())
        with Pool(spec=spec, log_dir=Path(scratch) / "logs", sink=sink) as pool:
            for name in POOLS[pool_strategy]:
                config.write_text(json.dumps(dict(STRATEGIES[name])) if pool_strategy == "fsdp" else "{}")
                for case in cases:
                    pool.run(MEASURE.format(source=case.source, batch=case.batch, loss=case.loss))
                    out[case.name, name] = max(pool.pull_all("peak").values())
    return out


def predict(
    world_size: int, cases: tuple[Case, ...], precision: str = "32"
) -> tuple[dict[tuple[str, str], int | str], float]:
    """The predicted peak per (case, plan name), or the one line the dry run refused the case with."""
    start = time.perf_counter()
    out: dict[tuple[str, str], int | str] = {}
    for case in cases:
        try:
            plans = dry_run(
                case.builder(), case.batch_value(), world_size, "cpu", MEASURED, precision=precision
            )
        except SpecError as exc:
            out.update({(case.name, name): str(exc) for name in MEASURED})
            continue
        for name, plan in plans.items():
            out[case.name, name] = plan.peak_bytes
    return out, time.perf_counter() - start


def peers(case: Case, world_size: int, precision: str) -> tuple[int, int, int]:
    """The model's parameter count, DeepSpeed's ZeRO-3 estimate per GPU (no offload, as the ZeRO-3 plan)
    and accelerate's training estimate (``accelerate estimate-memory``'s peak; no world size)."""
    from accelerate.commands.estimate import estimate_training_usage  # type: ignore[import-untyped]
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    model = case.builder()()
    count = parameter_count(model)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    _, gpu, _ = estimate_zero3_model_states_mem_needs(
        count, largest, num_gpus_per_node=world_size, cpu_offload=False, cpu_offload_params=False
    )
    usage = estimate_training_usage(count * 4, "bfloat16" if precision != "32" else "float32")
    return count, int(gpu), int(max(usage.values()))


def time_7b(world_size: int = 8) -> tuple[int, float, dict[str, int]]:
    start = time.perf_counter()
    plans = dry_run(gpt_7b, "torch.randint(0, 32000, (1, 2048))", world_size, strategies=MEASURED)
    elapsed = time.perf_counter() - start
    import torch

    with torch.device("meta"):
        count = parameter_count(gpt_7b())
    return count, elapsed, {name: plan.peak_bytes for name, plan in plans.items()}


def report(
    rows: list[Row],
    peer_rows: list[tuple[str, int, str, int, int, int, int]],
    seconds: dict[tuple[int, str], float],
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
        'Predicted: `jupyter_shard.planner.dry_run(build, batch, world_size, device="cpu", precision=P)`, '
        "peak bytes of rank 0 over two steps (forward, the output's mean or its `loss`, backward, AdamW; "
        "ZeRO-3 is modelled, not traced: full sharding with DeepSpeed's flat float32 optimizer partition "
        "and reduce bucket). Measured: a real "
        '`Pool(nproc=N, device="cpu", precision=P)` of that strategy runs the same two steps in a cell '
        "after `shard.prepare`, under torch's `MemTracker` on the real tensors (it counts every tensor "
        "storage allocated or written during the steps, plus the parameters, optimizer and batch "
        "registered before them); the largest peak over the ranks. The models named in lower case are "
        "`tests/zoo.py`'s, built from `transformers` configs (width 256, vocabulary 8,192, 2 layers; "
        "batch 8). MB = 10⁶ bytes.",
        "",
        f"| model | N | precision | strategy | predicted MB | measured MB | predicted / measured "
        f"| within {TOLERANCE:.0%} |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    for model, n, precision, name, predicted, measured, why in rows:
        if predicted is None:
            lines.append(
                f"| {model} | {n} | {precision} | {name} | not planned | {measured / 1e6:.2f} | "
                f"— | **no**: {why} |"
            )
            continue
        ratio = predicted / measured if measured else float("inf")
        ok = abs(ratio - 1) <= TOLERANCE
        lines.append(
            f"| {model} | {n} | {precision} | {name} | {predicted / 1e6:.2f} | {measured / 1e6:.2f} | "
            f"{ratio:.3f} | {'yes' if ok else '**no**'} |"
        )
    planned = [r for r in rows if r[4] is not None]
    within = sum(abs(r[4] / r[5] - 1) <= TOLERANCE for r in planned if r[4] is not None and r[5])
    lines += ["", "Dry-run time for all of the table's cases per world size and precision: "]
    lines[-1] += ", ".join(f"N={n} {p}: {s:.1f} s" for (n, p), s in sorted(seconds.items()))
    if peer_rows:
        lines += [
            "",
            "What each tool counts, per model: the dry run's plans against DeepSpeed's "
            "`estimate_zero3_model_states_mem_needs` (model states only, ZeRO-3 without offload, N GPUs; "
            "no activations) and accelerate's `estimate_training_usage` (the peak of `accelerate "
            "estimate-memory`'s training figures: no world size, no activations, no sharding).",
            "",
            "| model | N | precision | parameters | dry run, fsdp FULL_SHARD MB | dry run, ZeRO-3 MB "
            "| DeepSpeed's estimate MB | accelerate's estimate MB |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for model, n, precision, count, ds, acc, _ in peer_rows:
            ours = {r[3]: r[4] for r in rows if r[0] == model and r[1] == n and r[2] == precision}
            full, zero = ours.get("fsdp FULL_SHARD"), ours.get("deepspeed ZeRO-3")
            lines.append(
                f"| {model} | {n} | {precision} | {count / 1e6:.2f} M | {_mb(full)} | {_mb(zero)} | "
                f"{ds / 1e6:.2f} | {acc / 1e6:.2f} |"
            )
    targets: list[tuple[str, str, bool | None]] = [
        (
            f"predicted peak within {TOLERANCE:.0%} of measured",
            f"{within} of {len(rows)} cases ({len(rows) - len(planned)} not planned)",
            within == len(rows),
        )
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


def _mb(value: int | None) -> str:
    return "—" if value is None else f"{value / 1e6:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dry_run", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(POOLS), choices=list(POOLS))
    parser.add_argument("--precisions", nargs="+", default=["32", "bf16-mixed"], choices=["32", "bf16-mixed"])
    parser.add_argument("--models", nargs="+", help="only the cases of these names")
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: world size 2, fp32, no 7B")
    parser.add_argument("--results", default=str(RESULTS_FILE), help="'-' prints only")
    args = parser.parse_args()
    if args.quick:
        args.world_sizes, args.skip_7b, args.precisions = [2], True, ["32"]
    cases = (*CASES, *(zoo_case(name) for name in (ZOO if not args.quick else ("gpt2 tied",))))
    if args.models:
        cases = tuple(c for c in cases if c.name in args.models)
    start, before = time.perf_counter(), load_average()
    rows: list[Row] = []
    peer_rows: list[tuple[str, int, str, int, int, int, int]] = []
    seconds: dict[tuple[int, str], float] = {}
    with LoadWatch() as watch:
        big = None if args.skip_7b else time_7b()
        for n in args.world_sizes:
            for precision in args.precisions:
                predicted, seconds[n, precision] = predict(n, cases, precision)
                for case in cases:
                    peer_rows.append((case.name, n, precision, *peers(case, n, precision), 0))
                for pool_strategy in args.strategies:
                    measured = measure(n, pool_strategy, cases, precision)
                    for case in cases:
                        for name in POOLS[pool_strategy]:
                            guess = predicted[case.name, name]
                            rows.append(
                                (
                                    case.name,
                                    n,
                                    precision,
                                    name,
                                    guess if isinstance(guess, int) else None,
                                    measured[case.name, name],
                                    guess if isinstance(guess, str) else "",
                                )
                            )
                            print(rows[-1], flush=True)
    text = report(rows, peer_rows, seconds, big, watch.describe(), before, time.perf_counter() - start)
    write_section(text, args.results)


if __name__ == "__main__":
    main()
