"""``ddp``: DistributedDataParallel, one full model replica per rank, gradients all-reduced."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from jupyter_shard.strategies.base import StrategyBase

_DDP_OPTIONS = {"find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers"}


class DDPStrategy(StrategyBase):
    name = "ddp"

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - _DDP_OPTIONS
        if unknown:
            raise ValueError(
                f"unknown ddp option(s) {', '.join(sorted(unknown))}; "
                f"allowed: {', '.join(sorted(_DDP_OPTIONS))}"
            )
        self.options = options

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.options)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model
