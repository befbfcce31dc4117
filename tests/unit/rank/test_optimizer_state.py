"""A resumed optimizer's state allocated from the checkpoint's metadata matches, entry for entry, the
state torch's own zero-gradient step makes, and loads the saved values bit for bit; an optimizer whose
layout is not known is left to torch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from jupyter_shard.rank.optimizer_state import KNOWN, allocate

Make = Callable[[Any], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Make] = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "AdamW-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "Adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "RMSprop-centered": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "Rprop": lambda p: torch.optim.Rprop(p),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _trained(make: Make) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = make(model.parameters())
    for i in range(3):
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _layout(optimizer: torch.optim.Optimizer) -> list[dict[str, tuple[Any, ...]]]:
    return [
        {
            k: (type(v).__name__, tuple(v.shape), v.dtype, v.device.type)
            for k, v in sorted(optimizer.state[p].items())
        }
        for g in optimizer.param_groups
        for p in g["params"]
    ]


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_allocated_state_is_torchs_layout_and_loads_the_saved_values(
    kind: str, tmp_path: Path, gloo: None
) -> None:
    model, optimizer = _trained(OPTIMIZERS[kind])
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
    dcp_save(state, storage_writer=FileSystemWriter(tmp_path))
    saved = FileSystemReader(tmp_path).read_metadata().state_dict_metadata

    by_step = OPTIMIZERS[kind](_model().parameters())
    _init_optim_state(by_step)  # what get_state_dict would make
    fresh = _model()
    resumed = OPTIMIZERS[kind](fresh.parameters())
    made_in_init = bool(resumed.state)  # Adagrad makes its state when built: nothing to allocate
    assert allocate(resumed, {id(p): n for n, p in fresh.named_parameters()}, saved) is not made_in_init
    assert _layout(resumed) == _layout(by_step)

    model_state, optim_state = get_state_dict(fresh, resumed)
    dcp_load({"model": model_state, "optim": optim_state}, storage_reader=FileSystemReader(tmp_path))
    set_state_dict(fresh, resumed, model_state_dict=model_state, optim_state_dict=optim_state)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            assert torch.equal(resumed.state[q][key], value), key
    x = torch.randn(5, 4)
    for m, o in ((model, optimizer), (fresh, resumed)):
        m(x).pow(2).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))


def test_known_names_are_torchs_optimizers() -> None:
    assert all(isinstance(getattr(torch.optim, name), type) for name in KNOWN)


def _saved(tmp_path: Path, make: Make) -> dict[str, Any]:
    model, optimizer = _trained(make)
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
    dcp_save(state, storage_writer=FileSystemWriter(tmp_path))
    return dict(FileSystemReader(tmp_path).read_metadata().state_dict_metadata)


class _MyAdam(torch.optim.Adam):
    """A subclass may keep other state: not known."""


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: torch.optim.ASGD(p), id="ASGD"),  # scalars on the parameter's device
        pytest.param(lambda p: torch.optim.LBFGS(p), id="LBFGS"),  # values that are not tensors
        pytest.param(lambda p: _MyAdam(p), id="subclass"),
    ],
)
def test_unknown_optimizers_are_left_to_torch(make: Make, tmp_path: Path, gloo: None) -> None:
    saved = _saved(tmp_path, lambda p: torch.optim.Adam(p))
    fresh = _model()
    optimizer = make(fresh.parameters())
    assert not allocate(optimizer, {id(p): n for n, p in fresh.named_parameters()}, saved)
    assert not optimizer.state


def test_a_parameter_the_checkpoint_names_but_the_optimizer_lacks_leaves_it_to_torch(
    tmp_path: Path, gloo: None
) -> None:
    saved = _saved(tmp_path, lambda p: torch.optim.Adam(p))
    fresh = _model()
    optimizer = torch.optim.Adam(list(fresh.parameters())[:2])  # the second layer's left out
    assert not allocate(optimizer, {id(p): n for n, p in fresh.named_parameters()}, saved)
    assert not optimizer.state
    renamed = torch.optim.Adam(fresh.parameters())
    assert not allocate(renamed, {id(p): f"x.{n}" for n, p in fresh.named_parameters()}, saved)
    assert not renamed.state


def test_a_state_entry_of_another_shape_leaves_it_to_torch(tmp_path: Path, gloo: None) -> None:
    saved = _saved(tmp_path, lambda p: torch.optim.Adam(p))
    key = "optim.state.0.weight.exp_avg"
    saved[key] = copy.deepcopy(saved[key])
    saved[key].size = torch.Size([7])
    fresh = _model()
    optimizer = torch.optim.Adam(fresh.parameters())
    assert not allocate(optimizer, {id(p): n for n, p in fresh.named_parameters()}, saved)
    assert not optimizer.state


def test_sharded_parameters_get_sharded_state(mesh: Any, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    weight = nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    optimizer = torch.optim.AdamW([weight])
    full = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), [])
    scalar = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([]), [])
    saved = {
        "optim.state.w.exp_avg": full,
        "optim.state.w.exp_avg_sq": full,
        "optim.state.w.step": scalar,
    }
    assert allocate(optimizer, {id(weight): "w"}, saved)
    state = optimizer.state[weight]
    for key in ("exp_avg", "exp_avg_sq"):
        assert isinstance(state[key], DTensor) and state[key].placements == (Shard(0),)
        assert state[key].to_local().shape == (2, 3) and not state[key].requires_grad
    assert not isinstance(state["step"], DTensor) and state["step"].shape == ()


def test_a_zero_dim_parameter_keeps_its_step_on_the_cpu_and_its_moments_beside_it() -> None:
    """Told by name, not by shape: a 0-dim parameter's moments are 0-dim like its step."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    scale = nn.Parameter(torch.empty((), device="meta"))  # another device than the CPU's
    optimizer = torch.optim.Adam([scale])
    scalar = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([]), [])
    saved = {f"optim.state.scale.{k}": scalar for k in ("step", "exp_avg", "exp_avg_sq")}
    assert allocate(optimizer, {id(scale): "scale"}, saved)
    state = optimizer.state[scale]
    assert state["step"].device.type == "cpu"  # where torch's Adam keeps it (not capturable)
    assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
    other = nn.Parameter(torch.empty(3))
    odd = {"optim.state.w.step": scalar, "optim.state.w.mystery": scalar}  # a 0-dim entry not known
    fresh = torch.optim.Adam([other])
    assert not allocate(fresh, {id(other): "w"}, odd) and not fresh.state
