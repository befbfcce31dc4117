"""jupyter_shard.strategies: registry, lookup errors, option checking, precision."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard import strategies
from jupyter_shard.strategies import (
    available_strategies,
    create_strategy,
    register_strategy,
    strategy_class,
)
from jupyter_shard.strategies.base import NoStrategy, StrategyBase
from jupyter_shard.strategies.ddp import DDPStrategy


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    saved = dict(strategies._registered)
    yield
    strategies._registered.clear()
    strategies._registered.update(saved)


def test_builtins_are_listed() -> None:
    names = available_strategies()
    assert {"none", "ddp"} <= set(names)
    assert names == sorted(names)


def test_create_builtins() -> None:
    assert isinstance(create_strategy("none"), NoStrategy)
    ddp = create_strategy("ddp", find_unused_parameters=True)
    assert isinstance(ddp, DDPStrategy)
    assert ddp.options == {"find_unused_parameters": True}


def test_unknown_strategy_lists_the_available_ones() -> None:
    with pytest.raises(ValueError) as info:
        create_strategy("megatron")
    msg = str(info.value)
    assert msg.startswith(
        "strategy 'megatron' is not installed in this version of jupyter_shard; available: "
    )
    assert msg.endswith(", ".join(available_strategies()))
    assert "ddp" in msg and "none" in msg


class _Custom(StrategyBase):
    name = "custom"

    def __init__(self, **options: Any) -> None:
        self.options = options


def test_register_strategy_with_defaults_and_overrides() -> None:
    register_strategy("custom", _Custom, bucket_mb=25, overlap=True)
    assert "custom" in available_strategies()
    s = create_strategy("custom", bucket_mb=50)
    assert isinstance(s, _Custom)
    assert s.options == {"bucket_mb": 50, "overlap": True}


def test_registered_strategy_can_override_a_builtin_name() -> None:
    register_strategy("ddp", _Custom)
    assert isinstance(create_strategy("ddp"), _Custom)
    assert available_strategies().count("ddp") == 1


def test_a_strategy_installed_as_an_entry_point_is_listed_and_loaded_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "unit_strategy-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: unit-strategy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[jupyter_shard.strategies]\nsitewide = unit_strategy:Site\n")
    (tmp_path / "unit_strategy.py").write_text(
        "from jupyter_shard.strategies.base import NoStrategy\nclass Site(NoStrategy):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert (
            "sitewide" in available_strategies() and "unit_strategy" not in sys.modules
        )  # read, not imported
        assert type(create_strategy("sitewide")).__name__ == "Site"
        register_strategy("sitewide", _Custom)  # what this process registers comes first
        assert strategy_class("sitewide") is _Custom
    finally:
        sys.modules.pop("unit_strategy", None)


def test_ddp_rejects_unknown_options() -> None:
    with pytest.raises(ValueError) as info:
        DDPStrategy(find_unused_parameters=True, bucket_cap=1, zzz=2)
    assert str(info.value) == (
        "unknown ddp option(s) bucket_cap, zzz; allowed: broadcast_buffers, bucket_cap_mb, comm_hook, "
        "find_unused_parameters, gradient_as_bucket_view, static_graph, sync_batchnorm"
    )
    with pytest.raises(ValueError, match="unknown ddp option"):
        create_strategy("ddp", bogus=True)


def test_ddp_accepts_every_documented_option() -> None:
    opts = {
        "find_unused_parameters": True,
        "static_graph": False,
        "gradient_as_bucket_view": True,
        "broadcast_buffers": False,
        "bucket_cap_mb": 10,
        "comm_hook": "bf16",
        "sync_batchnorm": True,
    }
    assert DDPStrategy(**opts).options == opts


def test_none_strategy_takes_no_options() -> None:
    with pytest.raises(ValueError, match=r"^unknown none option\(s\) lr; allowed: none$"):
        create_strategy("none", lr=0.1)


class _Optimizer:
    """Stands in for torch.optim (whose first import costs seconds)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def step(self) -> None:
        self.calls.append(("step", None))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append(("zero_grad", set_to_none))


def _setup(s: object, **ctx: object) -> None:
    import torch

    from jupyter_shard.strategies.base import StrategyContext

    s.setup(StrategyContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), **ctx))  # type: ignore[attr-defined, arg-type]


