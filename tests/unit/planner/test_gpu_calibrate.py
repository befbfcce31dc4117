"""The GPU check's calibration: the benchmark's model dry-runs, and the report sets each figure
against CUDA's, or says that nothing was measured."""

from __future__ import annotations

from benchmarks import gpu_calibrate, gpu_check
from jupyter_shard.planner.dry_run import dry_run


def test_the_benchmarks_model_plans_from_its_training_cell() -> None:
    sizes = gpu_check.SIZES[("cpu", True)]
    code = gpu_calibrate.model_code(gpu_check.TRAIN, sizes)
    assert code.rstrip().endswith("model = GPT()") and "shard." not in code
    batch = f"torch.randint(0, {sizes['vocab']}, ({sizes['batch']}, {sizes['seq']}))"
    plan = dry_run(code, batch, 1, "cuda", ["ddp"])["ddp"]
    assert plan.reserved_bytes >= plan.peak_bytes > 0


def row(allocated: int | None, reserved: int | None) -> dict[str, object]:
    return {
        "plan": "ddp",
        "world_size": 1,
        "precision": "bf16-mixed",
        "batch": "torch.randint(0, 8, (2, 4))",
        "predicted_peak": 110 << 20,
        "predicted_reserved": 120 << 20,
        "allocated": allocated,
        "reserved": reserved,
    }


def test_the_report_gives_the_ratios_or_says_nothing_was_measured() -> None:
    text = "\n".join(gpu_calibrate.lines([row(100 << 20, 150 << 20)]))
    assert "| 110.0 MiB | 100.0 MiB | 1.100 |" in text and "| 120.0 MiB | 150.0 MiB | 0.800 |" in text
    text = "\n".join(gpu_calibrate.lines([row(None, None)]))
    assert "not measured (CPU ranks)" in text and "1.100" not in text
    text = "\n".join(gpu_calibrate.lines([], "RuntimeError: CUDA out of memory"))
    assert "Not measured: `RuntimeError: CUDA out of memory`" in text and "No plan was calibrated" in text
