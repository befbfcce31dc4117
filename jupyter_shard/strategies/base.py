"""The strategy interface, shared helpers, and ``none``: plain single-process training on each rank.

A strategy decides how ``shard.prepare`` wraps a model and its optimizer, how ``backward`` and
``step`` run, how a checkpoint is written and read, and what "the full model" and "the bytes this
rank holds" mean. :class:`~jupyter_shard.rank.shard.Shard` owns what is common to every strategy:
gradient accumulation boundaries, the step counter, RNG state and logging.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from jupyter_shard.strategies.precision import PRECISIONS as PRECISIONS
from jupyter_shard.strategies.precision import Precision


@dataclass(frozen=True)
class StrategyContext:
    """Where the strategy runs and the options common to every strategy."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    precision: str = "32"
    accumulate: int = 1
    clip_grad_norm: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class StrategyBase:
    """Wraps a model for one rank; subclasses override what differs."""

    name: ClassVar[str] = "none"
    #: strategy-specific option names this strategy accepts (``--config`` keys, register defaults)
    accepts: ClassVar[frozenset[str]] = frozenset()
    #: whether ``--config FILE`` holds this strategy's options as JSON (DeepSpeed reads its own format)
    config_is_options: ClassVar[bool] = True

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - self.accepts
        if unknown:
            allowed = ", ".join(sorted(self.accepts)) or "none"
            raise ValueError(
                f"unknown {self.name} option(s) {', '.join(sorted(unknown))}; allowed: {allowed}"
            )
        self.options = options
        #: the CPU generator state when ``shard.init_module`` began (a model built there is filled from it)
        self.built_rng: torch.Tensor | None = None
        self._ctx: StrategyContext | None = None
        self.precision = Precision.parse("32")  # set from the context by setup()
        self.scaler: torch.amp.GradScaler | None = None

    @property
    def ctx(self) -> StrategyContext:
        if self._ctx is None:
            raise RuntimeError(f"strategy {self.name!r} used before setup()")
        return self._ctx

    def setup(self, ctx: StrategyContext) -> None:
        self.precision = Precision.parse(ctx.precision)
        self._ctx = ctx
        if ctx.precision == "16-mixed":
            self.scaler = torch.amp.GradScaler(ctx.device.type)

    # -- preparing -----------------------------------------------------------------------------

    def init_module(self) -> contextlib.AbstractContextManager[torch.Tensor | None]:
        """Where ``shard.init_module`` builds: straight on the rank's device (no copy there later).

        Sharding strategies build so that no rank holds the whole model; the context's value is the
        generator state the parameters are drawn from, where ``prepare`` draws them.
        """
        return _on_device(self.ctx.device)

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Wrap ``model``; rebuild ``optimizer`` over the wrapped parameters (same class, same settings)."""
        names = parameter_names(model)  # before wrapping: some wrappers replace parameters in place
        wrapped = self.wrap(model)
        new_optimizer = rebuild_optimizer(optimizer, names, self.unwrap(wrapped)) if optimizer else None
        self.apply_autocast(wrapped)
        return wrapped, new_optimizer

    def wrap(self, model: nn.Module) -> nn.Module:
        meta = [name for name, p in model.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(
                f"{self.name}: parameters {', '.join(meta[:3])}{' …' if len(meta) > 3 else ''} are on the "
                "meta device, and every rank needs the whole model under this strategy. Build the model "
                "with real tensors, or use --strategy fsdp (or deepspeed --zero-stage 3) to build it "
                "under shard.init_module()"
            )
        return model.to(self.ctx.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def apply_autocast(self, model: nn.Module) -> None:
        """Run the model's forward under autocast for mixed precision (the instance's forward only)."""
        self.precision.autocast_forward(model, self.ctx.device.type)

    # -- training ------------------------------------------------------------------------------

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Skip gradient synchronisation on micro-steps before an accumulation boundary."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: nn.Module) -> None:
        loss = loss / self.ctx.accumulate if self.ctx.accumulate > 1 else loss
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Clip (if asked), step and zero the gradients; called at accumulation boundaries only."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if self.ctx.clip_grad_norm is not None:
            self.clip_gradients(model, self.ctx.clip_grad_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    # -- state ---------------------------------------------------------------------------------

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]
    ) -> None:
        """One full checkpoint file written by rank 0, atomically (write, fsync, rename)."""
        state = {
            "model": self.unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            **extra,
        }
        if self.ctx.rank == 0:
            atomic_torch_save(state, path)
        dist.barrier()

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        state: dict[str, Any] = torch.load(path, map_location=self.ctx.device, weights_only=False)
        self.unwrap(model).load_state_dict(state.pop("model"))
        optimizer_state = state.pop("optimizer", None)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        return state

    @property
    def dcp_format(self) -> str:
        """What :meth:`dcp_state` writes; a checkpoint loads only into a strategy of the same format."""
        return "torch"

    def dcp_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """The model's and optimizer's state as ``torch.distributed.checkpoint`` saves and loads it.

        Keyed by parameter name, the same at every world size, with DTensors where the strategy
        shards (so DCP reshards on load); every rank calls it. ``load_dcp_state`` puts a state that
        DCP loaded in place into this same dict back into the model and optimizer.
        """
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_dcp_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
    ) -> None:
        """Put back what DCP loaded into the dict :meth:`dcp_state` returned (collective)."""
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state on rank 0 (CPU tensors); None on other ranks."""
        if self.ctx.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def memory(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        return local_bytes(model, optimizer)


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[torch.Tensor | None]:
    with device:
        yield None


class NoStrategy(StrategyBase):
    name = "none"


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``, taken before a wrapper can replace the parameters."""
    return {id(p): name for name, p in model.named_parameters()}


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, str], wrapped: nn.Module
) -> torch.optim.Optimizer:
    """Same optimizer class and hyperparameters, over the wrapped model's parameters.

    Parameters are matched by the names they had before wrapping (``names``, from
    :func:`parameter_names`), so this works whether the wrapper kept the original parameter objects
    (DDP) or replaced them with sharded ones (FSDP2). Only the ``defaults`` the optimizer's
    constructor accepts are passed back (some optimizers record extra keys there).
    """
    by_id = names
    new_params = dict(wrapped.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = by_id.get(id(p))
            params.append(new_params[name] if name is not None and name in new_params else p)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    accepted = inspect.signature(type(optimizer)).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    return type(optimizer)(groups, **defaults)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local: Callable[[], torch.Tensor] | None = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _nbytes(tensors: Iterator[torch.Tensor]) -> int:
    total = 0
    seen: set[tuple[int, int, int]] = set()
    for t in tensors:
        local = _local(t)
        if local.numel() == 0:
            continue
        # One count per distinct tensor view: flattened buffers (ZeRO) hold many parameters at offsets.
        ptr = local.untyped_storage().data_ptr() if local.device.type != "meta" else id(local)
        key = (ptr, int(local.storage_offset()), local.numel())
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def local_bytes(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes as held by this rank (shards, not full tensors)."""
    params = list(model.parameters()) if model is not None else []
    state_tensors: list[torch.Tensor] = []
    if optimizer is not None:
        for state in optimizer.state.values():
            state_tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {
        "parameters": _nbytes(iter(params)),
        "gradients": _nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": _nbytes(iter(state_tensors)),
    }


def atomic_torch_save(state: Any, path: Path) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename: a crash leaves the old file."""
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
