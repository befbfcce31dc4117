"""jupyter_shard.notebook.picker_confirm without rank processes: which pool can confirm which plan
(each refusal one line, before any dry run), and how the batch steps down by bisection when the
real step runs out of memory. The real step is in tests/integration/test_picker_confirm.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.notebook.picker import picker
from jupyter_shard.notebook.picker_confirm import (
    Attempt,
    Confirmation,
    RankStep,
    confirm,
    confirm_line,
    pool_plan,
)
from jupyter_shard.notebook.picker_dry_run import DryRunArgs, parse_line
from jupyter_shard.planner.free_memory import MemorySnapshot
from jupyter_shard.spec import Device, LaunchSpec, Offload, Precision, SpecError

MIB = 2**20
LINE = "build --batch 'torch.randn(4, 16)' --find-batch --confirm"


class StartedPool:
    """A started pool as the checks see it; running anything on it fails the test."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.started = True
        self.world_size = spec.world_size

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"pool.{name} used: nothing may run before the checks pass")


def pool(tmp_path: Path, strategy: str = "ddp", nproc: int = 2, **kw: Any) -> Any:
    config = kw.pop("config", None)
    if config is not None:
        path = tmp_path / "options.json"
        path.write_text(json.dumps(config))
        kw["config"] = path
    return StartedPool(LaunchSpec.create(nproc=nproc, device="cpu", strategy=strategy, **kw))


def args(**kw: Any) -> DryRunArgs:
    return DryRunArgs(
        **{"model": "build", "batch": "torch.randn(4, 16)", "world_size": 2, "device": Device.CPU, **kw}
    )


def test_confirm_is_parsed_and_needs_find_batch() -> None:
    assert parse_line(LINE, gpu_count=0).confirm
    assert not parse_line("build --batch 'torch.randn(4, 16)' --find-batch", gpu_count=0).confirm
    with pytest.raises(
        SpecError, match=r"^%dist_picker: --confirm runs the batch --find-batch finds .*add --find-batch$"
    ):
        parse_line("build --batch 'torch.randn(4, 16)' --confirm", gpu_count=0)


@pytest.mark.parametrize(
    ("strategy", "kw", "name"),
    [
        ("ddp", {}, "ddp"),
        ("fsdp", {}, "fsdp FULL_SHARD"),
        ("fsdp", {"config": {"sharding": "shard_grad_op"}}, "fsdp SHARD_GRAD_OP"),
        ("fsdp", {"offload": Offload.CPU}, "fsdp FULL_SHARD + offload"),
        ("deepspeed", {"zero_stage": 3}, "deepspeed ZeRO-3"),
    ],
)
def test_the_pool_names_the_plan_it_runs(
    tmp_path: Path, strategy: str, kw: dict[str, Any], name: str
) -> None:
    assert pool_plan(args(), pool(tmp_path, strategy, **kw)) == name
    assert pool_plan(args(strategy=strategy), pool(tmp_path, strategy, **kw)) == name


@pytest.mark.parametrize(
    ("make", "given", "says"),
    [
        (
            None,
            {},
            "--confirm runs a real step on the live pool, and none is running; start one with",
        ),
        ({"nproc": 4}, {}, "the pool runs 4 ranks, not --world-size 2"),
        ({"precision": Precision.BF16_MIXED}, {}, "the pool runs --precision bf16-mixed, not 32"),
        ({}, {"device": Device.CUDA}, "the pool runs --device cpu, not cuda"),
        ({"strategy": "none"}, {}, "a strategy the dry run does not plan"),
        ({"strategy": "deepspeed", "zero_stage": 2}, {}, "a strategy the dry run does not plan"),
        (
            {"strategy": "fsdp"},
            {"strategy": "ddp"},
            "the pool runs 'fsdp FULL_SHARD' and the plan is for --strategy 'ddp'",
        ),
    ],
)
def test_a_pool_that_cannot_confirm_the_plan_is_one_line(
    tmp_path: Path, make: dict[str, Any] | None, given: dict[str, Any], says: str
) -> None:
    live = None if make is None else pool(tmp_path, **{"strategy": "ddp", **make})
    with pytest.raises(SpecError) as caught:
        pool_plan(args(**given), live)
    message = str(caught.value)
    assert message.startswith("%dist_picker: --confirm") and says in message and "\n" not in message


