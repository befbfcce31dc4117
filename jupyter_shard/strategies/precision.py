"""What ``--precision`` means, in one place for every strategy.

``32`` trains in the model's own dtype. ``bf16-mixed`` and ``16-mixed`` compute in bfloat16 or
float16 and keep (or reach) float32 for the update, in the way each strategy has for it: ``none``
and ``ddp`` run the forward under ``torch.autocast`` over float32 weights; ``fsdp`` casts the
gathered parameters with FSDP2's ``MixedPrecisionPolicy``; ``deepspeed`` holds the parameters in
the low dtype and float32 master copies in the optimizer, and :func:`cast_floating_inputs` casts
the forward's floating-point inputs to that dtype (integer tensors such as token ids are left
alone), as Lightning does. That last way does not depend on autocast, which DeepSpeed turns off
inside its engine on CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["PRECISIONS", "Precision", "cast_floating", "cast_floating_inputs", "cast_parameters"]

PRECISIONS: dict[str, torch.dtype | None] = {
    "32": None,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}


@dataclass(frozen=True)
class Precision:
    """A ``--precision`` value: its name and the dtype it computes in (None for ``32``)."""

    name: str
    dtype: torch.dtype | None

    @classmethod
    def parse(cls, name: str) -> Precision:
        if name not in PRECISIONS:
            raise ValueError(f"precision {name!r} is not valid; choose one of: {', '.join(PRECISIONS)}")
        return cls(name, PRECISIONS[name])

    def autocast_forward(self, model: nn.Module, device_type: str) -> None:
        """Run ``model``'s forward under autocast of this dtype (the instance's forward only)."""
        dtype = self.dtype
        if dtype is None:
            return
        forward = model.forward

        @functools.wraps(forward)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type, dtype=dtype):
                return forward(*args, **kwargs)

        model.forward = autocast_forward


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype``, through tuples, lists and
    dicts; other tensors (integer ids, masks) and other objects are returned as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its type
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, Mapping):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def cast_floating_inputs(module: nn.Module, dtype: torch.dtype) -> RemovableHandle:
    """Cast the floating-point tensors among ``module``'s forward arguments to ``dtype`` on each call."""

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """``model``'s floating-point parameters to ``dtype`` in place, one at a time: each full-precision
    copy is freed as its cast is made, and optimizers keep referring to the same parameter objects.
    A BatchNorm's running statistics go too: beside bfloat16 weights the CPU's batch norm refuses
    float32 ones (``expected scalar type BFloat16 but found Float``). Other buffers keep their dtype,
    as DeepSpeed keeps them (RoPE's ``inv_freq`` must stay float32)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                for name in ("running_mean", "running_var"):
                    buffer = module._buffers.get(name)
                    if buffer is not None and buffer.dtype != dtype:
                        module._buffers[name] = buffer.to(dtype)
