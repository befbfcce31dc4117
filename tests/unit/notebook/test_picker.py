"""jupyter_shard.notebook.picker: the %dist_picker form follows its fields; its buttons do what they say."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from jupyter_shard.notebook.picker import Picker, picker
from jupyter_shard.planner.choice import ModelInfo
from jupyter_shard.planner.estimate import CAVEAT, plans
from jupyter_shard.planner.free_memory import MemorySnapshot
from jupyter_shard.pool.ranks import RankSnapshot, RankState
from jupyter_shard.spec import LaunchSpec, SpecError

GIB = 2**30
FOUR_GPUS = MemorySnapshot(((70 * GIB, 80 * GIB),) * 4, 200 * GIB, "nvidia-smi")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def make(
    parameters: int | None = 124_000_000,
    memory: MemorySnapshot = FOUR_GPUS,
    gpu_count: int = 4,
    deepspeed: bool = True,
    defaults: list[str] | None = None,
    **model: Any,
) -> Picker:
    sink = defaults if defaults is not None else []
    info = ModelInfo(parameters, **model)
    return Picker(info, sink.append, memory=memory, gpu_count=gpu_count, deepspeed=deepspeed)


def test_it_opens_on_the_recommendation() -> None:
    p = make()
    assert p.line == "%%distributed --strategy ddp --gpus 4 --precision bf16-mixed"
    assert p.recommendation == (
        f"DDP: 124M parameters need 1.8 GiB per rank and fit in 70.0 GiB free; fastest. {CAVEAT}"
    )
    assert [e.plan for e in p.estimates] == plans()
    assert p.current is not None and p.current.device_bytes == 16 * 124_000_000
    assert p.text.value == p.line
    assert "Free: 70.0 GiB per GPU, from nvidia-smi" in p.outputs["advice"].value


def test_a_bigger_model_moves_the_form_to_the_new_recommendation() -> None:
    p = make()
    p.fields["count"].value = "8B"  # of 56 GiB usable: DDP needs 119.2 GiB, ZeRO-1 59.6 GiB, ZeRO-2 48.4 GiB
    assert p.line == "%%distributed --strategy deepspeed --zero-stage 2 --gpus 4 --precision bf16-mixed"
    assert p.recommendation.startswith(
        "ZeRO-2: 8B parameters need 48.4 GiB per rank and fit in 70.0 GiB free"
    )
    p.fields["count"].value = "13B"  # ZeRO-2 needs 78.7 GiB, FSDP FULL_SHARD 48.4 GiB
    assert p.line == "%%distributed --strategy fsdp --gpus 4 --precision bf16-mixed"
    p.fields["count"].value = "70B"
    assert p.line.startswith("%%distributed --strategy deepspeed --zero-stage 3 --gpus 4")
    assert p.line.endswith("--offload nvme")
    assert p.config == {"nvme_path": "/local_nvme"}
    assert any("press “Write ds_config.json”" in n for n in p.notes)


def test_without_deepspeed_only_ddp_and_fsdp_are_recommended() -> None:
    p = make(parameters=10_000_000_000, deepspeed=False)
    assert p.line == "%%distributed --strategy fsdp --gpus 4 --precision bf16-mixed"
    assert p.config == {"sharding": "SHARD_GRAD_OP"}
    assert p.advice is not None and p.advice.choice is not None
    assert p.advice.choice.plan.label == "FSDP SHARD_GRAD_OP"
    assert "deepspeed is not installed" in p.recommendation


def test_fields_update_the_line_and_the_table() -> None:
    p = make()
    table = p.outputs["table"].value
    p.fields["strategy"].value = "deepspeed"
    p.fields["zero_stage"].value = 3
    assert p.line == "%%distributed --strategy deepspeed --zero-stage 3 --gpus 4 --precision bf16-mixed"
    assert "<td>▶</td><td>ZeRO-3</td>" in p.outputs["table"].value
    assert "<td>★</td><td>DDP</td>" in p.outputs["table"].value
    p.fields["nproc"].value = 2
    p.fields["precision"].value = "32"
    assert p.line == "%%distributed --strategy deepspeed --zero-stage 3 --gpus 2"  # chosen by hand: kept
    assert p.current is not None and p.current.device_bytes == 16 * 124_000_000 // 2
    assert p.outputs["table"].value != table
    p.fields["device"].value = "cpu"
    assert p.line == "%%distributed --strategy deepspeed --zero-stage 3 --nproc 2 --device cpu"
    p.fields["offload"].value = "cpu"
    assert p.line.endswith("--offload cpu")


def test_zero_stage_and_sharding_are_only_for_their_strategy() -> None:
    p = make()
    assert p.fields["zero_stage"].disabled and p.fields["sharding"].disabled
    p.fields["zero_stage"].value = 2
    assert "ZeRO stage 2 applies only to --strategy deepspeed; ignored for ddp." in p.notes
    assert "--zero-stage" not in p.line
    assert "ZeRO stage 2 applies only" in p.outputs["notes"].value
    p.fields["strategy"].value = "fsdp"
    assert p.fields["zero_stage"].disabled and not p.fields["sharding"].disabled


def test_gpus_without_gpus_become_cpu_ranks() -> None:
    p = make(memory=MemorySnapshot((), 24 * GIB), gpu_count=0)
    assert p.line == "%%distributed --strategy ddp --nproc 2 --device cpu"
    p.fields["device"].value = "cuda"
    assert p.line == "%%distributed --strategy ddp --nproc 2 --device cpu"
    assert "No CUDA device is visible here" in p.notes[0]
    assert "host RAM per rank" in p.outputs["advice"].value


def test_use_recommended_resets_a_hand_made_choice() -> None:
    p = make()
    p.fields["strategy"].value = "fsdp"
    p.fields["count"].value = "125M"  # chosen by hand: the form stays on fsdp
    assert "--strategy fsdp" in p.line
    p.buttons["recommended"].click()
    assert p.line == "%%distributed --strategy ddp --gpus 4 --precision bf16-mixed"
    p.fields["count"].value = "8B"  # following again
    assert "--zero-stage 2" in p.line


def test_nvme_path_must_be_a_directory(tmp_path: Path) -> None:
    p = make()
    p.fields["strategy"].value = "deepspeed"
    p.fields["zero_stage"].value = 3
    p.fields["offload"].value = "nvme"
    assert any(n.startswith("NVMe path /local_nvme is not a directory here") for n in p.notes)
    p.fields["nvme_path"].value = str(tmp_path)
    assert not any("is not a directory" in n for n in p.notes)
    assert p.config == {"nvme_path": str(tmp_path)}


def test_a_failing_default_is_shown_in_the_form() -> None:
    def refuse(line: str) -> None:
        raise ValueError("--gpus 4 asked for, but 0 CUDA device(s) are visible")

    p = Picker(ModelInfo(1000), refuse, memory=FOUR_GPUS, gpu_count=4, deepspeed=True)
    p.use_as_default()
    assert "Could not set the default: --gpus 4 asked for" in p.outputs["done"].value


def test_use_as_default_calls_back_with_the_line() -> None:
    calls: list[str] = []
    p = make(defaults=calls)
    p.buttons["default"].click()
    assert calls == [p.line]
    assert "Default set" in p.outputs["done"].value


def test_insert_sends_the_line_to_the_frontend(monkeypatch: pytest.MonkeyPatch) -> None:
    p = make()
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(p, "send", lambda content, buffers=None: sent.append(content))
    p.buttons["insert"].click()
    assert sent == [{"event": "insert-cell", "code": p.line}]


def test_the_textarea_is_read_only() -> None:
    p = make()
    p.text.value = "%%distributed --strategy nonsense"
    assert p.text.value == p.line


def test_the_copy_button_carries_the_line() -> None:
    p = make()
    assert f"navigator.clipboard.writeText({json.dumps(p.line)})" in html.unescape(p.outputs["copy"].value)


def test_write_config_then_the_line_carries_it(tmp_path: Path) -> None:
    p = make(classes=frozenset({"Block", "Net"}), blocks=("Block",))
    p.fields["strategy"].value = "fsdp"
    p.fields["sharding"].value = "SHARD_GRAD_OP"
    p.fields["checkpoint"].value = "Block"
    assert p.buttons["write"].description == "Write fsdp_options.json"
    assert "--config" not in p.line
    assert '"sharding": "SHARD_GRAD_OP"' in html.unescape(p.outputs["config"].value)
    p.buttons["write"].click()
    written = json.loads((tmp_path / "fsdp_options.json").read_text())
    assert written == p.config == {"sharding": "SHARD_GRAD_OP", "activation_checkpointing": ["Block"]}
    assert p.line.endswith("--config fsdp_options.json")
    assert LaunchSpec.create(strategy="fsdp", gpus=4, config="fsdp_options.json", gpu_count=4).config
    p.fields["nproc"].value = 2  # the config is unchanged: still carried
    assert p.line.endswith("--config fsdp_options.json")
    p.fields["sharding"].value = "NO_SHARD"  # changed: the file is stale until written again
    assert "--config" not in p.line
    p.fields["config_name"].value = "mine.json"
    p.buttons["write"].click()
    assert p.line.endswith("--config mine.json")
    assert json.loads((tmp_path / "mine.json").read_text())["sharding"] == "NO_SHARD"


def test_a_bad_config_name_falls_back() -> None:
    p = make()
    p.fields["strategy"].value = "fsdp"
    p.fields["sharding"].value = "NO_SHARD"
    p.fields["config_name"].value = "../evil"
    assert p.config_file == "fsdp_options.json"
    assert any("is not a plain file name" in n for n in p.notes)


def test_no_count_yet_then_typed() -> None:
    p = make(parameters=None)
    assert p.estimates == [] and p.current is None
    assert p.recommendation.startswith("Type the parameter count")
    p.fields["count"].value = "1.3b"
    assert len(p.estimates) == len(plans())
    p.fields["count"].value = "lots"
    assert p.estimates == []
    assert "Parameter count 'lots' is not valid; write it like 124M, 1.3B, 7e9 or 350000000." in p.notes


class FakePool:
    spec = LaunchSpec(nproc=2)

    def status(self) -> list[RankSnapshot]:
        memory = {"rss": 1, "cuda_free": 10 * GIB, "cuda_total": 80 * GIB}
        return [
            RankSnapshot(rank=k, pid=k, host="h", device=f"cuda:{k}", state=RankState.IDLE, memory=memory)
            for k in range(2)
        ]


def test_picker_reads_the_model_and_the_pool() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(10, 10)

    p = picker("net", {"net": Net()}, FakePool(), lambda line: None)  # type: ignore[arg-type]
    assert p.model.parameters == 110
    assert p.memory.gpu_source == "the running pool"
    assert p.fields["nproc"].value == 2 and p.fields["device"].value == "cpu"


def test_picker_bad_argument_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"^%dist_picker: no variable 'model' in the notebook; pass a model"):
        picker("model", {}, None, lambda line: None)


# -- bf16 only where the GPUs have it; sharded initialisation where it is what makes a plan fit ----------

V100S = MemorySnapshot(((30 * GIB, 32 * GIB),) * 4, 200 * GIB, "nvidia-smi", ((7, 0),) * 4)


def test_gpus_older_than_ampere_get_16_mixed() -> None:
    p = make(memory=V100S)
    assert p.fields["precision"].value == "16-mixed"
    assert p.line == "%%distributed --strategy ddp --gpus 4 --precision 16-mixed"
    assert p.notes == []
    p.fields["precision"].value = "bf16-mixed"  # chosen by hand: refused, with the reason
    assert p.line.endswith("--precision 16-mixed")
    assert p.notes == [
        "bf16 needs compute capability 8.0 (Ampere) or newer, and 4 of the 4 GPU(s) chosen have 7.0: "
        "using --precision 16-mixed (fp16 with loss scaling) instead."
    ]


def test_ampere_gpus_keep_bf16() -> None:
    p = make(memory=MemorySnapshot(FOUR_GPUS.gpus, 200 * GIB, "nvidia-smi", ((8, 0),) * 4))
    assert p.line == "%%distributed --strategy ddp --gpus 4 --precision bf16-mixed"


def test_a_plan_that_fits_only_built_sharded_says_so_in_the_table_and_the_advice() -> None:
    p = make(parameters=13_000_000_000)  # 48.4 GiB in fp32: 4 ranks building it need 194 GiB of 200
    assert p.line == "%%distributed --strategy fsdp --gpus 4 --precision bf16-mixed"
    assert "fits only when built under" not in p.recommendation
    p.memory = MemorySnapshot(FOUR_GPUS.gpus, 150 * GIB, "nvidia-smi")
    p.fields["count"].value = "13.0B"
    note = (
        "fits only when built under `with shard.init_module():` — every rank building the whole model "
        "first needs 4 × 48.4 GiB of host RAM, 150.0 GiB free"
    )
    assert p.recommendation.startswith("FSDP FULL_SHARD: 13B parameters need")
    assert f"the fastest that fits (DDP needs 193.7 GiB per rank). It {note}. {CAVEAT}" in p.recommendation
    assert p.line == "%%distributed --strategy fsdp --gpus 4 --precision bf16-mixed"  # the line as before
    table = p.outputs["table"].value
    assert "<td>★▶</td><td>FSDP FULL_SHARD</td>" in table
    assert "<td>yes †</td>" in table and "<td>no</td>" in table
    assert f"<div>† {html.escape('F' + note[1:])}.</div>" in table
    assert f"— {html.escape(note)}." in p.outputs["advice"].value
    p.fields["strategy"].value = "ddp"  # a plan that holds the whole model anyway: no such note
    assert "Your choice</b>, DDP" in p.outputs["advice"].value
    assert "does not fit" in p.outputs["advice"].value


def test_cpu_ranks_that_cannot_all_build_the_model() -> None:
    p = make(parameters=1_400_000_000, memory=MemorySnapshot((), 64 * GIB), gpu_count=0)
    p.fields["nproc"].value = 16
    p.fields["strategy"].value = "fsdp"
    advice = p.outputs["advice"].value
    assert (
        "FSDP FULL_SHARD: 1.3 GiB per rank — fits only when built under `with shard.init_module():`" in advice
    )
    assert "every rank building the whole model first needs 16 × 5.2 GiB of host RAM, 64.0 GiB free" in advice


class ListPool:
    spec = LaunchSpec.create(gpus="0,2", gpu_count=4)

    def status(self) -> list[RankSnapshot]:
        return []


def test_a_pool_on_chosen_gpus_keeps_them_in_the_line() -> None:
    p = Picker(ModelInfo(124_000_000), [].append, pool=ListPool(), memory=FOUR_GPUS, gpu_count=4)  # type: ignore[arg-type]
    assert p.line == "%%distributed --strategy ddp --gpus 0,2 --precision bf16-mixed"


def test_the_chart_stacks_each_strategys_bytes_against_the_free_memory() -> None:
    p = make()
    assert p.chart is not None
    bars = {t["name"]: t for t in p.chart["data"]}
    assert list(bars) == ["parameters", "gradients", "optimizer state"]
    assert p.chart["layout"]["barmode"] == "stack"
    labels = bars["parameters"]["y"]
    assert len(labels) == len(p.estimates) and labels[0] == "★ ▶ DDP"
    for i, e in enumerate(p.estimates):  # the stack is the table's device bytes, in GiB
        stacked = sum(bars[name]["x"][i] for name in bars) * 2**30
        assert stacked == pytest.approx(e.device_bytes)
    free, usable = p.chart["layout"]["shapes"]
    assert free["x0"] == pytest.approx(70.0) and free["name"] == "free per GPU: 70.0 GiB"
    assert usable["x0"] == pytest.approx(56.0) and usable["line"]["dash"] == "dash"
    p.fields["strategy"].value = "fsdp"
    assert "▶ FSDP FULL_SHARD" in p.chart["data"][0]["y"] and "★ DDP" in p.chart["data"][0]["y"]


def test_the_chart_counts_offloaded_state_on_cpu_ranks() -> None:
    cpu = MemorySnapshot((), 64 * GIB, "psutil")
    p = make(parameters=1_000_000, memory=cpu, gpu_count=0)
    p.fields["device"].value = "cpu"
    bars = {t["name"]: t for t in p.chart["data"]} if p.chart else {}
    total = sum(bars[name]["x"][0] for name in bars) * 2**30
    first = p.estimates[0]
    assert total == pytest.approx(first.device_bytes + first.host_bytes)
    assert p.chart is not None and p.chart["layout"]["shapes"][0]["name"].startswith("host RAM per rank: ")


# -- the dry run from the form ----------------------------------------------------------------------


def small() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def test_the_form_dry_runs_its_model_on_the_batch_at_its_ranks_and_device() -> None:
    defaults: list[str] = []
    p = picker("model", {"model": small()}, None, defaults.append)
    assert isinstance(p, Picker) and p.dry_run is None and not p.dry_run_view.children
    p.fields["nproc"].value = 2
    p.fields["device"].value = "cpu"
    p.fields["precision"].value = "32"
    p.dry_fields["batch"].value = "torch.randn(4, 16)"
    p.buttons["dry_run"].click()
    assert p.dry_run_line() == "model --batch 'torch.randn(4, 16)' --world-size 2 --device cpu --precision 32"
    view = p.dry_run
    assert view is not None and p.dry_run_view.children == (view,)
    args = view.outcome.args
    assert (args.world_size, args.device.value, args.batch) == (2, "cpu", "torch.randn(4, 16)")
    assert "fsdp FULL_SHARD + offload" in view.report and "CPU ranks" in view.report
    assert "Ran <code>%dist_picker model --batch" in p.outputs["dry_run"].value
    # a named GPU and bf16: judged against it, and the line carries the precision
    p.dry_fields["gpu"].value = "H100 80GB"
    p.fields["precision"].value = "bf16-mixed"
    view = p.run_dry_run()
    assert view is not None and view.outcome.free_source.startswith("a H100 80GB")
    assert view.outcome.args.device.value == "cuda" and view.outcome.args.precision == "bf16-mixed"
    assert view.line == "%%distributed --strategy ddp --gpus 2 --precision bf16-mixed"
    view.use_as_default()
    assert defaults == [view.line]


@pytest.mark.parametrize(
    ("arg", "batch", "says"),
    [
        ("124M", "torch.randn(4, 16)", "the dry run needs the model itself"),
        ("model", "", "type a batch"),
        ("model", "torch.randn(4, 7)", "pass a batch the model's forward takes"),
    ],
)
def test_a_dry_run_the_form_cannot_run_is_one_line_in_the_form(arg: str, batch: str, says: str) -> None:
    p = picker(arg, {"model": small()}, None, print)
    assert isinstance(p, Picker)
    p.fields["nproc"].value = 2
    p.dry_fields["batch"].value = batch
    p.buttons["dry_run"].click()
    assert p.dry_run is None and not p.dry_run_view.children
    assert says in html.unescape(p.outputs["dry_run"].value)
    assert p.line.startswith("%%distributed")  # the form itself is untouched
