"""jupyter_shard.strategies.deepspeed: what the strategy asks of DeepSpeed and does around it.

DeepSpeed itself is a stand-in (``import_deepspeed`` is replaced): its engine wraps the model and
records calls, so ``prepare``'s casts, checks and arguments, the engine-driven backward and step, the
checkpoint directory's renames and the memory accounting are checked without building an engine or
compiling an op. (The config merge is tested in ``tests/unit/strategies/test_deepspeed_config.py``.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from jupyter_shard.strategies import deepspeed as deepspeed_module
from jupyter_shard.strategies.base import StrategyContext
from jupyter_shard.strategies.deepspeed import DeepSpeedStrategy, deepspeed_environment

pytestmark = pytest.mark.timeout(60)


class Engine(nn.Module):
    """DeepSpeed's engine as the strategy uses it."""

    def __init__(self, module: nn.Module, optimizer: Any) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.calls: list[Any] = []
        self.boundary = False
        self.saved: Any = None

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.append("backward")

    def step(self) -> None:
        self.calls.append("step")

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.boundary

    def save_checkpoint(self, path: str, tag: str, client_state: dict[str, Any], save_latest: bool) -> None:
        assert save_latest is False
        (Path(path) / tag).mkdir(parents=True)
        (Path(path) / tag / "state.json").write_text(json.dumps(client_state))

    def load_checkpoint(self, path: str, **flags: Any) -> tuple[str | None, dict[str, Any] | None]:
        self.calls.append(("load", flags))
        return self.saved


class FakeDeepSpeed:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.zero = SimpleNamespace(Init=lambda **kw: self.calls.append(("zero.Init", kw)))
        self.checkpointing = SimpleNamespace(
            configure=lambda *a, **kw: self.calls.append(("checkpointing", kw))
        )

    def init_distributed(self, dist_backend: str, auto_mpi_discovery: bool) -> None:
        self.calls.append(("init_distributed", dist_backend))

    def initialize(self, **kwargs: Any) -> tuple[Engine, Any, None, None]:
        self.calls.append(("initialize", kwargs))
        optimizer = kwargs["optimizer"] or "the engine's optimizer"
        return Engine(kwargs["model"], optimizer), optimizer, None, None

    def call(self, name: str) -> Any:
        (found,) = [args for n, args in self.calls if n == name]
        return found


@pytest.fixture
def ds(monkeypatch: pytest.MonkeyPatch) -> FakeDeepSpeed:
    fake = FakeDeepSpeed()
    monkeypatch.setattr(deepspeed_module, "import_deepspeed", lambda device: fake)
    return fake


def _ready(precision: str = "32", accumulate: int = 1, **extra: Any) -> DeepSpeedStrategy:
    options = extra.pop("options", {})
    s = DeepSpeedStrategy(**options)
    s.setup(
        StrategyContext(0, 0, 1, torch.device("cpu"), precision=precision, accumulate=accumulate, extra=extra)
    )
    return s


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.block = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        out: torch.Tensor = self.emb(ids) + self.block(x)
        return out


# prepare


def test_bf16_holds_the_parameters_in_bf16_and_casts_the_forwards_inputs(ds: FakeDeepSpeed) -> None:
    model = Net()
    weight = model.block.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine, optimizer = _ready("bf16-mixed").prepare(model, opt)
    assert ds.call("init_distributed") == "gloo"
    args = ds.call("initialize")
    assert args["config"]["bf16"]["enabled"] is True and args["dist_init_required"] is False
    assert weight.dtype == torch.bfloat16 and model.block.weight is weight, "cast in place, before the engine"
    assert type(optimizer) is torch.optim.SGD and optimizer is args["optimizer"]
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())
    assert optimizer.defaults["momentum"] == 0.9
    out = engine(torch.tensor([1, 2]), torch.ones(2, 4))
    assert model.seen == [torch.bfloat16] and out.dtype == torch.bfloat16


