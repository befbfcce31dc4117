"""jupyter_shard.planner.choice: %dist_picker's argument, checked choices, the line and the config."""

from __future__ import annotations

import json
import shlex
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jupyter_shard._util.atomic import write_atomic
from jupyter_shard.notebook.args import distributed_parser as _distributed_parser
from jupyter_shard.planner.choice import (
    ModelInfo,
    check_fields,
    copy_button,
    distributed_line,
    model_info,
    strategy_config,
)
from jupyter_shard.planner.estimate import Plan
from jupyter_shard.spec import Device, LaunchSpec, Offload, Precision, SpecError

CPU, NVME = Offload.CPU, Offload.NVME


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2, bias=False)
        self.head.weight = nn.Parameter(torch.zeros(2, 8))


NET_PARAMETERS = 2 * (8 * 8 + 8 + 8 + 8) + 16


# -- %dist_picker ARG ----------------------------------------------------------------------------------


def test_a_model_in_the_kernel_is_counted() -> None:
    info = model_info(" net ", {"net": Net()})
    assert info.parameters == NET_PARAMETERS == sum(p.numel() for p in Net().parameters())
    assert info.blocks == ("Block",)
    assert {"Net", "Block", "Linear", "LayerNorm", "ModuleList"} <= info.classes


def test_a_dotted_name_reaches_into_objects() -> None:
    class Trainer:
        model = Net()

    assert model_info("trainer.model", {"trainer": Trainer()}).parameters == NET_PARAMETERS


@pytest.mark.parametrize(
    ("arg", "namespace", "count"),
    [
        ("", {}, None),
        ("1.3B", {}, 1_300_000_000),
        ("7e9", {}, 7_000_000_000),
        ("350000000", {}, 350_000_000),
        ("n", {"n": 124_000_000}, 124_000_000),
        ("n", {"n": 1.3e9}, 1_300_000_000),
        ("n", {"n": "124M"}, 124_000_000),
    ],
)
def test_counts_and_names_of_counts(arg: str, namespace: dict[str, Any], count: int | None) -> None:
    assert model_info(arg, namespace) == ModelInfo(count)


