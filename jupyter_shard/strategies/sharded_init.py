"""Building a model no rank holds whole: on the meta device, then each rank's shard filled in place.

``with shard.init_module(): model = Big()`` under FSDP builds ``Big`` on the meta device: shapes and
dtypes, no storage. ``shard.prepare`` shards the meta model, allocates only this rank's shard
(``to_empty``), and fills it here. The values are those a plain ``Big()`` on the CPU would have had
from the same generator state: every module that owns parameters or buffers is initialised by its
own ``reset_parameters()`` (every ``torch.nn`` layer has one), in the order ``model.modules()``
visits them - the order a model's constructor builds its layers - from the CPU generator as it was
when the ``with`` block was entered. Each module is initialised at full size on the CPU, one module at
a time, and only this rank's slice is kept, so the peak is one shard plus the largest single layer.
The generator itself is left as it was before ``prepare``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["built_on_meta", "check_initialisable", "materialise", "meta_build", "release_storage"]


@contextlib.contextmanager
def meta_build() -> Iterator[torch.Tensor]:
    """Build on the meta device; yields the CPU generator state the model's values will come from."""
    with torch.device("meta"):
        yield torch.get_rng_state()


def built_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def check_initialisable(model: nn.Module) -> None:
    """Every module that owns parameters or buffers must be able to initialise them again."""
    missing = [
        f"{name or '(the model itself)'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if _owns_state(m) and not callable(getattr(m, "reset_parameters", None))
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"built under shard.init_module(), these modules have parameters or buffers but no "
            f"reset_parameters() to initialise them: {shown}. Give each a reset_parameters() that "
            "fills its own parameters and buffers, or build the model outside shard.init_module()"
        )


def materialise(
    model: nn.Module,
    device: torch.device,
    rng_state: torch.Tensor | None,
    params_on: torch.device | None = None,
) -> None:
    """Allocate this rank's part of a sharded meta model and initialise it (see above).

    Parameters go to ``params_on`` (the CPU when they are offloaded), buffers to ``device``.
    """
    check_initialisable(model)
    model.to_empty(device=params_on or device)
    kept = torch.get_rng_state()
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    try:
        with torch.no_grad():
            for module in model.modules():
                if _owns_state(module):
                    _initialise(module)
    finally:
        torch.set_rng_state(kept)
    if params_on is not None and params_on != device:
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(device)


def _initialise(module: nn.Module) -> None:
    """``reset_parameters`` on full-size CPU stand-ins for the module's own tensors; keep our slice."""
    params = dict(module._parameters)
    buffers = dict(module._buffers)
    try:
        for name, p in params.items():
            if p is not None:
                full = torch.empty(p.shape, dtype=p.dtype)
                module._parameters[name] = nn.Parameter(full, requires_grad=p.requires_grad)
        for name, b in buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
        module.reset_parameters()  # type: ignore[operator]
        for name, p in params.items():
            if p is not None:
                _keep_slice(module._parameters[name], p)  # type: ignore[arg-type]
        for name, b in buffers.items():
            if b is not None:
                _keep_slice(module._buffers[name], b)  # type: ignore[arg-type]
    finally:
        module._parameters.update(params)
        module._buffers.update(buffers)


def _keep_slice(full: torch.Tensor, target: torch.Tensor) -> None:
    """Copy the part of ``full`` that ``target`` holds on this rank into it."""
    full = full.detach()
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            full.shape, target.device_mesh, target.placements
        )
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        target.to_local().copy_(full[index])
    else:
        target.copy_(full)


def release_storage(params: list[nn.Parameter]) -> None:
    """Free the memory of parameters a wrapper has replaced (an optimizer may still refer to them)."""
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
