"""How to build a prepared model again: its architecture, the buffers no state dict holds, and its optimizer.

``shard.prepare`` records a :class:`Recipe` for the model it wraps, so that a resumed pool
(``%dist_resume``) can build the same model and optimizer at any world size and prepare them
again; the values then come from the checkpoint. The architecture is a meta copy (no memory of the
model's size), the non-persistent buffers (rotary tables, masks) are kept as CPU copies because no
state dict holds them, and the optimizer is kept as its class, its constructor's settings and each
parameter group by parameter *name*: names are the same at every world size, parameter objects are
not.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Recipe", "record"]


@dataclass
class Recipe:
    """What :meth:`build` needs to make the prepared model and optimizer again, unprepared."""

    template: nn.Module | None  # meta tensors of the full shapes
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # non-persistent, CPU copies
    optimizer: type[torch.optim.Optimizer] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)  # settings, and "params": names
    accumulate: int | None = None
    clip_grad_norm: float | None = None
    problem: str = ""  # why it cannot be built again, said when a resume tries

    def build(self, meta: bool = False) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """The model on the CPU (parameters zero, non-persistent buffers as recorded) and its optimizer.

        ``meta``: parameters and persistent buffers stay on the meta device, for a strategy that
        allocates only each rank's shard of them (FSDP), to be filled from a checkpoint; the whole
        model is then never allocated on one rank."""
        if self.template is None:
            self.problem = self.problem or "its architecture could not be copied when it was prepared"
        if self.problem or self.template is None:
            raise RuntimeError(
                f"the prepared model cannot be built again: {self.problem}; prepare it again in a "
                "cell after resuming"
            )
        model = copy.deepcopy(self.template)
        if not meta:
            model.to_empty(device="cpu")
            with torch.no_grad():
                for t in model.state_dict().values():
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        t.zero_()
        for name, value in self.buffers.items():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._buffers[leaf] = value.clone()
        if self.optimizer is None:
            return model, None
        named = dict(model.named_parameters())
        missing = sorted({n for g in self.groups for n in g["params"]} - set(named))
        if missing:
            raise RuntimeError(f"the optimizer's parameters {missing[:3]} are not in the rebuilt model")
        groups = [{**g, "params": [named[n] for n in g["params"]]} for g in self.groups]
        return model, self.optimizer(groups, **self.defaults)


def record(
    model: nn.Module,
    template: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    accumulate: int | None,
    clip_grad_norm: float | None,
) -> Recipe:
    """The recipe of ``model`` as ``shard.prepare`` receives it, before any wrapper changes it."""
    recipe = Recipe(
        template, _non_persistent_buffers(model), accumulate=accumulate, clip_grad_norm=clip_grad_norm
    )
    if optimizer is None:
        return recipe
    names = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        unnamed = [p for p in group["params"] if id(p) not in names]
        if unnamed:
            recipe.problem = (
                f"its optimizer holds {len(unnamed)} tensor(s) that are not the model's parameters"
            )
            return recipe
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": [names[id(p)] for p in group["params"]]})
    accepted = inspect.signature(type(optimizer)).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    recipe.optimizer = type(optimizer)
    recipe.defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    recipe.groups = groups
    return recipe


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers a state dict leaves out, with their values (meta ones, which have none, are skipped)."""
    kept: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for leaf in getattr(module, "_non_persistent_buffers_set", ()):
            value = module._buffers.get(leaf)
            if value is not None and not value.is_meta:
                kept[f"{prefix}.{leaf}" if prefix else leaf] = value.detach().cpu().clone()
    return kept
