"""The recipe ``shard.prepare`` records: a model built again from it has the architecture, the
non-persistent buffers and an optimizer of the same class and settings, with groups by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from jupyter_shard.rank.recipe import record


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
        self.register_buffer("scale", torch.tensor([2.0, 3.0]), persistent=False)
        self.register_buffer("count", torch.tensor(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def _template(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to("meta")


def test_build_gives_the_architecture_buffers_and_optimizer_groups_by_name() -> None:
    model = Scaled()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3
    )
    recipe = record(model, _template(model), opt, 4, 1.0)
    built, built_opt = recipe.build()
    assert isinstance(built, Scaled) and recipe.accumulate == 4 and recipe.clip_grad_norm == 1.0
    assert torch.equal(built.scale, torch.tensor([2.0, 3.0]))  # no state dict holds it
    assert all(not t.is_meta for t in built.state_dict().values())
    assert all(torch.count_nonzero(p) == 0 for p in built.parameters())
    assert isinstance(built_opt, torch.optim.AdamW) and built_opt.defaults["lr"] == 3e-3
    names = {id(p): n for n, p in built.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in built_opt.param_groups] == [
        ["body.0.weight", "body.2.weight"],
        ["body.0.bias", "body.2.bias"],
    ]
    assert [g["weight_decay"] for g in built_opt.param_groups] == [0.1, 0.0]
    assert built(torch.ones(1, 3)).shape == (1, 2)


def test_a_meta_build_allocates_no_parameter_and_keeps_the_non_persistent_buffers() -> None:
    """For FSDP, which allocates only each rank's shard of a meta model: the whole model is never
    held, and a buffer no state dict holds keeps its value (:func:`values_from_checkpoint`)."""
    from jupyter_shard.strategies.sharded_init import built_on_meta, materialise, values_from_checkpoint

    model = Scaled()
    built, opt = record(model, _template(model), torch.optim.AdamW(model.parameters()), None, None).build(
        meta=True
    )
    assert built_on_meta(built) and all(p.is_meta for p in built.parameters())
    assert built.count.is_meta and torch.equal(built.scale, torch.tensor([2.0, 3.0]))
    assert opt is not None and all(p.is_meta for g in opt.param_groups for p in g["params"])
    replayed: list[str] = []
    built.body[0].reset_parameters = lambda: replayed.append("reset")  # type: ignore[method-assign]
    with values_from_checkpoint():
        materialise(built, torch.device("cpu"), None)
    assert not built_on_meta(built) and not replayed  # allocated, nothing initialised
    assert torch.equal(built.scale, torch.tensor([2.0, 3.0]))
    plain = nn.Sequential(nn.Linear(3, 2)).to("meta")
    plain[0].reset_parameters = lambda: replayed.append("reset")  # type: ignore[method-assign]
    materialise(plain, torch.device("cpu"), None)
    assert replayed == ["reset"]  # outside the block, a meta model is initialised


def test_without_an_optimizer_build_gives_none() -> None:
    model = Scaled()
    built, opt = record(model, _template(model), None, None, None).build()
    assert opt is None and isinstance(built, Scaled)


def test_an_optimizer_over_foreign_tensors_or_a_missing_template_is_said_when_building() -> None:
    model = Scaled()
    stray = nn.Parameter(torch.zeros(2))
    recipe = record(
        model, _template(model), torch.optim.SGD([*model.parameters(), stray], lr=0.1), None, None
    )
    with pytest.raises(RuntimeError, match="optimizer holds 1 tensor"):
        recipe.build()
    with pytest.raises(RuntimeError, match="architecture could not be copied"):
        record(model, None, None, None, None).build()
