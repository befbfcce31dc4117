"""The strategy interface and ``none``: plain single-process training on each rank."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class StrategyBase:
    """Wraps a model for one rank; subclasses change only what differs."""

    name = "none"

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"strategy {self.name!r} takes no options, got: {', '.join(options)}")

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model.to(device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class NoStrategy(StrategyBase):
    name = "none"
