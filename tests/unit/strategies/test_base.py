"""jupyter_shard.strategies.base: the strategy interface and ``none``, on one CPU rank.

(The registry, option checks, backward/step, accumulation and ``rebuild_optimizer``'s matching of
replaced parameters are tested in ``tests/unit/test_strategies.py``.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from jupyter_shard.strategies import base
from jupyter_shard.strategies.base import (
    NoStrategy,
    StrategyContext,
    atomic_torch_save,
    local_bytes,
    parameter_names,
    rebuild_optimizer,
)

CPU = torch.device("cpu")


def _ready(rank: int = 0, **options: Any) -> NoStrategy:
    s = NoStrategy()
    s.setup(StrategyContext(rank=rank, local_rank=rank, world_size=1, device=CPU, **options))
    return s


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A real gloo group of one rank in this process (``save`` ends with a barrier)."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_strategy_used_before_setup_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"^strategy 'none' used before setup\(\)$"):
        NoStrategy().wrap(nn.Linear(1, 1))


def test_only_16_mixed_gets_a_grad_scaler() -> None:
    assert _ready().scaler is None
    assert _ready(precision="bf16-mixed").scaler is None
    assert _ready(precision="bf16-mixed").precision.dtype is torch.bfloat16
    assert isinstance(_ready(precision="16-mixed").scaler, torch.amp.GradScaler)


def test_a_model_on_the_meta_device_is_refused_with_what_to_do() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError) as info:
        _ready().wrap(model)
    message = str(info.value)
    assert message.startswith("none: parameters 0.weight, 0.bias, 1.weight … are on the meta device")
    assert "use --strategy fsdp (or deepspeed --zero-stage 3)" in message


def test_init_module_builds_on_the_ranks_device() -> None:
    s = NoStrategy()
    s.setup(StrategyContext(rank=0, local_rank=0, world_size=1, device=torch.device("meta")))
    with s.init_module() as rng:
        model = nn.Linear(4, 4)
    assert rng is None and model.weight.is_meta
    assert not torch.empty(1).is_meta, "only inside the context"


def test_prepare_without_an_optimizer_wraps_the_model_alone() -> None:
    model = nn.Linear(2, 1)
    wrapped, optimizer = _ready().prepare(model, None)
    assert wrapped is model and optimizer is None


def test_rebuild_optimizer_passes_back_only_the_defaults_its_class_takes() -> None:
    class Recording(torch.optim.SGD):
        def __init__(self, params: Any, lr: float = 0.1) -> None:
            super().__init__(params, lr=lr)
            self.defaults["note"] = "kept by the class, not a constructor argument"

    model = nn.Linear(2, 1)
    opt = Recording(model.parameters(), lr=0.3)
    new = rebuild_optimizer(opt, parameter_names(model), model)
    assert type(new) is Recording and new.defaults["lr"] == 0.3
    assert [p for g in new.param_groups for p in g["params"]] == list(model.parameters())


def test_a_checkpoint_round_trips_the_model_the_optimizer_and_extra_state(
    tmp_path: Path, group: None
) -> None:
    s = _ready()
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt" / "model.pt"
    s.save(path, model, opt, {"step": 7})
    assert path.exists() and sorted(os.listdir(path.parent)) == ["model.pt"]

    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    extra = s.load(path, fresh, fresh_opt)
    assert extra == {"step": 7}
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_only_rank_0_writes_the_checkpoint(tmp_path: Path, group: None) -> None:
    _ready(rank=1).save(tmp_path / "model.pt", nn.Linear(1, 1), None, {})
    assert not (tmp_path / "model.pt").exists()


def test_the_full_state_dict_is_rank_0s_on_the_cpu() -> None:
    model = nn.Linear(2, 2)
    model.weight.requires_grad_(True)
    state = _ready().full_state_dict(model)
    assert state is not None and set(state) == {"weight", "bias"}
    assert torch.equal(state["weight"], model.weight) and not state["weight"].requires_grad
    assert state["weight"].device == CPU
    assert _ready(rank=1).full_state_dict(model) is None


def test_local_bytes_counts_parameters_gradients_and_optimizer_state() -> None:
    model = nn.Linear(10, 10)  # 110 float32 parameters
    assert local_bytes(model, None) == {"parameters": 440, "gradients": 0, "optimizer": 0}
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    opt.step()
    # exp_avg and exp_avg_sq per parameter; Adam's 0-d ``step`` tensors are not counted
    assert local_bytes(model, opt) == {"parameters": 440, "gradients": 440, "optimizer": 880}
    assert local_bytes(None, None) == {"parameters": 0, "gradients": 0, "optimizer": 0}


def test_local_bytes_counts_a_view_once_and_distinct_views_of_one_buffer_apart() -> None:
    flat = torch.zeros(100)
    model = nn.Module()
    model.a = nn.Parameter(flat[:30])
    model.b = nn.Parameter(flat[30:100])  # a flattened buffer holding two parameters (ZeRO)
    model.c = nn.Parameter(torch.zeros(0))
    model.again = nn.Parameter(flat[:30])  # another parameter object over a's very view
    assert local_bytes(model, None)["parameters"] == 400
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = torch.zeros(25)
    opt.state[model.a] = {"momentum_buffer": shared}
    opt.state[model.b] = {"momentum_buffer": shared}  # one tensor held twice
    assert local_bytes(model, opt)["optimizer"] == 100


def test_atomic_torch_save_writes_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "state.pt"
    atomic_torch_save({"x": torch.arange(3)}, path)
    assert torch.equal(torch.load(path)["x"], torch.arange(3))
    assert os.listdir(path.parent) == ["state.pt"]


def test_a_failed_torch_save_keeps_the_old_file_and_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.pt"
    atomic_torch_save({"old": 1}, path)

    def fail(state: Any, fh: Any) -> None:
        fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(base.torch, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_torch_save({"new": 2}, path)
    monkeypatch.undo()
    assert torch.load(path) == {"old": 1}
    assert os.listdir(tmp_path) == ["state.pt"]
