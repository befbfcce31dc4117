"""jupyter_shard.strategies.fsdp: FSDP2's options, mesh, units, optimizer and checkpoints.

Meshes and units on torch's fake process group (shapes, no collectives); checkpoints through a real
gloo group of one rank in this process. (Which modules become units by default, ``default_units``,
is tested in ``tests/unit/strategies/test_sharded_init.py``.)
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
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from jupyter_shard.strategies import fsdp
from jupyter_shard.strategies.base import StrategyContext
from jupyter_shard.strategies.fsdp import EXTRA_FILE, FSDPStrategy

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.relu(self.inner(x)))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x))
        return out


def _ready(world_size: int = 1, **options: Any) -> FSDPStrategy:
    extra = options.pop("extra", {})
    precision = options.pop("precision", "32")
    s = FSDPStrategy(**options)
    s.setup(StrategyContext(0, 0, world_size, CPU, precision=precision, extra=extra))
    return s


@pytest.fixture(autouse=True)
def no_cached_meshes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsdp, "_meshes", {})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.fixture
def fake_world() -> Iterator[None]:
    """Rank 0 of 4 on torch's fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


# options


def test_sharding_is_checked_and_case_insensitive() -> None:
    assert FSDPStrategy(sharding="shard_grad_op").sharding == "SHARD_GRAD_OP"
    assert FSDPStrategy().sharding == "FULL_SHARD"
    with pytest.raises(ValueError) as info:
        FSDPStrategy(sharding="ZERO3")
    assert str(info.value) == (
        "fsdp sharding 'ZERO3' is not valid; choose one of: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD"
    )


@pytest.mark.parametrize(
    ("auto_wrap", "classes", "min_params"),
    [
        (None, frozenset(), None),
        ("Block", frozenset({"Block"}), None),
        (["Block", "Head"], frozenset({"Block", "Head"}), None),
        (1000, frozenset(), 1000),
        ({"min_params": 500}, frozenset(), 500),
    ],
)
def test_auto_wrap_names_classes_or_a_parameter_count(
    auto_wrap: Any, classes: frozenset[str], min_params: int | None
) -> None:
    s = FSDPStrategy(auto_wrap=auto_wrap)
    assert (s.wrap_classes, s.min_params) == (classes, min_params)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"auto_wrap": 2.5},
            'fsdp auto_wrap 2.5 is not valid; give a list of module class names or {"min_params": N}',
        ),
        ({"auto_wrap": {"min_params": 5, "x": 1}}, "fsdp auto_wrap {'min_params': 5, 'x': 1} is not valid"),
        ({"activation_checkpointing": [1]}, "fsdp activation_checkpointing [1] is not valid; give a list of"),
        ({"shard_group_size": 0}, "fsdp shard_group_size 0 is not valid; give a whole number of ranks >= 1"),
        ({"shard_group_size": "2"}, "fsdp shard_group_size '2' is not valid"),
    ],
)
def test_bad_options_are_refused_with_what_is_allowed(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        FSDPStrategy(**options)
    assert str(info.value).startswith(message)


def test_offload_follows_the_line_and_the_option_wins() -> None:
    assert _ready().cpu_offload is False
    assert _ready(extra={"offload": "cpu"}).cpu_offload is True
    assert _ready(cpu_offload=False, extra={"offload": "cpu"}).cpu_offload is False
    with pytest.raises(
        ValueError, match=r"^fsdp offloads to cpu only; --offload nvme needs --strategy deepspeed$"
    ):
        _ready(extra={"offload": "nvme"})


def test_16_mixed_uses_the_scaler_for_sharded_gradients() -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert isinstance(_ready(precision="16-mixed").scaler, ShardedGradScaler)
    assert _ready(precision="bf16-mixed").scaler is None


# mesh


@pytest.mark.parametrize(
    ("options", "local", "shape", "names"),
    [
        ({}, None, (4,), ("shard",)),
        ({"sharding": "SHARD_GRAD_OP"}, None, (4,), ("shard",)),
        ({"sharding": "HYBRID_SHARD", "shard_group_size": 2}, None, (2, 2), ("replicate", "shard")),
        ({"sharding": "HYBRID_SHARD"}, "2", (2, 2), ("replicate", "shard")),  # a node's ranks by default
        ({"sharding": "HYBRID_SHARD"}, None, (1, 4), ("replicate", "shard")),
        ({"sharding": "NO_SHARD"}, None, (4, 1), ("replicate", "shard")),
    ],
)
def test_the_mesh_shape_follows_the_sharding(
    fake_world: None,
    monkeypatch: pytest.MonkeyPatch,
    options: dict[str, Any],
    local: str | None,
    shape: tuple[int, ...],
    names: tuple[str, ...],
) -> None:
    if local is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    mesh = _ready(4, **options).mesh()
    assert tuple(mesh.shape) == shape and mesh.mesh_dim_names == names
    assert _ready(4, **options).mesh() is mesh, "one mesh per shape, kept"


def test_a_shard_group_that_does_not_divide_the_world_is_refused(fake_world: None) -> None:
    with pytest.raises(ValueError, match=r"^fsdp shard_group_size 3 does not divide the world size 4$"):
        _ready(4, sharding="HYBRID_SHARD", shard_group_size=3).mesh()


# units and the optimizer


def _units(model: nn.Module) -> list[str]:
    return sorted(name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule))