def test_32_leaves_dtypes_alone(ds: FakeDeepSpeed) -> None:
    model = Net()
    engine, _ = _ready().prepare(model, None)
    engine(torch.tensor([1]), torch.ones(1, 4))
    assert model.block.weight.dtype == torch.float32 and model.seen == [torch.float32]
    assert ds.call("initialize")["model_parameters"] == list(model.parameters())


def test_an_optimizer_in_the_config_wins_with_a_warning(ds: FakeDeepSpeed, tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}))
    model = Net()
    with pytest.warns(UserWarning, match="the optimizer passed to shard.prepare is ignored"):
        _, optimizer = _ready(config=str(config)).prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    args = ds.call("initialize")
    assert args["optimizer"] is None and optimizer == "the engine's optimizer"
    assert args["model_parameters"] == list(model.parameters())


def test_activation_checkpointing_wraps_the_named_classes_or_says_none_is_there(ds: FakeDeepSpeed) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = Net()
    _ready(options={"activation_checkpointing": ["Linear"]}).prepare(model, None)
    assert isinstance(model.block, CheckpointWrapper) and not isinstance(model.emb, CheckpointWrapper)
    with pytest.raises(
        ValueError, match=r"^activation checkpointing: no module of class Conv2d, GRU in the model$"
    ):
        _ready(options={"activation_checkpointing": ["GRU", "Conv2d"]}).prepare(Net(), None)


def test_a_model_partitioned_in_another_dtype_is_refused_with_what_to_do(ds: FakeDeepSpeed) -> None:
    model = Net()
    for p in model.parameters():
        p.ds_id = 0  # type: ignore[attr-defined]  # as zero.Init marks them
    with pytest.raises(ValueError) as info:
        _ready("bf16-mixed", zero_stage=3).prepare(model, None)
    assert str(info.value).startswith(
        "deepspeed: the model was partitioned with torch.float32 parameters, but the engine runs in "
        "torch.bfloat16: build it under shard.init_module()"
    )
    assert not [n for n, _ in ds.calls if n == "initialize"]


def test_stage_3_partitions_a_plain_model_parameter_by_parameter(ds: FakeDeepSpeed) -> None:
    model = Net()
    _ready(zero_stage=3).prepare(model, None)
    init = ds.call("zero.Init")
    assert init["module"] is model and init["config_dict_or_path"]["zero_optimization"]["stage"] == 3
    ds.calls.clear()
    _ready(zero_stage=2).prepare(Net(), None)
    assert not [n for n, _ in ds.calls if n == "zero.Init"]


# training


def test_backward_counts_micro_steps_for_the_engine_between_boundaries() -> None:
    s = _ready(accumulate=4)
    engine = Engine(nn.Linear(1, 1), None)
    s.backward(torch.tensor(1.0), engine)
    engine.boundary = True
    s.backward(torch.tensor(1.0), engine)
    s.step(None, engine)  # type: ignore[arg-type]
    assert engine.calls == ["backward", "step", "backward", "step"]
    one = _ready()
    plain = Engine(nn.Linear(1, 1), None)
    one.backward(torch.tensor(1.0), plain)
    assert plain.calls == ["backward"], "without accumulation every backward is a boundary"


def test_clipping_outside_the_engine_is_refused_with_the_option_to_use() -> None:
    with pytest.raises(RuntimeError, match="set clip_grad_norm \\(gradient_clipping\\) instead"):
        _ready().clip_gradients(nn.Linear(1, 1), 1.0)


def test_unwrap_gives_the_engines_module() -> None:
    inner = nn.Linear(1, 1)
    assert _ready().unwrap(Engine(inner, None)) is inner
    assert _ready().unwrap(inner) is inner


# checkpoints