@pytest.mark.parametrize(
    ("arg", "namespace", "message"),
    [
        ("modle", {"model": Net()}, "%dist_picker: no variable 'modle' in the notebook; pass a model"),
        ("xs", {"xs": [1, 2]}, "%dist_picker: xs is a list, not a torch module; pass a model"),
        ("flag", {"flag": True}, "flag is a bool, not a torch module"),
        ("empty", {"empty": nn.ReLU()}, "%dist_picker: empty has no parameters"),
        ("t.model.x", {"t": Net()}, "%dist_picker: t has no attribute 'model'"),
        ("1.3X", {}, "%dist_picker: parameter count '1.3X' is not valid; write it like 124M"),
        ("n", {"n": -5}, "parameter count '-5' is not valid"),
    ],
)
def test_bad_arguments_are_one_clear_line(arg: str, namespace: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as caught:
        model_info(arg, namespace)
    assert str(caught.value).startswith(message) or message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert "`%dist_picker 1.3B`" in str(caught.value) or "124M, 1.3B, 7e9" in str(caught.value)


# -- the line ------------------------------------------------------------------------------------------


def test_the_brief_example_line() -> None:
    line = distributed_line(Plan("deepspeed", 2, offload=CPU), Device.CUDA, 4, Precision.BF16_MIXED)
    assert (
        line
        == "%%distributed --strategy deepspeed --zero-stage 2 --gpus 4 --precision bf16-mixed --offload cpu"
    )
    cpu = distributed_line(Plan("fsdp"), Device.CPU, 2, Precision.FP32, "fsdp_options.json")
    assert cpu == "%%distributed --strategy fsdp --nproc 2 --device cpu --config fsdp_options.json"


PLANS = [
    Plan("ddp"),
    *(Plan("deepspeed", s) for s in range(4)),
    *(Plan("deepspeed", s, offload=CPU) for s in (1, 2, 3)),
    Plan("deepspeed", 3, offload=NVME),
    *(Plan("fsdp", sharding=s) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")),
    Plan("fsdp", offload=CPU),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label)
@pytest.mark.parametrize("device", [Device.CPU, Device.CUDA])
@pytest.mark.parametrize("precision", list(Precision))
def test_every_line_is_accepted_by_distributed(
    plan: Plan, device: Device, precision: Precision, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("options.json").write_text("{}")
    line = distributed_line(plan, device, 4, precision, "options.json")
    magic, *words = shlex.split(line)
    assert magic == "%%distributed"
    opts, extra = _distributed_parser().parse_known_args(words)
    assert extra == []
    given = {k: v for k, v in vars(opts).items() if v is not None}
    spec = LaunchSpec.create(**given, gpu_count=8)
    assert (spec.strategy, spec.device, spec.nproc, spec.precision) == (plan.strategy, device, 4, precision)
    assert spec.offload is plan.offload
    assert spec.zero_stage == (plan.zero_stage if plan.strategy == "deepspeed" else None)


# -- the config JSON -----------------------------------------------------------------------------------


def test_strategy_configs() -> None:
    assert strategy_config(Plan("ddp"), (), "/nvme") is None
    assert strategy_config(Plan("fsdp"), (), "/nvme") is None
    assert strategy_config(Plan("fsdp", sharding="SHARD_GRAD_OP"), ("Block",), "/nvme") == {
        "sharding": "SHARD_GRAD_OP",
        "activation_checkpointing": ["Block"],
    }
    assert strategy_config(Plan("deepspeed", 2, offload=CPU), (), "/nvme") is None
    assert strategy_config(Plan("deepspeed", 3, offload=NVME), ("Block",), "/nvme") == {
        "nvme_path": "/nvme",
        "checkpoint_modules": ["Block"],
    }


def test_the_fsdp_config_is_what_the_fsdp_strategy_reads() -> None:
    from jupyter_shard.strategies.fsdp import FSDPStrategy

    config = strategy_config(Plan("fsdp", sharding="HYBRID_SHARD"), ("Block",), "")
    strategy = FSDPStrategy(**json.loads(json.dumps(config)))
    assert strategy.sharding == "HYBRID_SHARD"
    assert strategy.checkpoint_classes == frozenset({"Block"})


def test_the_deepspeed_config_is_what_the_deepspeed_strategy_reads(tmp_path: Path) -> None:
    from jupyter_shard.strategies.base import StrategyContext
    from jupyter_shard.strategies.deepspeed_config import build_config

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(strategy_config(Plan("deepspeed", 3, offload=NVME), ("Block",), "/swap")))
    ctx = StrategyContext(0, 0, 2, torch.device("cpu"), precision="bf16-mixed")
    config = build_config(ctx, zero_stage=3, offload="nvme", config_path=path, options={})
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/swap", "pin_memory": False}
    assert zero["offload_param"]["nvme_path"] == "/swap"
    assert config["checkpoint_modules"] == ["Block"]  # popped and applied by the deepspeed strategy


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "ds_config.json"
    target.write_text("old")
    write_atomic(target, '{"a": 1}\n')
    assert target.read_text() == '{"a": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["ds_config.json"]
    with pytest.raises(OSError):
        write_atomic(tmp_path / "missing" / "x.json", "{}")


# -- the copy button -----------------------------------------------------------------------------------


class _Buttons(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text += data


@pytest.mark.parametrize(
    "text",
    [
        "%%distributed --strategy ddp --gpus 4",
        "a\"b'c</button><script>alert(1)</script>&amp;\\n \u2028 ünï",
    ],
)
def test_copy_button_escapes_the_text(text: str) -> None:
    parser = _Buttons()
    parser.feed(copy_button(text, label="<Copy>"))
    assert [tag for tag, _ in parser.tags] == ["button"]
    assert parser.text == "<Copy>"
    onclick = parser.tags[0][1]["onclick"]
    assert onclick is not None
    prefix, suffix = "navigator.clipboard.writeText(", ")"
    assert onclick.startswith(prefix) and onclick.endswith(suffix)
    assert json.loads(onclick[len(prefix) : -len(suffix)]) == text


# -- checking the fields -------------------------------------------------------------------------------

FIELDS = {
    "device": "auto",
    "nproc": 4,
    "strategy": "ddp",
    "zero_stage": 0,
    "sharding": "FULL_SHARD",
    "offload": "none",
    "precision": "bf16-mixed",
    "checkpoint": "",
}


@pytest.mark.parametrize(
    ("changes", "gpus", "plan", "note"),
    [
        ({}, 4, Plan("ddp"), ""),
        ({"zero_stage": 2}, 4, Plan("ddp"), "ZeRO stage 2 applies only to --strategy deepspeed"),
        (
            {"offload": "cpu"},
            4,
            Plan("ddp"),
            "ddp keeps everything on the device: offload needs fsdp or deepspeed ZeRO 1-3; "
            "using --offload none",
        ),
        ({"strategy": "fsdp", "offload": "nvme"}, 4, Plan("fsdp", offload=CPU), "fsdp offloads to cpu only"),
        ({"strategy": "deepspeed", "offload": "cpu"}, 4, Plan("deepspeed"), "needs ZeRO stage 1, 2 or 3"),
        (
            {"strategy": "deepspeed", "zero_stage": 2, "offload": "nvme"},
            4,
            Plan("deepspeed", 2, offload=CPU),
            "NVMe offload (ZeRO-Infinity) needs ZeRO stage 3; using --offload cpu",
        ),
        (
            {"strategy": "fsdp", "sharding": "HYBRID_SHARD"},
            4,
            Plan("fsdp", sharding="HYBRID_SHARD"),
            "On one node",
        ),
        ({"sharding": "NO_SHARD"}, 4, Plan("ddp"), ""),
    ],
)
def test_invalid_combinations_are_explained(
    changes: dict[str, Any], gpus: int, plan: Plan, note: str
) -> None:
    choice = check_fields({**FIELDS, **changes}, gpus, ModelInfo())
    assert choice.plan == plan
    assert (note in " ".join(choice.notes)) if note else choice.notes == []


def test_gpus_on_a_machine_without_gpus_become_cpu_ranks() -> None:
    choice = check_fields({**FIELDS, "device": "cuda"}, 0, ModelInfo())
    assert (choice.device, choice.nproc) == (Device.CPU, 4)
    assert "No CUDA device is visible here" in choice.notes[0]
    assert check_fields(FIELDS, 0, ModelInfo()).device is Device.CPU  # auto, quietly
    fewer = check_fields({**FIELDS, "nproc": 8}, 2, ModelInfo())
    assert (fewer.device, fewer.nproc) == (Device.CUDA, 2)
    assert fewer.notes == ["Only 2 GPU(s) are visible: the line asks for --gpus 2."]


def test_checkpointing_names_are_checked_against_the_model() -> None:
    model = model_info("net", {"net": Net()})
    fsdp = {**FIELDS, "strategy": "fsdp"}
    choice = check_fields({**fsdp, "checkpoint": "Block, Blok Block"}, 4, model)
    assert choice.checkpoint == ("Block",)
    assert choice.notes == [
        "No module class Blok in the model (repeated blocks: Block); left out of checkpointing."
    ]
    ddp = check_fields({**FIELDS, "checkpoint": "Block"}, 4, model)
    assert ddp.checkpoint == ()
    assert "ddp has no activation checkpointing option" in ddp.notes[0]


# -- bf16 needs Ampere ---------------------------------------------------------------------------------

V100, T4, A100, H100 = (7, 0), (7, 5), (8, 0), (9, 0)


@pytest.mark.parametrize(
    ("caps", "precision", "note"),
    [
        ((A100,) * 4, Precision.BF16_MIXED, ""),
        ((H100, A100, H100, A100), Precision.BF16_MIXED, ""),
        ((), Precision.BF16_MIXED, ""),  # unknown (an old driver without compute_cap): left as chosen
        ((None, None, None, None), Precision.BF16_MIXED, ""),
        (
            (V100,) * 4,
            Precision.FP16_MIXED,
            "bf16 needs compute capability 8.0 (Ampere) or newer, and 4 of the 4 GPU(s) chosen have 7.0: "
            "using --precision 16-mixed (fp16 with loss scaling) instead.",
        ),
        (
            (A100, T4, A100, V100),
            Precision.FP16_MIXED,
            "bf16 needs compute capability 8.0 (Ampere) or newer, and 2 of the 4 GPU(s) chosen have "
            "7.0 and 7.5: using --precision 16-mixed (fp16 with loss scaling) instead.",
        ),
    ],
)
def test_bf16_is_chosen_only_on_gpus_that_have_it(
    caps: tuple[tuple[int, int] | None, ...], precision: Precision, note: str
) -> None:
    choice = check_fields({**FIELDS, "device": "cuda"}, 4, ModelInfo(), caps)
    assert choice.precision is precision
    assert choice.notes == ([note] if note else [])


def test_only_the_chosen_gpus_count_for_bf16() -> None:
    two = check_fields({**FIELDS, "device": "cuda", "nproc": 2}, 4, ModelInfo(), (A100, A100, T4, T4))
    assert (two.precision, two.notes) == (Precision.BF16_MIXED, [])


@pytest.mark.parametrize("precision", ["16-mixed", "32"])
def test_other_precisions_and_cpu_ranks_are_left_alone(precision: str) -> None:
    gpu = check_fields({**FIELDS, "device": "cuda", "precision": precision}, 4, ModelInfo(), (V100,) * 4)
    assert (gpu.precision.value, gpu.notes) == (precision, [])
    cpu = check_fields({**FIELDS, "device": "cpu"}, 4, ModelInfo(), (V100,) * 4)
    assert (cpu.precision, cpu.notes) == (Precision.BF16_MIXED, [])  # bf16 autocast runs on CPU


def test_a_running_pools_devices_stay_in_the_line() -> None:
    line = distributed_line(Plan("ddp"), Device.CUDA, 2, Precision.FP16_MIXED, devices=(0, 2))
    assert line == "%%distributed --strategy ddp --gpus 0,2 --precision 16-mixed"
    assert distributed_line(Plan("ddp"), Device.CUDA, 1, Precision.FP32, devices=(3,)).endswith("--gpus 3,")
    assert distributed_line(Plan("ddp"), Device.CUDA, 3, Precision.FP32, devices=(0, 2)).endswith("--gpus 3")
    assert distributed_line(Plan("ddp"), Device.CUDA, 2, Precision.FP32, devices=(0, 1)).endswith("--gpus 2")
    opts, extra = _distributed_parser().parse_known_args(shlex.split(line)[1:])
    assert extra == []
    given = {k: v for k, v in vars(opts).items() if v is not None}
    assert LaunchSpec.create(**given, gpu_count=4).devices == (0, 2)