def test_the_checks_come_before_any_dry_run(tmp_path: Path) -> None:
    def build() -> Any:
        raise AssertionError("the model was built: a dry run ran before the checks")

    memory = MemorySnapshot((), 1 << 30, "")
    with pytest.raises(SpecError, match="the pool runs 4 ranks"):
        confirm_line(LINE + " --world-size 2", {"build": build}, pool(tmp_path, nproc=4), memory=memory)
    with pytest.raises(SpecError, match="none is running"):
        confirm_line(LINE, {"build": build}, None, memory=memory)
    with pytest.raises(SpecError, match="none is running"):  # the picker sends --confirm there
        picker(LINE, {"build": build}, None, print)
    with pytest.raises(SpecError, match="none is running"):
        picker("--batch 'torch.randn(4, 16)' --find-batch --confirm", {}, None, print, cell="build()")


def steps(size: int, peak: int = 10 * MIB) -> tuple[RankStep, ...]:
    return tuple(RankStep(rank, peak + rank, None, "a test") for rank in range(2))


def fake_attempts(largest: int, tried: list[int]) -> Any:
    """Real steps that fit up to ``largest`` and run out of memory above it."""

    def attempt(size: int) -> Attempt:
        tried.append(size)
        if size > largest:
            return Attempt(size, 12 * MIB, out_of_memory="rank 1: OutOfMemoryError: CUDA out of memory")
        return Attempt(size, 10 * MIB, steps(size))

    return attempt


def run_confirm(tmp_path: Path, found: int, largest: int, tried: list[int]) -> Confirmation:
    live = pool(tmp_path)
    return confirm(live, args(), "ddp", found, 4, lambda n: None, 32 * MIB, fake_attempts(largest, tried))


def test_a_batch_that_fits_for_real_is_one_step_reported_per_rank(tmp_path: Path) -> None:
    tried: list[int] = []
    result = run_confirm(tmp_path, 64, 64, tried)
    assert tried == [64] and result.confirmed == 64
    text = "\n".join(result.lines())
    assert "rank 0: measured 10.0 MiB, predicted 10.0 MiB (+0.0%), 32.0 MiB free: fits" in text
    assert "rank 1: measured" in text and "Batch 64 confirmed." in text and "measured with a test" in text


def test_out_of_memory_steps_the_batch_down_by_bisection_and_says_so(tmp_path: Path) -> None:
    tried: list[int] = []
    result = run_confirm(tmp_path, 64, 37, tried)
    assert tried == [64, 32, 48, 40, 36, 38, 37]
    assert result.confirmed == 37 and result.found == 64
    text = "\n".join(result.lines())
    assert (
        "batch 64: out of memory (rank 1: OutOfMemoryError: CUDA out of memory); stepping the batch down"
        in text
    )
    assert "Batch 64 did not fit for real; 37 did, the largest the bisection found." in text


def test_when_not_even_a_batch_of_1_runs_it_says_so(tmp_path: Path) -> None:
    tried: list[int] = []
    result = run_confirm(tmp_path, 8, 0, tried)
    assert tried == [8, 4, 2, 1] and result.confirmed == 0
    assert result.lines()[-1] == "No batch size ran on the pool: not even a batch of 1 fits."
    nothing: list[int] = []
    unfound = run_confirm(tmp_path, 0, 0, nothing)
    assert nothing == [] and unfound.lines()[-1].startswith("Nothing to confirm: the dry run found no batch")


def test_a_measured_peak_over_the_free_memory_does_not_fit() -> None:
    result = Confirmation("ddp", 2, 16, 8 * MIB, [Attempt(16, 9 * MIB, steps(16, 9 * MIB))])
    text = "\n".join(result.lines())
    assert "8.0 MiB free: does not fit" in text and "Batch 16 confirmed, but over the free memory." in text
    on_cuda = Confirmation("ddp", 2, 16, None, [Attempt(16, None, (RankStep(0, 9 * MIB, 80 * MIB, "cuda"),))])
    assert "predicted ?, 80.0 MiB free: fits" in "\n".join(on_cuda.lines())
