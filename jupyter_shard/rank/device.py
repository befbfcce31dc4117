"""Which torch device and process-group backend a rank uses, and how values leave it.

One rule for pool ranks and exported scripts: a CUDA rank takes the GPU numbered by its local rank;
a CPU rank talks gloo. A CUDA rank's group is device-mapped, ``"cpu:gloo,cuda:nccl"``: NCCL for CUDA
tensors and gloo for CPU tensors, because CPU tensors take part in collectives on GPU ranks too
(FSDP's CPU-offloaded gradients in ``clip_grad_norm_``, a grad scaler's state, object collectives),
and an NCCL-only group rejects them. A rank whose GPU is not visible fails at start-up with a line
that says how many are.

A value pulled into the notebook leaves the rank on the CPU (:func:`jupyter_shard.transfer.pickling.dumps`
with ``host=True`` makes the one
:func:`~jupyter_shard.transfer.pickling.host_copy` of each device tensor): unpickling a CUDA tensor
in the kernel would create a CUDA context there (about 0.5 GiB per GPU, and an error where the
kernel cannot see that GPU).
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CUDA_BACKEND", "device_backends", "select_device", "tensor_bytes"]

CUDA_BACKEND = "cpu:gloo,cuda:nccl"
_HOST_TYPES = ("cpu", "meta")  # tensors that unpickle anywhere without a device


def select_device(rank: int, local_rank: int, device: str, hint: str = "") -> tuple[torch.device, str]:
    """``(device, backend)`` for this rank, the CUDA device made current; ``hint`` ends the error line."""
    if device != "cuda":
        return torch.device("cpu"), "gloo"
    visible = torch.cuda.device_count()
    if visible <= local_rank:
        raise RuntimeError(
            f"rank {rank} needs CUDA device {local_rank} but {visible} are visible"
            + (f"; {hint}" if hint else "")
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank), CUDA_BACKEND


def device_backends(backend: str) -> dict[str, str]:
    """Device type -> backend, as torch reads a backend string (``"nccl"`` covers CUDA only,
    ``"gloo"`` CPU and CUDA, ``"cpu:gloo,cuda:nccl"`` what it names); a ``ValueError`` for a list
    torch cannot read."""
    return dict(_read_backend(backend))


@functools.lru_cache(maxsize=32)
def _read_backend(backend: str) -> tuple[tuple[str, str], ...]:
    from torch.distributed.distributed_c10d import BackendConfig

    with warnings.catch_warnings():  # an unknown name: torch warns, and assumes CPU and CUDA
        warnings.simplefilter("ignore")
        pairs = BackendConfig(dist.Backend(backend)).get_device_backend_map().items()
    return tuple((str(device), str(name)) for device, name in pairs)


def tensor_bytes(value: Any, depth: int = 3) -> int:
    """The bytes of the tensors and arrays in ``value`` (a tensor, a module, an array, or containers
    of them ``depth`` levels down): what pickling it would at least write, known without pickling.
    A DTensor counts as its local shard, which is what is sent (:mod:`~jupyter_shard.transfer.pickling`)."""
    if isinstance(value, torch.Tensor):
        dtensor = sys.modules.get("torch.distributed.tensor")  # imported wherever a DTensor exists
        if dtensor is not None and isinstance(value, dtensor.DTensor):
            value = value.to_local()
        return 0 if value.is_meta else value.nelement() * value.element_size()
    if isinstance(value, torch.nn.Module):
        return sum(tensor_bytes(t) for t in (*value.parameters(), *value.buffers()))
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int) and type(value).__module__.startswith("numpy"):
        return nbytes
    if depth > 0 and isinstance(value, (list, tuple, set, frozenset)):
        return sum(tensor_bytes(v, depth - 1) for v in value)
    if depth > 0 and isinstance(value, dict):
        return sum(tensor_bytes(v, depth - 1) for v in value.values())
    return 0
