"""``shard``: the helper every rank's namespace has (also ``from jupyter_shard import shard``).

It knows the rank's place in the world and the pool's strategy, and turns single-process training
code into distributed code: ``prepare`` wraps the model, rebuilds the optimizer over the wrapped
parameters and gives dataloaders a DistributedSampler; ``log`` sends scalars to the kernel.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from jupyter_shard.strategies import create_strategy
from jupyter_shard.strategies.base import StrategyBase

Sender = Callable[[str, dict[str, Any], list[bytes]], None]


class Shard:
    def __init__(
        self,
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
        strategy: str,
        send: Sender,
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.device = device
        self.strategy = strategy
        self.is_main = rank == 0
        self._send = send
        self._impl: StrategyBase | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._step = 0
        self._log_count = 0
        self._metrics: list[dict[str, Any]] = []
        self._metrics_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<shard rank {self.rank}/{self.world_size} local_rank {self.local_rank} "
            f"device {self.device} strategy {self.strategy}>"
        )

    @property
    def impl(self) -> StrategyBase:
        if self._impl is None:
            self._impl = create_strategy(self.strategy)
        return self._impl

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *dataloaders: DataLoader[Any]
    ) -> Any:
        """Wrap ``model`` for the strategy; returns ``model`` or ``(model, optimizer, *loaders)``."""
        wrapped = self.impl.wrap(model, self.device)
        self._model = wrapped
        new_optimizer = _rebuild_optimizer(optimizer, model, self.impl.unwrap(wrapped)) if optimizer else None
        self._optimizer = new_optimizer
        loaders = [self._distribute(loader) for loader in dataloaders]
        if optimizer is None and not loaders:
            return wrapped
        return (wrapped, new_optimizer, *loaders)

    def _distribute(self, loader: DataLoader[Any]) -> DataLoader[Any]:
        sampler: DistributedSampler[Any] = DistributedSampler(
            loader.dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
        )
        return DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        )

    def backward(self, loss: torch.Tensor) -> None:
        self.impl.backward(loss)

    def step(self) -> None:
        """Optimizer step and zero_grad on the prepared optimizer."""
        if self._optimizer is None:
            raise RuntimeError("shard.step() needs an optimizer: call shard.prepare(model, optimizer) first")
        self.impl.step(self._optimizer)
        self._step += 1

    def log(self, step: int | None = None, **scalars: float | torch.Tensor) -> None:
        """Send scalars (numbers or one-element tensors) to the kernel's dashboard and history."""
        values: dict[str, float] = {}
        for name, value in scalars.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"shard.log({name}=...) needs a scalar, got a tensor of shape {tuple(value.shape)}"
                    )
                values[name] = float(value.detach().item())
            else:
                values[name] = float(value)
        self._log_count += 1
        record = {"step": self._log_count if step is None else int(step), "values": values, "ts": time.time()}
        with self._metrics_lock:
            self._metrics.append(record)

    def flush_metrics(self) -> None:
        with self._metrics_lock:
            if not self._metrics:
                return
            records, self._metrics = self._metrics, []
        self._send("metrics", {"rank": self.rank, "records": records}, [])

    def memory(self) -> dict[str, int]:
        """Bytes: ``rss`` always; ``cuda_allocated``/``cuda_reserved``/``cuda_peak`` on a GPU."""
        return memory_report(self.device)

    def barrier(self) -> None:
        dist.barrier()

    def print0(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main:
            print(*args, **kwargs)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer, step and every rank's RNG state to one file, atomically."""
        model = self._require_model("save")
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        all_rng: list[Any] = [None] * self.world_size
        dist.all_gather_object(all_rng, rng)
        if self.is_main:
            state = {
                "model": self.impl.unwrap(model).state_dict(),
                "optimizer": self._optimizer.state_dict() if self._optimizer else None,
                "step": self._step,
                "rng": all_rng,
                "world_size": self.world_size,
                "strategy": self.strategy,
            }
            _atomic_save(state, Path(path))
        dist.barrier()

    def load(self, path: str | os.PathLike[str]) -> None:
        model = self._require_model("load")
        state = torch.load(Path(path), map_location=self.device, weights_only=False)
        self.impl.unwrap(model).load_state_dict(state["model"])
        if self._optimizer is not None and state.get("optimizer") is not None:
            self._optimizer.load_state_dict(state["optimizer"])
        self._step = int(state.get("step", 0))
        rngs = state.get("rng") or []
        if len(rngs) == self.world_size:
            mine = rngs[self.rank]
            torch.set_rng_state(mine["torch"].cpu())
            random.setstate(mine["python"])
            if "cuda" in mine and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)
        dist.barrier()

    def _require_model(self, what: str) -> nn.Module:
        if self._model is None:
            raise RuntimeError(f"shard.{what}() needs a prepared model: call shard.prepare(model, ...) first")
        return self._model


def _rebuild_optimizer(
    optimizer: torch.optim.Optimizer, original: nn.Module, wrapped: nn.Module
) -> torch.optim.Optimizer:
    """Same optimizer class and hyperparameters, over the wrapped model's parameters."""
    by_id = {id(p): name for name, p in original.named_parameters()}
    new_params = dict(wrapped.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = by_id.get(id(p))
            params.append(new_params[name] if name is not None and name in new_params else p)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return type(optimizer)(groups, **optimizer.defaults)


def _atomic_save(state: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def memory_report(device: torch.device | None = None) -> dict[str, int]:
    report = {"rss": _rss()}
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        report["cuda_allocated"] = torch.cuda.memory_allocated(device)
        report["cuda_reserved"] = torch.cuda.memory_reserved(device)
        report["cuda_peak"] = torch.cuda.max_memory_allocated(device)
    return report


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


_current: Shard | None = None


def set_current(helper: Shard) -> None:
    global _current
    _current = helper


def current() -> Shard | None:
    """This rank's ``shard``, or None outside a rank process."""
    return _current
