"""An optimizer's state, allocated in the shapes a checkpoint holds, for DCP to fill on a resume.

Why it exists: DCP loads in place, into a state dict that already has every tensor, and torch's
``get_state_dict`` makes an optimizer's state by stepping it once with zero gradients at learning
rate 0. That step is a whole optimizer step over the model for values that DCP then overwrites: for
Adam over 0.64 GB of parameters on one CPU core, 2.6 s of a 10 s resume. :func:`allocate` instead
gives each parameter the state entries the checkpoint lists, uninitialised, for the torch optimizers
whose state it knows (:data:`KNOWN`): every entry a tensor of the parameter's shape (``like``
the parameter: a DTensor where it is one), but the one-number entries named in :data:`SCALARS`
(``step``: on the CPU, or on the parameter's device under ``capturable`` or ``fused``, as those
optimizers keep it; told by name, as a 0-dim parameter's moments are 0-dim too). Anything else (another
optimizer library, a state entry of another shape, a value that is not a tensor, a parameter the
checkpoint names that this optimizer lacks) leaves the optimizer as it was, and torch's step makes
the state as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["KNOWN", "PREFIX", "SCALARS", "allocate"]

PREFIX = "optim.state."  # a checkpoint's key for one state entry: optim.state.<parameter>.<entry>

# torch's optimizers whose scalar state sits on the CPU unless ``capturable`` or ``fused`` (read in
# torch/optim for 2.6 to 2.14); ASGD (its scalars always on the parameter's device), Adafactor (factored
# moments), LBFGS and SparseAdam (values that are not tensors) are left to torch's own step
SCALARS = frozenset(
    {"step", "mu_product"}
)  # their one-number entries; every other is shaped as the parameter
KNOWN = frozenset(
    {"Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD"}
)


def allocate(optimizer: torch.optim.Optimizer, names: Mapping[int, str], saved: Mapping[str, Any]) -> bool:
    """Give ``optimizer`` the state entries ``saved`` (a DCP checkpoint's metadata by key) holds for
    its parameters (named by ``names``, id -> the checkpoint's parameter name), unfilled; whether it
    did. Nothing is changed when it returns False."""
    if (
        optimizer.state
        or type(optimizer).__name__ not in KNOWN
        or type(optimizer) is not getattr(torch.optim, type(optimizer).__name__, None)
    ):
        return False
    wanted: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, meta in saved.items():
        if not key.startswith(PREFIX):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            return False  # a value torch pickles (an int, a list): its optimizer's own step makes it
        parameter, _, entry = key[len(PREFIX) :].rpartition(".")
        wanted.setdefault(parameter, {})[entry] = meta
    made: dict[nn.Parameter | torch.Tensor, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        scalars_on_device = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            name = names.get(id(p))
            entries = wanted.pop(name, None) if name is not None else None
            if not entries:
                continue
            state: dict[str, torch.Tensor] = {}
            for entry, meta in entries.items():
                dtype = meta.properties.dtype
                if entry in SCALARS and len(meta.size) == 0:  # (by name: a 0-dim parameter's moments too)
                    device = p.device if scalars_on_device else torch.device("cpu")
                    state[entry] = torch.zeros((), dtype=dtype, device=device)
                elif entry not in SCALARS and tuple(meta.size) == tuple(p.shape):
                    state[entry] = torch.empty_like(p, dtype=dtype, requires_grad=False)
                else:
                    return False
            made[p] = state
    if wanted or not made:  # a parameter the checkpoint has state for is not this optimizer's
        return False
    for p, state in made.items():
        optimizer.state[p] = state
    return True
