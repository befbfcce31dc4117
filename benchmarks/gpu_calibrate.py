"""The dry run against the GPU: its predicted peak and reserved bytes beside what CUDA measured.

Run by ``gpu_check.py bench`` after the training rounds, on the same one-rank pool and the same model
(``gpu_check.TRAIN``'s GPT, whose class the rounds left in the rank's namespace). Each plan that one
GPU can run (``ddp`` at world size 1, in the pool's precision) is dry-run in the bench process with
``device="cuda"`` and the dry run's own default step, then the same step runs for real on the rank:
``DryRunPlan.peak_bytes`` is set against ``torch.cuda.max_memory_allocated`` and
``reserved_bytes`` against ``max_memory_reserved``, each counted from what the rank held before the
model was built. On CPU ranks (``--device cpu``) the dry run still runs and nothing is measured: the
report says so instead of showing a ratio.
"""

from __future__ import annotations

import json
from typing import Any

#: the dry run's default step (``tracing.default_step``), run for real on the rank: forward, the
#: output's mean in float32, backward, AdamW, gradients set to None; the peak of the second step
MEASURE = """
import gc, json, torch
gc.collect()
on_gpu = shard.device.type == "cuda"
if on_gpu:
    torch.cuda.synchronize(shard.device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(shard.device), torch.cuda.memory_reserved(shard.device)
model = GPT()
model, opt = shard.prepare(model, torch.optim.AdamW(model.parameters()))
tokens = torch.randint(vocab, ({batch}, {seq}), device=shard.device)
for n in range(2):
    if n == 1 and on_gpu:
        torch.cuda.reset_peak_memory_stats(shard.device)
    model(tokens).float().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
measured = json.dumps({{
    "allocated": torch.cuda.max_memory_allocated(shard.device) - base[0] if on_gpu else None,
    "reserved": torch.cuda.max_memory_reserved(shard.device) - base[1] if on_gpu else None,
}})
del model, opt, tokens
gc.collect()
"""


def model_code(train: str, sizes: dict[str, int]) -> str:
    """The part of the training cell that defines the model, as code the dry run builds from."""
    head = train.format(**sizes).split("model = GPT()")[0]
    return head + "model = GPT()\n"


def calibrate(
    pool: Any, train: str, sizes: dict[str, int], device: str, precision: str
) -> list[dict[str, Any]]:
    """One row per plan: the dry run's figures and, on a GPU, the measured ones."""
    from jupyter_shard.planner.dry_run import dry_run

    batch = f"torch.randint(0, {sizes['vocab']}, ({sizes['batch']}, {sizes['seq']}))"
    plan = dry_run(model_code(train, sizes), batch, 1, device, ["ddp"], precision=precision)["ddp"]
    pool.run(MEASURE.format(**sizes), timeout=300)
    measured = json.loads(pool.pull("measured"))
    return [
        {
            "plan": "ddp",
            "world_size": 1,
            "precision": precision,
            "batch": batch,
            "predicted_peak": plan.peak_bytes,
            "predicted_reserved": plan.reserved_bytes,
            "allocated": measured["allocated"],
            "reserved": measured["reserved"],
        }
    ]


def lines(rows: list[dict[str, Any]], error: str | None = None) -> list[str]:
    """The report's section: predicted against measured, with the ratio, per plan."""
    out = [
        "### The dry run against CUDA's allocator",
        "",
        "The benchmark's model under the dry run's default step (forward, mean, backward, AdamW), "
        "dry-run for the pool's device and then run for real on the one-rank pool; measured from what "
        "the rank held before the model was built, over the second step.",
        "",
    ]
    if error:
        out += [f"Not measured: `{error[:800]}`", ""]
    if not rows:
        return [*out, "No plan was calibrated (see the bench stage).", ""]
    out += [
        "| plan | precision | batch | predicted peak | max_memory_allocated | ratio | predicted reserved "
        "| max_memory_reserved | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mib = 2**20
        if r["allocated"] is None:
            measured = ["not measured (CPU ranks)", "–", "", "–"]
        else:
            measured = [
                f"{r['allocated'] / mib:.1f} MiB",
                f"{r['predicted_peak'] / max(r['allocated'], 1):.3f}",
                "",
                f"{r['reserved'] / mib:.1f} MiB",
            ]
        reserved_ratio = (
            f"{r['predicted_reserved'] / max(r['reserved'], 1):.3f}" if r["reserved"] is not None else "–"
        )
        out.append(
            f"| {r['plan']} (world size {r['world_size']}) | {r['precision']} | `{r['batch']}` "
            f"| {r['predicted_peak'] / mib:.1f} MiB | {measured[0]} | {measured[1]} "
            f"| {r['predicted_reserved'] / mib:.1f} MiB | {measured[3]} | {reserved_ratio} |"
        )
    return [*out, "", "Ratio = predicted / measured (1.000: exact; over 1: the dry run is cautious).", ""]
