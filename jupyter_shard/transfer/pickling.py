"""Values pickled with their bulk data kept apart: pickle protocol 5, out-of-band buffers.

Pushing or pulling a tensor used to mean cloudpickle copying its bytes into the pickle stream, the
stream into a message, and back out on the other side: four copies of a 1 GiB tensor at well under
1 GB/s. Here a value becomes a small *in-band* pickle (what objects to build: types, shapes, dtypes,
strides) and a list of *out-of-band* buffers that are views of the value's own memory, not copies
(:func:`dumps`). The buffers then travel however is fastest (a shared-memory segment between
processes on one machine, message frames otherwise: :mod:`jupyter_shard.transfer.segments`), and
:func:`loads` builds the value over the buffers it is given, again without a copy.

numpy arrays do this by themselves under protocol 5. A CPU tensor (or ``nn.Parameter``) is reduced
here to its storage's bytes plus size, stride and offset, so a transposed or zero-size tensor comes
back exactly as it was; a view of a much larger storage sends only its own elements. ``host=True``
brings device tensors to the CPU first (a pulled value must not create a CUDA context in the
notebook). A DTensor (an FSDP2 parameter, its gradient or optimizer state) is sent as this rank's
local shard, a plain tensor (:func:`_local_shard`): the kernel has no device mesh or process group to
rebuild a DTensor with, and the full tensor needs a collective of all ranks. Anything else (other
tensor subclasses, sparse or quantized tensors, plain Python objects) is pickled by cloudpickle as
before.

The in-band pickle decides what is built and is always authenticated with the pool key before it is
unpickled; out-of-band buffers are only ever raw element data of the arrays it describes.
"""

from __future__ import annotations

import bisect
import io
import itertools
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

__all__ = ["Assembly", "Packed", "dumps", "host_copy", "loads", "pieces"]

PROTOCOL = 5
_SPARSE_VIEW = 1.25  # send a view's own elements when its storage is this much larger than it


@dataclass
class Packed:
    """A pickled value: the in-band pickle and the out-of-band buffers it refers to, in order."""

    inband: bytes
    buffers: list[memoryview] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return [b.nbytes for b in self.buffers]

    @property
    def nbytes(self) -> int:
        return len(self.inband) + sum(self.sizes)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    def __init__(self, file: io.BytesIO, buffers: list[memoryview], host: bool) -> None:
        super().__init__(file, protocol=PROTOCOL, buffer_callback=self._keep)
        self._buffers = buffers
        self._host = host

    def _keep(self, buffer: pickle.PickleBuffer) -> None:
        self._buffers.append(buffer.raw())

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # no tensor exists where torch was never imported
        if torch is not None and isinstance(obj, torch.Tensor):
            local = _local_shard(torch, obj)
            reduced = _reduce_tensor(torch, obj if local is None else local, self._host)
            if reduced is not None:
                return reduced
            if local is not None:  # a shard kept on its device (or of a subclass): pickled as it is
                return _as_is, (local,)
        return super().reducer_override(obj)


def dumps(value: Any, host: bool = False) -> Packed:
    """``value`` as an in-band pickle and views of its bulk data; ``host``: device tensors are
    copied to the CPU (other objects are left as they are)."""
    out, buffers = io.BytesIO(), list[memoryview]()
    _Pickler(out, buffers, host).dump(value)
    return Packed(out.getvalue(), buffers)


def loads(inband: bytes, buffers: list[Any]) -> Any:
    """The value :func:`dumps` made, built over ``buffers`` (writable buffers: arrays and tensors
    made over them are writable and own no copy). Only call it on an authenticated ``inband``."""
    return pickle.loads(inband, buffers=buffers)


