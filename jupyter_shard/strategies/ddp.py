"""``ddp``: DistributedDataParallel, one full model replica per rank, gradients all-reduced."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from jupyter_shard.strategies.base import StrategyBase

_HOOKS = ("fp16", "bf16", "powersgd")


class DDPStrategy(StrategyBase):
    name = "ddp"
    accepts: ClassVar[frozenset[str]] = frozenset(
        {
            "find_unused_parameters",
            "static_graph",
            "gradient_as_bucket_view",
            "broadcast_buffers",
            "bucket_cap_mb",
            "comm_hook",
            "sync_batchnorm",
        }
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        hook = options.get("comm_hook")
        if hook is not None and hook not in _HOOKS:
            raise ValueError(f"ddp comm_hook {hook!r} is not valid; choose one of: {', '.join(_HOOKS)}")

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.ctx.device.type != "cuda":
            if self.options.get("sync_batchnorm"):
                raise ValueError(
                    "ddp sync_batchnorm needs CUDA ranks: torch's SyncBatchNorm runs on GPU modules only"
                )
            if self.options.get("comm_hook") == "bf16":
                raise ValueError(
                    "ddp comm_hook 'bf16' needs CUDA ranks with NCCL; on CPU use 'fp16' or 'powersgd'"
                )
        options = dict(self.options)
        hook = options.pop("comm_hook", None)
        if options.pop("sync_batchnorm", False):
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = super().wrap(model)
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **options)
        if hook is not None:
            _register_hook(ddp, hook)
        return ddp

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()


def _register_hook(ddp: DistributedDataParallel, hook: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