def test_a_save_renames_its_tag_into_place_and_then_points_latest_at_it(gloo: None, tmp_path: Path) -> None:
    s, engine, path = _ready(), Engine(nn.Linear(1, 1), None), tmp_path / "ckpt"
    s.save(path, engine, None, {"step": 3, "note": "first"})
    s.save(path, engine, None, {"step": 3, "note": "again"})  # the same step: replaced whole
    s.save(path, engine, None, {"step": 4})
    assert sorted(os.listdir(path)) == ["latest", "step3", "step4"]
    assert (path / "latest").read_text() == "step4"
    assert json.loads((path / "step3" / "state.json").read_text()) == {"step": 3, "note": "again"}


def test_a_load_returns_the_client_state(tmp_path: Path) -> None:
    engine = Engine(nn.Linear(1, 1), None)
    (tmp_path / "latest").write_text("step3")
    engine.saved = (str(tmp_path / "step3"), {"step": 3})
    assert _ready().load(tmp_path, engine, None) == {"step": 3}
    _ready().load(tmp_path, engine, torch.optim.SGD(engine.parameters(), lr=1))
    assert [c[1]["load_optimizer_states"] for c in engine.calls] == [False, True]


def test_a_load_from_no_checkpoint_says_so(tmp_path: Path) -> None:
    engine = Engine(nn.Linear(1, 1), None)
    with pytest.raises(
        FileNotFoundError, match="is not a deepspeed checkpoint directory \\(no 'latest' file\\)"
    ):
        _ready().load(tmp_path, engine, None)
    (tmp_path / "latest").write_text("step9")
    engine.saved = (None, None)
    with pytest.raises(RuntimeError, match="deepspeed could not load a checkpoint from"):
        _ready().load(tmp_path, engine, None)


# memory


def test_memory_counts_zero_partitions_and_overlapping_views_once() -> None:
    s = _ready(zero_stage=2)
    s.config = {"zero_optimization": {"stage": 2}}
    model = nn.Linear(4, 4, dtype=torch.bfloat16)  # 20 bf16 parameters: 40 bytes
    flat = torch.zeros(20)  # the fp32 master partition: 80 bytes
    inner = torch.optim.SGD([nn.Parameter(flat)], lr=0.1)
    inner.state[flat] = {"momentum_buffer": torch.zeros(20), "step": torch.tensor(1.0)}
    optimizer = SimpleNamespace(
        single_partition_of_fp32_groups=[flat],
        optimizer=inner,
        averaged_gradients={0: [torch.zeros(10), None]},  # reduced gradients, outside param.grad
    )
    engine = Engine(model, optimizer)
    memory = s.memory(engine, optimizer)  # type: ignore[arg-type]
    assert memory == {"parameters": 40, "gradients": 40, "optimizer": 160}

    views = [flat[:10], flat[5:15], flat[15:]]  # overlapping views of the master partition
    optimizer.single_partition_of_fp32_groups = views
    assert s.memory(engine, optimizer)["optimizer"] == 80 + 80  # type: ignore[arg-type]


def test_stage_3_counts_this_ranks_partition_of_each_parameter() -> None:
    s = _ready()
    s.config = {"zero_optimization": {"stage": 3}}
    model = nn.Linear(4, 4)
    for p in model.parameters():
        p.ds_tensor = torch.zeros(p.numel() // 4)  # type: ignore[attr-defined]  # a quarter each
    assert s.memory(model, None) == {"parameters": 20, "gradients": 0, "optimizer": 0}


# the environment


def test_cpu_ranks_get_the_cpu_accelerator_and_every_rank_one_build_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    deepspeed_environment("cuda")
    assert "DS_ACCELERATOR" not in os.environ
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(deepspeed_module.EXTENSIONS_DIR)
    deepspeed_environment("cpu")
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/mine")
    deepspeed_environment("cpu")
    assert (os.environ["DS_ACCELERATOR"], os.environ["TORCH_EXTENSIONS_DIR"]) == ("xpu", "/mine"), (
        "the user's"
    )
