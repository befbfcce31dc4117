"""Which torch device and process-group backend a rank uses: one rule for pool ranks and exported scripts.

A CUDA rank takes the GPU numbered by its local rank and talks NCCL; a CPU rank talks gloo. A rank
whose GPU is not visible fails at start-up with a line that says how many are.
"""

from __future__ import annotations

import torch

__all__ = ["select_device"]


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
    return torch.device("cuda", local_rank), "nccl"
