"""``%dist_picker MODEL --batch EXPR``: the picker on a dry run of the user's model, judged against the
free memory of a named GPU or of the pool's devices; every bad input is one line and the picker stays
usable. Tiny models keep each dry run well under a second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jupyter_shard.notebook.picker import DryRunPicker, Picker, picker
from jupyter_shard.notebook.picker_dry_run import GPUS, ORDER, Outcome, plan_line, wants_dry_run
from jupyter_shard.notebook.picker_dry_run_view import report
from jupyter_shard.notebook.picker_inputs import batch_shape
from jupyter_shard.planner.dry_run import dry_run
from jupyter_shard.planner.estimate import HEADROOM
from jupyter_shard.planner.free_memory import MemorySnapshot
from jupyter_shard.spec import SpecError

GIB = 2**30
BATCH = '--batch "torch.randn(4, 16)"'


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.up(x).relu())
        return out


def build() -> nn.Module:
    return nn.Sequential(Block(), Block())


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def namespace() -> dict[str, Any]:
    return {"model": build(), "build": build, "number": 3}


def gpus(free: int, count: int = 2) -> MemorySnapshot:
    return MemorySnapshot(((free, 80 * GIB),) * count, 200 * GIB, "nvidia-smi")


def run(line: str, memory: MemorySnapshot | None = None, **kw: Any) -> Outcome:
    return plan_line(line, namespace(), memory=memory or gpus(0, 0), gpu_count=2, **kw)


def test_only_a_line_with_options_is_a_dry_run() -> None:
    assert not wants_dry_run("1.3B") and not wants_dry_run("model") and not wants_dry_run("")
    assert wants_dry_run(f"model {BATCH}") and wants_dry_run('model --batch "unclosed')


def test_a_named_gpu_gets_every_plan_and_the_fastest_that_fits() -> None:
    sent: list[dict[str, Any]] = []
    defaults: list[str] = []
    p = picker(f"model {BATCH} --world-size 2 --gpu 'h100 80gb'", namespace(), None, defaults.append)
    assert isinstance(p, DryRunPicker)
    out = p.outcome
    assert [v.name for v in out.verdicts] == list(ORDER)
    assert out.free == GPUS["H100 80GB"] and out.usable == int(HEADROOM * GPUS["H100 80GB"])
    assert out.recommended == "ddp" and all(v.fits for v in out.verdicts)
    assert p.line == "%%distributed --strategy ddp --gpus 2"
    for v in out.verdicts:
        plan = v.plan
        parts = plan.parameters + plan.gradients + plan.optimizer + plan.activations + plan.transient
        assert parts == plan.peak_bytes > 0 and (plan.host_bytes > 0) == ("offload" in v.name)
    assert "peak" in p.report and "fsdp FULL_SHARD" in p.report and "traced:" in p.report
    assert "within 10% of the measured peak" in p.report  # ZeRO-3's figure says how far off it has been
    assert "Largest batch" not in p.report
    p.send = lambda content, buffers=None: sent.append(content)
    p.insert_cell()
    assert sent == [{"event": "insert-cell", "code": p.line}]
    p.use_as_default()
    assert defaults == [p.line]


def test_a_builder_and_the_pools_memory_without_a_named_gpu() -> None:
    out = run(f"build {BATCH} --world-size 2", memory=gpus(10 * GIB))
    assert out.free == 10 * GIB and out.free_source == "nvidia-smi" and out.recommended == "ddp"


def test_unknown_memory_recommends_the_fastest_and_says_how_to_judge_the_fit() -> None:
    out = run(f"model {BATCH} --world-size 2")
    assert out.usable is None and out.recommended == "ddp"
    assert all(v.fits is None and not v.fixes for v in out.verdicts)
    assert '--gpu "H100 80GB"' in out.reason


def test_where_ddp_does_not_fit_a_sharded_plan_is_recommended_with_its_config() -> None:
    plans = dry_run(build, "torch.randn(4, 16)", 2, "cuda")
    # room for the fastest sharded plan, not for ddp
    sharded = min(p.peak_bytes for n, p in plans.items() if n != "ddp")
    free = int(sharded / HEADROOM) + 64
    assert plans["ddp"].peak_bytes > HEADROOM * free
    p = DryRunPicker(run(f"model {BATCH} --world-size 2", memory=gpus(free)), lambda line: None)
    out = p.outcome
    expected = next(n for n in ORDER if plans[n].peak_bytes <= out.usable)  # type: ignore[operator]
    assert out.recommended == expected != "ddp"
    ddp = out.verdicts[0]
    assert ddp.fits is False and ddp.over == plans["ddp"].peak_bytes - int(HEADROOM * free)
    assert any("more ranks do not help" in f.what for f in ddp.fixes)
    assert "--strategy fsdp" in p.line or "--strategy deepspeed" in p.line
    if p.config is not None:  # SHARD_GRAD_OP: the line names the config, written when inserted
        p.send = lambda content, buffers=None: None
        p.insert_cell()
        assert (Path.cwd() / p.config_file).exists() and f"--config {p.config_file}" in p.line


def test_nothing_fits_each_plan_says_what_would_with_its_peak() -> None:
    plans = dry_run(build, "torch.randn(64, 16)", 2, "cuda")
    # room for no plan that keeps its state on the device; offload, the leanest, still fits
    free = int(min(p.peak_bytes for n, p in plans.items() if "offload" not in n) * 0.9 / HEADROOM)
    p = DryRunPicker(run('model --batch "torch.randn(64, 16)" --world-size 2', memory=gpus(free)), print)
    out = p.outcome
    assert out.recommended == "fsdp FULL_SHARD + offload"
    for v in out.verdicts[: ORDER.index("fsdp FULL_SHARD + offload")]:
        assert v.fits is False and v.over > 0 and v.fixes
        smaller = [f for f in v.fixes if "the largest that fits" in f.what]
        assert smaller and smaller[0].peak is not None and smaller[0].peak <= out.usable  # type: ignore[operator]
        if v.name != "ddp":
            doubled = [f for f in v.fixes if f.what.startswith("4 ranks")]
            assert doubled and doubled[0].peak is not None
    assert "to fit fsdp FULL_SHARD: a batch of" in p.report
    # one plan that does not fit: nothing to recommend, no line
    full = plans["fsdp FULL_SHARD"].peak_bytes
    line = 'model --batch "torch.randn(64, 16)" --world-size 2 --strategy "fsdp FULL_SHARD"'
    p = DryRunPicker(run(line, memory=gpus(int(full * 0.9 / HEADROOM))), print)
    out = p.outcome
    assert out.recommended is None and p.line == "" and p.buttons["insert"].disabled
    assert out.reason.startswith("Nothing fits") and out.verdicts[0].fixes


def test_where_only_offload_fits_the_suggestion_shows_the_traced_offload_plan() -> None:
    plans = dry_run(build, "torch.randn(4, 16)", 2, "cuda")
    offloaded = plans["fsdp FULL_SHARD + offload"]
    free = int(offloaded.peak_bytes / HEADROOM) + 64
    assert plans["fsdp FULL_SHARD"].peak_bytes > HEADROOM * free  # only offload plans fit
    p = DryRunPicker(run(f"model {BATCH} --world-size 2", memory=gpus(free)), print)
    out = p.outcome
    assert out.recommended == "fsdp FULL_SHARD + offload"
    assert p.line == "%%distributed --strategy fsdp --gpus 2 --offload cpu"
    full = next(v for v in out.verdicts if v.name == "fsdp FULL_SHARD")
    offload = [f for f in full.fixes if f.what.startswith("--offload cpu")]
    assert len(offload) == 1 and offload[0].traced and offload[0].peak == offloaded.peak_bytes
    assert "(fsdp FULL_SHARD + offload, traced)" in offload[0].what and "fits" in offload[0].what
    assert (
        "(trace less the saving)" not in p.report.split("to fit fsdp FULL_SHARD: --offload")[1].split("\n")[0]
    )


def test_bf16_mixed_is_planned_and_carried_on_the_recommended_line() -> None:
    line = f"model {BATCH} --world-size 2 --gpu 'H100 80GB' --strategy 'fsdp FULL_SHARD'"
    full = DryRunPicker(run(line), print)
    mixed = DryRunPicker(run(f"{line} --precision bf16-mixed"), print)
    assert mixed.outcome.args.precision == "bf16-mixed" and full.outcome.args.precision == "32"
    assert mixed.line == "%%distributed --strategy fsdp --gpus 2 --precision bf16-mixed"
    assert full.line == "%%distributed --strategy fsdp --gpus 2"
    assert mixed.outcome.verdicts[0].plan.precision == "bf16-mixed"
    assert "MixedPrecisionPolicy" in mixed.report and ", bf16-mixed, per rank" in mixed.report


def test_find_batch_gives_the_largest_batch_that_fits() -> None:
    out = run(f"model {BATCH} --world-size 2 --strategy 'fsdp FULL_SHARD' --find-batch", memory=gpus(3 << 20))
    assert out.largest_batch is not None and out.usable is not None
    name, size, peak = out.largest_batch
    assert name == "fsdp FULL_SHARD" and size > 4 and peak is not None and peak <= out.usable
    above = dry_run(build, f"torch.randn({size + 1}, 16)", 2, "cuda", [name])[name]
    assert above.peak_bytes > out.usable
    assert f"Largest batch with fsdp FULL_SHARD: {size}" in report(out, "")


def test_the_batch_is_kept_as_shapes_for_any_size() -> None:
    shape = batch_shape('(torch.randn(8, 3), {"ids": torch.randint(0, 9, (8, 5)), "m": torch.ones(2)})', {})
    assert shape.size == 8
    assert shape.expression(3) == (
        "(torch.zeros((3, 3), dtype=torch.float32), {'ids': torch.zeros((3, 5), dtype=torch.int64), "
        "'m': torch.zeros((2,), dtype=torch.float32)})"
    )


def raising_step(model: nn.Module, batch: object) -> None:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (f"nope {BATCH}", "the model expression 'nope' raised NameError"),
        (f"number {BATCH}", "number is a int; pass a variable holding an nn.Module"),
        ("model --batch 'torch.randn(4, 7)'", "pass a batch the model's forward takes"),
        ("model --batch 'torch.randn(4, 16'", "--batch 'torch.randn(4, 16' raised SyntaxError"),
        ("model --batch '3'", "--batch is a int, not tensors"),
        ("model --batch 'torch.tensor(1.0)'", "is a 0-dimensional tensor"),
        (f"model {BATCH} --step raising_step", "the step function raised RuntimeError: boom"),
        (f"model {BATCH} --step number", "--step number is a int; pass a function step(model, batch)"),
        (f"model {BATCH} --world-size 0", "--world-size 0 is not valid; give the number of ranks"),
        (f"model {BATCH} --world-size 1 --strategy fsdp", "plan them with world_size of 2 or more"),
        (f"model {BATCH} --gpu 'B9000'", "GPU 'B9000' is not known; name one of: H200"),
        (f"model {BATCH} --gpu L4 --device cpu", "--gpu names a GPU; use it with --device cuda"),
        (f"model {BATCH} --strategy zero", "--strategy 'zero' cannot be planned"),
        (f"model {BATCH} --world-size two", "invalid int value"),
        ("model --world-size 2", "the following arguments are required: --batch"),
        (f"model {BATCH} --find-batch", "--find-batch needs the free memory"),
        (f"model {BATCH} --precision 16-mixed", "invalid choice: '16-mixed'"),
    ],
)
def test_bad_input_is_one_line_and_the_picker_stays_usable(line: str, says: str) -> None:
    ns = {**namespace(), "raising_step": raising_step}
    with pytest.raises(SpecError) as caught:
        picker(line, ns, None, print) if "--find-batch" not in line else run(line)
    message = str(caught.value)
    assert message.startswith("%dist_picker: ") and "\n" not in message and says in message
    assert isinstance(picker(f"model {BATCH} --world-size 2 --gpu L4", ns, None, print), DryRunPicker)


def test_without_options_the_formula_form_is_unchanged() -> None:
    p = picker("124M", {}, None, print)
    assert isinstance(p, Picker) and p.model.parameters == 124_000_000


CELL = """
blocks = [Block() for _ in range(2)]
nn.Sequential(*blocks)
"""


def test_a_cells_code_builds_the_model_and_defines_nothing_in_the_notebook() -> None:
    ns = {**namespace(), "Block": Block}
    names = dict(ns)
    p = picker(f"{BATCH} --world-size 2 --gpu L4", ns, None, print, cell=CELL)
    assert isinstance(p, DryRunPicker) and ns == names, "the cell's names stay in its scratch namespace"
    assert p.outcome.args.model == "the cell's model" and "Dry run of the cell's model" in p.report
    by_line = plan_line(f"build {BATCH} --world-size 2 --gpu L4", ns, gpu_count=2)
    assert [v.plan for v in p.outcome.verdicts] == [v.plan for v in by_line.verdicts]
    named = picker(f"{BATCH} --world-size 2 --gpu L4", ns, None, print, cell="model = build()\nx = 1")
    assert named.outcome.verdicts[0].plan == by_line.verdicts[0].plan


@pytest.mark.parametrize(
    ("line", "cell", "says"),
    [
        (f"{BATCH}", "nn.Sequential(Block(),", "%%dist_picker: the model code has a syntax error"),
        (f"{BATCH}", "raise RuntimeError('boom')", "the model code raised RuntimeError: boom"),
        (f"{BATCH}", "x = Block()", "the model code defines no model; end the code with the model"),
        (f"{BATCH}", "  \n", "%%dist_picker: the cell is empty; write the code that builds the model"),
        (f"model {BATCH}", "Block()", "%%dist_picker: the cell builds the model, so the line takes no MODEL"),
        ("--world-size 2", "Block()", "%%dist_picker: the following arguments are required: --batch"),
    ],
)
def test_bad_cell_code_is_one_line_and_the_picker_stays_usable(line: str, cell: str, says: str) -> None:
    ns = {**namespace(), "Block": Block}
    with pytest.raises(SpecError) as caught:
        picker(line, ns, None, print, cell=cell)
    message = str(caught.value)
    assert "\n" not in message and says in message
    assert isinstance(picker(f"{BATCH} --world-size 2 --gpu L4", ns, None, print, cell=CELL), DryRunPicker)


def test_the_reports_text_plain_is_the_whole_table_where_the_widget_cannot_render() -> None:
    p = picker(f"model {BATCH} --world-size 2 --gpu 'h100 80gb'", namespace(), None, lambda _: None)
    assert isinstance(p, DryRunPicker)
    text = p._repr_mimebundle_()["text/plain"]
    assert text == p.report and "…" not in text
    assert all(name in text for name in ORDER) and text.count("\n") > len(ORDER)


def fsdp_refusing_step(model: nn.Module, batch: torch.Tensor) -> None:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        raise ValueError("this step refuses FSDP")
    model(batch).mean().backward()


def test_a_plan_that_fails_is_a_note_and_the_others_are_shown() -> None:
    space = {**namespace(), "step": fsdp_refusing_step}
    out = plan_line(f"model {BATCH} --world-size 2 --step step", space, memory=gpus(0, 0), gpu_count=2)
    assert [v.name for v in out.verdicts] == ["ddp"]
    failed = [n for n in out.notes if "is not planned" in n]
    assert len(failed) == len(ORDER) - 1 and all("this step refuses FSDP" in n for n in failed)
    assert all("\n" not in n for n in failed)
