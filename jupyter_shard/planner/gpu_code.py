"""Code written for a GPU, traced on fake CPU tensors as the GPU would run it.

Why it exists: a plan is for the machine that will run it, often not this one, and the dry run's
fake tensors live on the CPU. Without this, a step under ``torch.autocast("cuda")`` on a machine
without CUDA is traced in float32 (torch turns the autocast off with a warning), and a builder that
ends in ``.cuda()``, ``.to(device)`` or ``.half()`` fails, since ``Module._apply`` swaps each fake
parameter for its copy and fake tensors refuse the swap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


class _CudaOnCpu(TorchFunctionMode):
    """Moves to CUDA become no-ops and CUDA factory devices become the CPU, where fake tensors live.

    A plan is for the machine that will run it, often not this one: a builder or forward that calls
    ``.cuda()``, ``.to("cuda")`` or makes tensors on ``torch.device("cuda")`` plans as written on a
    machine without CUDA, and on one with CUDA keeps every tensor where the trackers count it.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device:  # torch.device("cuda", 0), torch.device(type="cuda", index=0)
            kind = args[0] if args else kwargs.get("type")
            return _CPU if _cpu(kind) is _CPU else func(*args, **kwargs)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], int):
            args = (args[0], _CPU, *args[2:])  # x.to(0): a CUDA device by its index
        if isinstance(kwargs.get("device"), int):
            kwargs["device"] = _CPU
        args = tuple(_cpu(a) for a in args)
        kwargs = {k: _cpu(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _cpu(value: object) -> object:
    if isinstance(value, torch.device) and value.type == "cuda":
        return _CPU
    if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
        return _CPU
    return value


class _CpuAutocast(torch.autocast):
    """``torch.autocast("cuda", ...)`` as the CPU's autocast to the dtype CUDA's would use (float16
    unless the code names one), so that a GPU training step is traced in its own precision."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, **options: Any) -> None:
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype if dtype is not None else torch.float16
        super().__init__(device_type, dtype=dtype, **options)


@contextlib.contextmanager
def gpu_code_on_cpu() -> Iterator[None]:
    """Run code written for a GPU on fake CPU tensors as the GPU would run it (:class:`_CudaOnCpu`,
    :class:`_CpuAutocast`); ``torch.autocast`` is restored after."""
    saved = torch.autocast, torch.amp.autocast
    torch.autocast = torch.amp.autocast = _CpuAutocast  # type: ignore[misc,assignment]
    try:
        with _CudaOnCpu():
            yield
    finally:
        torch.autocast, torch.amp.autocast = saved  # type: ignore[misc]


@contextlib.contextmanager
def moves_in_place() -> Iterator[None]:
    """While a builder runs: ``Module.to``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.bfloat16()`` and
    ``.float()`` change dtypes in place and ignore devices (every tensor becomes a fake CPU one after
    the build). torch's own versions swap each fake parameter for its copy, which fake tensors refuse
    (``_apply(): Couldn't swap Linear.weight``), so a builder ending in ``.to(device)`` could not plan."""
    names = ("to", "cuda", "cpu", "half", "bfloat16", "float")
    saved = {name: getattr(nn.Module, name) for name in names}

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return _cast_in_place(self, dtype)

    def keep(self: nn.Module, device: object = None) -> nn.Module:
        return self

    def caster(dtype: torch.dtype) -> Callable[[nn.Module], nn.Module]:
        return lambda self: _cast_in_place(self, dtype)

    patches: dict[str, Any] = {"to": to, "cuda": keep, "cpu": keep, "half": caster(torch.float16)}
    patches |= {"bfloat16": caster(torch.bfloat16), "float": caster(torch.float32)}
    for name, patch in patches.items():
        setattr(nn.Module, name, patch)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(nn.Module, name, original)


def _cast_in_place(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Floating-point parameters and buffers of ``model`` in ``dtype``, tied ones kept tied."""
    if dtype is None:
        return model
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, tensor in list(table.items()):
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                if id(tensor) not in made:
                    cast = tensor.detach().to(dtype)
                    is_param = isinstance(tensor, nn.Parameter)
                    made[id(tensor)] = nn.Parameter(cast, tensor.requires_grad) if is_param else cast
                table[name] = made[id(tensor)]
    return model


#: CUDA's caching allocator rounds every block up to a multiple of this (torch's ``round_size``)
CUDA_BLOCK = 512


@contextlib.contextmanager
def cuda_blocks() -> Iterator[None]:
    """Count each tensor as the block CUDA's caching allocator gives it: its bytes rounded up to
    :data:`CUDA_BLOCK`. torch's ``MemTracker`` does so for CUDA tensors only, and the dry run's fake
    tensors are CPU ones. The allocator's segments (2 MiB for blocks up to 1 MiB, 20 MiB for blocks up
    to 10 MiB, larger ones rounded to 2 MiB), which ``max_memory_reserved`` counts, are not modelled."""
    from torch.distributed._tools import mem_tracker

    info = mem_tracker._WeakRefInfo
    original = info._calculate_mem_consumed

    def rounded(self: Any) -> int:
        size = int(self.size * self.element_size)
        return -(-size // CUDA_BLOCK) * CUDA_BLOCK

    info._calculate_mem_consumed = rounded  # type: ignore[method-assign]
    try:
        yield
    finally:
        info._calculate_mem_consumed = original  # type: ignore[method-assign]