def test_auto_wrap_by_class_makes_each_instance_a_unit(fake_world: None) -> None:
    model = _ready(4, auto_wrap=["Block"]).wrap(Net())
    assert _units(model) == ["<root>", "blocks.0", "blocks.1"]
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_auto_wrap_by_count_claims_parameters_children_first(fake_world: None) -> None:
    # each Linear(8, 8) holds 72 parameters, a Block 144: Linears of 72 are units, and their
    # Blocks are left with none free; the head (18) is below the count
    model = _ready(4, auto_wrap=72).wrap(Net())
    assert _units(model) == ["<root>", "blocks.0.inner", "blocks.0.out", "blocks.1.inner", "blocks.1.out"]
    model = _ready(4, auto_wrap={"min_params": 100}).wrap(Net())
    assert _units(model) == ["<root>", "blocks.0", "blocks.1"]


def test_prepare_rebuilds_the_optimizer_over_the_sharded_parameters(fake_world: None) -> None:
    model = Net()
    opt = torch.optim.AdamW(
        [{"params": model.blocks.parameters(), "lr": 0.1}, {"params": model.head.parameters()}],
        lr=0.01,
        weight_decay=0.3,
    )
    wrapped, new = _ready(4, auto_wrap="Block").prepare(model, opt)
    assert new is not None and type(new) is torch.optim.AdamW
    assert [len(g["params"]) for g in new.param_groups] == [8, 2]
    assert [g["lr"] for g in new.param_groups] == [0.1, 0.01] and new.defaults["weight_decay"] == 0.3
    sharded = {id(p) for p in wrapped.parameters()}
    assert all(id(p) in sharded and isinstance(p, DTensor) for g in new.param_groups for p in g["params"])
    assert _ready(4).prepare(Net(), None)[1] is None


def test_activation_checkpointing_wraps_the_named_classes_and_their_parameters_keep_their_names(
    fake_world: None,
) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    wrapped, new = _ready(4, activation_checkpointing=["Block"], auto_wrap=["Block"]).prepare(model, opt)
    assert all(isinstance(b, CheckpointWrapper) for b in wrapped.blocks)
    assert _units(wrapped) == ["<root>", "blocks.0", "blocks.1"], "a wrapped Block is still a Block unit"
    assert new is not None
    assert [id(p) for p in new.param_groups[0]["params"]] == [id(p) for p in wrapped.parameters()]


def test_no_sync_turns_gradient_sync_off_and_back_on(
    fake_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _ready(4)
    model = s.wrap(Net())
    calls: list[bool] = []
    monkeypatch.setattr(model, "set_requires_gradient_sync", calls.append)
    with pytest.raises(RuntimeError, match="in the micro-step"), s.no_sync(model):
        assert calls == [False]
        raise RuntimeError("in the micro-step")
    assert calls == [False, True]
    with s.no_sync(nn.Linear(1, 1)):  # not an FSDP module: nothing to turn off
        pass


# checkpoints


def test_a_checkpoint_round_trips_and_replaces_the_old_one_whole(gloo: None, tmp_path: Path) -> None:
    s = _ready(1)
    model = s.wrap(Net())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt"
    s.save(path, model, opt, {"step": 1})
    s.save(path, model, opt, {"step": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "store"], "no .saving or .prev left"
    assert (path / EXTRA_FILE).is_file()

    fresh = _ready(1).wrap(Net())
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    assert s.load(path, fresh, fresh_opt) == {"step": 2}
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    assert fresh_opt.param_groups[0]["lr"] == 0.01


def test_a_save_that_died_between_its_renames_is_loaded_from_the_previous(gloo: None, tmp_path: Path) -> None:
    s = _ready(1)
    model = s.wrap(Net())
    path = tmp_path / "ckpt"
    s.save(path, model, None, {"step": 5})
    os.replace(path, tmp_path / ".ckpt.prev")  # the old one moved aside, the new one not yet in place
    assert s.load(path, _ready(1).wrap(Net()), None) == {"step": 5}


def test_loading_a_directory_that_is_no_checkpoint_says_so(gloo: None, tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match=r"is not an fsdp checkpoint directory \(no extra\.pt in it\)"
    ):
        _ready(1).load(tmp_path, nn.Linear(1, 1), None)


def test_a_save_rank_0_cannot_write_raises_there(gloo: None, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    s = _ready(1)
    with pytest.raises(OSError):
        s.save(tmp_path / "file" / "ckpt", s.wrap(Net()), None, {})