def test_none_strategy_wraps_backwards_and_steps() -> None:
    import torch

    s = create_strategy("none")
    _setup(s)
    model = s.wrap(torch.nn.Linear(2, 1))
    assert s.unwrap(model) is model
    assert model.weight.grad is None
    s.backward(model(torch.ones(4, 2)).sum(), model)
    assert model.weight.grad is not None
    assert torch.equal(model.weight.grad, torch.full((1, 2), 4.0))
    opt = _Optimizer()
    s.step(opt, model)  # type: ignore[arg-type]
    assert opt.calls == [("step", None), ("zero_grad", True)]


def test_accumulation_scales_the_loss_and_clipping_bounds_the_norm() -> None:
    import torch

    s = create_strategy("none")
    _setup(s, accumulate=4, clip_grad_norm=0.5)
    model = s.wrap(torch.nn.Linear(2, 1))
    s.backward(model(torch.ones(4, 2)).sum(), model)
    assert torch.equal(model.weight.grad, torch.full((1, 2), 1.0))
    norm = s.clip_gradients(model, 0.5)
    assert float(norm) > 0.5
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert abs(float(total) - 0.5) < 1e-5


def test_bf16_mixed_runs_forward_in_bf16_and_keeps_fp32_weights() -> None:
    import torch

    s = create_strategy("none")
    _setup(s, precision="bf16-mixed")
    model, _ = s.prepare(torch.nn.Linear(2, 1), None)
    out = model(torch.ones(3, 2))
    assert out.dtype == torch.bfloat16
    assert model.weight.dtype == torch.float32


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision 'fp8' is not valid"):
        _setup(create_strategy("none"), precision="fp8")


def test_ddp_unwrap_of_a_plain_module_is_identity() -> None:
    import torch

    m = torch.nn.Linear(1, 1)
    assert DDPStrategy().unwrap(m) is m


def test_rebuild_optimizer_keeps_class_settings_and_follows_replaced_parameters() -> None:
    import torch

    from jupyter_shard.strategies.base import parameter_names, rebuild_optimizer

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(
        [{"params": [model.weight], "lr": 0.01}, {"params": [model.bias], "lr": 0.5}], weight_decay=0.2
    )
    names = parameter_names(model)
    model.weight = torch.nn.Parameter(model.weight.detach().clone())  # a wrapper swapping parameters in place
    new = rebuild_optimizer(opt, names, model)
    assert type(new) is torch.optim.AdamW
    assert new.param_groups[0]["params"][0] is model.weight
    assert new.param_groups[1]["params"][0] is model.bias
    assert [g["lr"] for g in new.param_groups] == [0.01, 0.5]
    assert new.defaults["weight_decay"] == 0.2


def test_cast_floating_reaches_nested_inputs_and_leaves_integer_tensors() -> None:
    from collections import namedtuple

    import torch

    from jupyter_shard.strategies.precision import cast_floating

    pair = namedtuple("pair", "x ids")
    x, ids, mask = torch.ones(2), torch.arange(2), torch.ones(2, dtype=torch.bool)
    out = cast_floating(
        (x, [x, ids], {"x": x, "ids": ids, "mask": mask, "n": 3}, pair(x, ids)), torch.bfloat16
    )
    assert out[0].dtype == torch.bfloat16 and isinstance(out[1], list)
    assert [t.dtype for t in out[1]] == [torch.bfloat16, torch.int64]
    assert out[2]["ids"] is ids and out[2]["mask"] is mask and out[2]["n"] == 3
    assert out[2]["x"].dtype == torch.bfloat16
    assert type(out[3]) is pair and out[3].x.dtype == torch.bfloat16 and out[3].ids is ids


def test_cast_floating_inputs_runs_a_low_precision_model_without_autocast() -> None:
    """As under DeepSpeed on CUDA, where the engine turns autocast off around the model's forward."""
    import torch
    from torch import nn

    from jupyter_shard.strategies.precision import cast_floating_inputs, cast_parameters

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 4)
            self.seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

        def forward(
            self, ids: torch.Tensor, batch: dict[str, torch.Tensor], *, scale: torch.Tensor
        ) -> torch.Tensor:
            self.seen.append((ids.dtype, batch["x"].dtype, torch.is_autocast_enabled("cpu")))
            return (self.emb(ids) + self.lin(batch["x"])) * scale

    net = Net()
    weight = net.lin.weight
    cast_parameters(net, torch.float16)
    assert weight.dtype == torch.float16 and net.lin.weight is weight, "the same parameter, cast in place"
    cast_floating_inputs(net, torch.float16)
    with torch.autocast("cpu", enabled=False):
        out = net(torch.tensor([1, 2]), {"x": torch.ones(2, 4)}, scale=torch.tensor(2.0))
    assert out.dtype == torch.float16
    assert net.seen == [(torch.int64, torch.float16, False)]
