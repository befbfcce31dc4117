"""The training state a suspend keeps besides the weights and the optimizer's tensors: the
gradients of a half-done accumulation, the loss scaler, the random generators, and which
parameters the optimizer had state for.

torch's ``get_state_dict`` fills an optimizer that has no state yet by stepping it once at learning
rate 0 (so that every parameter has ``step`` and moments to save). That step is not harmless: Adam's
step count becomes 1 and its bias correction then differs from a run that never stopped. So an
optimizer without state (suspended before its first step, or every step so far skipped by the
loss scaler) is saved as its hyperparameters alone (:func:`optimizer_groups`), and on load only the
parameters the checkpoint holds state for get any (:func:`keep_saved_state`).
"""

from __future__ import annotations

import importlib
import random
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from jupyter_shard.rank import shard as shard_module

__all__ = [
    "accumulated",
    "keep_saved_state",
    "optimizer_groups",
    "restore",
    "rng_state",
    "set_groups",
    "set_rng_state",
]


def accumulated(helper: shard_module.Shard) -> dict[str, torch.Tensor] | None:
    """This rank's gradients of the micro-steps taken since the last optimizer step, by parameter
    name (None at a step boundary). ddp and a single rank keep them on the parameters; the sharding
    strategies keep them inside FSDP or the DeepSpeed engine, so there a suspend waits for the
    boundary (one line says how many micro-steps are left)."""
    micro = helper.progress[1]
    accumulate = helper.impl.ctx.accumulate
    done = micro % accumulate
    if not done:
        return None
    if helper.strategy not in ("ddp", "none"):
        raise RuntimeError(
            f"the pool is between micro-steps ({done} of --accumulate {accumulate} taken) and "
            f"{helper.strategy} holds their gradients where a suspend cannot keep them; take the remaining "
            f"{accumulate - done} (shard.backward and shard.step), then suspend"
        )
    model = helper.impl.unwrap(helper.prepared_model)  # type: ignore[arg-type]
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def restore(helper: shard_module.Shard, wrapped: nn.Module, payload: Mapping[str, Any]) -> None:
    """The step counters, the loss scaler and a half-done accumulation's gradients, into the
    prepared model of a resumed pool (of the same world size, where there are gradients)."""
    step, micro = payload["progress"]
    helper.progress = (int(step), int(micro))
    if payload.get("scaler") and helper.impl.scaler is not None:
        helper.impl.scaler.load_state_dict(payload["scaler"])
    if payload.get("grads"):
        named = dict(helper.impl.unwrap(wrapped).named_parameters())
        for name, grad in payload["grads"].items():
            named[name].grad = grad.to(named[name].device)


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters, group by group (a scheduler may have changed them)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def set_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(
            f"the suspended optimizer had {len(groups)} parameter groups and the rebuilt one has "
            f"{len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update(saved)


def keep_saved_state(state: dict[str, Any], saved_keys: Iterable[str]) -> None:
    """Leave out of ``state["optim"]["state"]`` (to be loaded) every parameter the checkpoint has no
    optimizer state for: loading leaves those without state, as they were when suspended."""
    prefixes = {_parameter_of(key) for key in saved_keys if key.startswith("optim.state.")}
    optim = state.get("optim", {}).get("state", {})
    for name in [n for n in optim if n not in prefixes]:
        del optim[name]


def _parameter_of(key: str) -> str:
    """``optim.state.<parameter name>.<state name>`` -> the parameter's name."""
    return key[len("optim.state.") :].rsplit(".", 1)[0]


# -- random generators ---------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        importlib.import_module("numpy").random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