def _local_shard(torch: Any, tensor: Any) -> Any:
    """This rank's part of a DTensor as a plain tensor (a parameter stays a parameter, and
    ``requires_grad`` is kept), without autograd history; None for any other tensor."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported wherever a DTensor exists
    if dtensor is None or not isinstance(tensor, dtensor.DTensor):
        return None
    local = tensor.to_local().detach()
    if isinstance(tensor, torch.nn.Parameter):  # nn.Parameter(DTensor) is a DTensor marked as one
        return torch.nn.Parameter(local, requires_grad=tensor.requires_grad)
    return local.requires_grad_(tensor.requires_grad)


def _as_is(value: Any) -> Any:
    """What :func:`_local_shard` gave, rebuilt by its own pickling (see ``reducer_override``)."""
    return value


def _reduce_tensor(torch: Any, tensor: Any, host: bool) -> tuple[Any, ...] | None:
    """``(rebuild, args)`` for a plain strided tensor on the CPU (after ``host``), else None."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return None
    if tensor.device.type != "cpu":
        if not host or tensor.device.type == "meta":
            return None
        tensor = host_copy(tensor)
    if tensor.is_quantized or tensor.is_nested:
        return None
    parameter = isinstance(tensor, torch.nn.Parameter)
    requires_grad = tensor.requires_grad
    data = tensor.detach().resolve_conj().resolve_neg()
    storage = data.untyped_storage()
    if storage.nbytes() > _SPARSE_VIEW * max(data.nelement() * data.element_size(), 1):
        data = data.contiguous().clone() if data.is_contiguous() else data.contiguous()
        storage = data.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    args = (
        pickle.PickleBuffer(raw),
        str(data.dtype).removeprefix("torch."),
        tuple(data.size()),
        tuple(data.stride()),
        data.storage_offset(),
        requires_grad,
        parameter,
    )
    return _tensor, args


def host_copy(tensor: Any) -> Any:
    """A CPU copy of ``tensor`` without its autograd history; a parameter stays a parameter and
    ``requires_grad`` is kept, so a pulled module or optimizer state reads as it did on the rank
    (``detach()`` and ``cpu()`` alone give a plain tensor: a CUDA ``nn.Parameter`` came back as one)."""
    import torch

    copy = tensor.detach().cpu()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy.requires_grad_(tensor.requires_grad)


def _tensor(
    buffer: Any,
    dtype: str,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    requires_grad: bool,
    parameter: bool,
) -> Any:
    """A tensor over ``buffer`` (its storage's bytes), as :func:`_reduce_tensor` described it."""
    import torch

    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise pickle.UnpicklingError(f"not a torch dtype: {dtype!r}")
    view = memoryview(buffer)
    if view.nbytes:
        storage = torch.frombuffer(view.cast("B"), dtype=torch.uint8).untyped_storage()
    else:
        storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
    tensor = torch.empty(0, dtype=kind).set_(storage, offset, size, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def pieces(buffers: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """Views of ``length`` bytes from ``offset`` of ``buffers`` laid end to end (a transfer in parts)."""
    starts = [0, *itertools.accumulate(b.nbytes for b in buffers)]
    if offset < 0 or length < 0 or offset + length > starts[-1]:
        raise ValueError(f"bytes {offset}-{offset + length} are outside the {starts[-1]} of this value")
    out, end = [], offset + length
    for buffer, start in zip(buffers, starts, strict=False):
        lo, hi = max(offset, start), min(end, start + buffer.nbytes)
        if lo < hi:
            out.append(buffer.cast("B")[lo - start : hi - start])
    return out


class Assembly:
    """Buffers of the given sizes filled part by part, in order, from a transfer in parts."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.buffers = [bytearray(n) for n in sizes]
        self._starts = [0, *itertools.accumulate(sizes)]
        self.filled = 0

    @property
    def complete(self) -> bool:
        return self.filled == self._starts[-1]

    def add(self, offset: int, parts: Sequence[Any]) -> None:
        """Write ``parts`` end to end from ``offset``, which must be where the last part ended."""
        if offset != self.filled:
            raise ValueError(f"a part at byte {offset} came where byte {self.filled} was expected")
        for part in parts:
            view = memoryview(part).cast("B")
            if self.filled + view.nbytes > self._starts[-1]:
                raise ValueError("the parts hold more bytes than the value's sizes announced")
            done = 0
            while done < view.nbytes:
                i = bisect.bisect_right(self._starts, self.filled) - 1
                start = self.filled - self._starts[i]
                n = min(view.nbytes - done, len(self.buffers[i]) - start)
                self.buffers[i][start : start + n] = view[done : done + n]
                done += n
                self.filled += n
