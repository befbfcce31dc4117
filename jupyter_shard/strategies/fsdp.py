"""``fsdp``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``); each rank keeps a shard.

Why it exists: DDP keeps a whole replica of parameters, gradients and optimizer state on every rank,
which caps the model at what one device holds. FSDP2 shards all three across ranks (parameters
become DTensors in place) and all-gathers a layer's parameters only while it runs. This module maps
the classic FSDP options onto FSDP2 and handles what in-place sharding changes for ``shard``: the
optimizer is rebuilt over the DTensor parameters, checkpoints are sharded directories written with
``torch.distributed.checkpoint``, and the full model is gathered on rank 0 only when asked.

``sharding`` (``--config`` JSON or :func:`register_strategy` defaults):

* ``FULL_SHARD``: shard over every rank; free gathered parameters after forward.
* ``SHARD_GRAD_OP``: as above, but keep gathered parameters from forward until backward.
* ``HYBRID_SHARD``: 2-D mesh (replicate, shard); shard within groups of ``shard_group_size`` ranks
  (default: ranks per node, ``LOCAL_WORLD_SIZE``), replicate across groups.
* ``NO_SHARD``: the same 2-D mesh with shard groups of one rank, so every rank is a full replica and
  gradients are all-reduced, while checkpoints and state dicts take the same DTensor paths.

Mixed precision is FSDP2's own ``MixedPrecisionPolicy`` (parameters cast for compute, gradients
reduced in float32); no autocast is added on top, since the cast parameters already run in low
precision and autocast would only add per-op casts.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from jupyter_shard.strategies.base import PRECISIONS, StrategyBase, StrategyContext, atomic_torch_save
from jupyter_shard.strategies.fsdp_units import (
    WRAPPED,
    check_named_units,
    class_name,
    default_units,
    split_sharers,
    unit_policies,
    without_forward,
)
from jupyter_shard.strategies.sharded_init import built_on_meta, materialise, meta_build, release_storage

SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
EXTRA_FILE = "extra.pt"
_WRAPPED = WRAPPED
_meshes: dict[tuple[str, tuple[int, ...]], DeviceMesh] = {}


class FSDPStrategy(StrategyBase):
    name = "fsdp"
    kind: ClassVar[str] = "FSDP2 fully_shard"
    accepts: ClassVar[frozenset[str]] = frozenset(
        {"sharding", "auto_wrap", "cpu_offload", "activation_checkpointing", "shard_group_size"}
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.sharding = str(options.get("sharding", "FULL_SHARD")).upper()
        if self.sharding not in SHARDING:
            raise ValueError(
                f"fsdp sharding {self.sharding!r} is not valid; choose one of: {', '.join(SHARDING)}"
            )
        auto = options.get("auto_wrap")
        if isinstance(auto, dict) and set(auto) == {"min_params"}:
            auto = auto["min_params"]
        self.wrap_classes = (
            _names(auto, "auto_wrap", ' or {"min_params": N}') if not isinstance(auto, int) else frozenset()
        )
        self.min_params = auto if isinstance(auto, int) and not isinstance(auto, bool) else None
        self.checkpoint_classes = _names(options.get("activation_checkpointing"), "activation_checkpointing")
        group = options.get("shard_group_size")
        if group is not None and (not isinstance(group, int) or group < 1):
            raise ValueError(
                f"fsdp shard_group_size {group!r} is not valid; give a whole number of ranks >= 1"
            )

    def __repr__(self) -> str:
        return f"<fsdp: {self.kind}, sharding={self.sharding}>"

    def setup(self, ctx: StrategyContext) -> None:
        super().setup(ctx)
        if ctx.extra.get("offload") == "nvme":
            raise ValueError("fsdp offloads to cpu only; --offload nvme needs --strategy deepspeed")
        self.cpu_offload = bool(self.options.get("cpu_offload", ctx.extra.get("offload") == "cpu"))
        if self.scaler is not None:
            # Each rank sees only its shard of the gradients: an inf in one shard must skip the step
            # (and back the scale off) on every rank. torch's scaler for sharded models all-reduces
            # what it found whatever the gradients' device (offloaded ones live on the CPU).
            self.scaler = _ShardedScaler(device=ctx.device.type)

    # -- preparing -----------------------------------------------------------------------------

    def mesh(self) -> DeviceMesh:
        """1-D over all ranks, or 2-D (replicate, shard) for HYBRID_SHARD and NO_SHARD; cached."""
        world = self.ctx.world_size
        if self.sharding in ("HYBRID_SHARD", "NO_SHARD"):
            default = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            size = 1 if self.sharding == "NO_SHARD" else int(self.options.get("shard_group_size") or default)
            if world % size:
                raise ValueError(f"fsdp shard_group_size {size} does not divide the world size {world}")
            shape: tuple[int, ...] = (world // size, size)
        else:
            shape = (world,)
        key = (self.ctx.device.type, shape)
        if key not in _meshes:
            names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
            _meshes[key] = init_device_mesh(self.ctx.device.type, shape, mesh_dim_names=names)
        return _meshes[key]

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Shard in place, then rebuild the optimizer over the DTensor parameters (matched by name)."""
        names = {id(p): _clean(n) for n, p in model.named_parameters()}
        wrapped = self.wrap(model)
        return wrapped, _rebuild(optimizer, names, wrapped) if optimizer is not None else None

    def init_module(self) -> contextlib.AbstractContextManager[torch.Tensor | None]:
        """On the meta device: ``prepare`` allocates and fills only this rank's shard."""
        return meta_build()

    def wrap(self, model: nn.Module) -> nn.Module:
        """``fully_shard`` unit by unit, children first; nothing whole is moved to the device.

        A model built normally gives each unit's full parameters up as soon as the unit is sharded
        (the caller's optimizer may still refer to them), so the rank never holds two copies. A model
        built under ``init_module`` is sharded on the meta device, then its shard is materialised.
        """
        on_meta = built_on_meta(model)
        if self.checkpoint_classes:
            apply_activation_checkpointing(
                model,
                checkpoint_wrapper_fn=partial(
                    checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
                ),
                check_fn=lambda m: type(m).__name__ in self.checkpoint_classes,
            )
        dtype = PRECISIONS[self.ctx.precision]
        offload = CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda")
        shard: Callable[..., Any] = partial(
            fully_shard,
            mesh=self.mesh(),
            reshard_after_forward=self.sharding in ("FULL_SHARD", "HYBRID_SHARD"),
            offload_policy=offload if self.cpu_offload else OffloadPolicy(),
        )
        names = {id(m): n for n, m in model.named_modules()}
        for module, policy in unit_policies(model, self._wrap_targets(model), dtype):
            whole = [p for p in module.parameters() if not isinstance(p, DTensor)]
            try:
                shard(module, mp_policy=policy)
            except (ValueError, AssertionError, RuntimeError) as exc:
                raise ValueError(_cannot_shard(names.get(id(module), "") or "the model", exc)) from exc
            if not on_meta:
                release_storage(whole)
        if on_meta:
            params_on = torch.device("cpu") if self.cpu_offload else self.ctx.device
            materialise(model, self.ctx.device, self.built_rng, params_on)
        return model

    def _wrap_targets(self, model: nn.Module) -> list[nn.Module]:
        """Submodules that get their own ``fully_shard`` (children before parents), root excluded.

        ``auto_wrap`` names classes or a parameter count; without it, :func:`default_units`.
        """
        if not self.wrap_classes and self.min_params is None:
            return default_units(model)
        if self.wrap_classes:
            check_named_units(model, self.wrap_classes)
        named = [(n, m) for n, m in model.named_modules() if n and not n.endswith(_WRAPPED[:-1])]
        targets: list[nn.Module] = []
        claimed: set[int] = set()
        barred = split_sharers(model)
        for _, module in reversed(named):
            if id(module) in barred or without_forward(module):
                continue
            if self.wrap_classes:
                if class_name(module) in self.wrap_classes:
                    targets.append(module)
            elif self.min_params is not None:
                free = [p for p in module.parameters() if id(p) not in claimed]
                if free and sum(p.numel() for p in free) >= self.min_params:
                    targets.append(module)
                    claimed.update(id(p) for p in free)
        return targets

    def apply_autocast(self, model: nn.Module) -> None:
        """Nothing: ``MixedPrecisionPolicy`` already runs forward and backward in low precision."""

    # -- training ------------------------------------------------------------------------------

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return _no_gradient_sync(model) if isinstance(model, FSDPModule) else contextlib.nullcontext()

    def clip_gradients(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip over the sharded gradients; returns the global norm as a plain tensor on every rank."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # -- state ---------------------------------------------------------------------------------

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]
    ) -> None:
        """A sharded DCP directory: every rank writes its shard into a sibling temporary directory,
        rank 0 adds ``extra.pt`` and swaps the directory into place; a crash leaves the old one."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.saving")

        def fresh() -> None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

        self._on_rank0(fresh, f"create {tmp}")
        dcp_save(_state(model, optimizer), checkpoint_id=tmp)
        self._on_rank0(lambda: atomic_torch_save(extra, tmp / EXTRA_FILE), f"write {tmp / EXTRA_FILE}")
        self._on_rank0(lambda: _swap(tmp, path), f"move the checkpoint into {path}")

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        path = _resolve(Path(path))
        state = _state(model, optimizer)
        dcp_load(state, checkpoint_id=path)
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(model, state["model"])
        extra: dict[str, Any] = torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=False)
        return extra

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """All-gathers every parameter (a collective: every rank calls it); CPU tensors on rank 0."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.ctx.rank != 0:
            return None
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def _on_rank0(self, action: Callable[[], None], what: str) -> None:
        """Run ``action`` on rank 0 and tell every rank whether it worked (so none waits forever)."""
        error: list[str | None] = [None]
        failure: BaseException | None = None
        if self.ctx.rank == 0:
            try:
                action()
            except Exception as exc:
                failure, error[0] = exc, f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(error, src=0)
        if failure is not None:
            raise failure
        if error[0] is not None:
            raise RuntimeError(f"fsdp save failed on rank 0 to {what}: {error[0]}")


class _ShardedScaler(ShardedGradScaler):
    """torch's scaler for sharded gradients, without the warning each unscale gives on DTensors
    (its found-inf flag is a one-element tensor, which DTensor treats as replicated: as meant)."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1", UserWarning)
            super().unscale_(optimizer)


@contextlib.contextmanager
def _no_gradient_sync(model: FSDPModule) -> Iterator[None]:
    """Accumulate unsharded gradients locally; reduce-scatter (and all-reduce) on the next sync."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _swap(tmp: Path, path: Path) -> None:
    """Put ``tmp`` at ``path``; the old checkpoint stays at ``.NAME.prev`` until the new one is there."""
    prev = path.with_name(f".{path.name}.prev")
    shutil.rmtree(prev, ignore_errors=True)
    if path.exists():
        os.replace(path, prev)
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(prev, ignore_errors=True)


def _resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint if a save died between its two renames."""
    prev = path.with_name(f".{path.name}.prev")
    if not path.exists() and prev.is_dir():
        return prev
    if not (path / EXTRA_FILE).is_file():
        raise FileNotFoundError(f"{path} is not an fsdp checkpoint directory (no {EXTRA_FILE} in it)")
    return path


def _rebuild(
    optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module
) -> torch.optim.Optimizer:
    """Same class and settings over the sharded parameters; names ignore checkpoint wrappers."""
    current = {_clean(n): p for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = [current.get(names.get(id(p), ""), p) for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    accepted = inspect.signature(type(optimizer)).parameters
    # AdamW's defaults hold ``decoupled_weight_decay``, which its constructor does not take
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)


def _cannot_shard(name: str, exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (
        f'fsdp cannot shard {name}: {text[:300]}; pass --config \'{{"auto_wrap": ["<layer class>"]}}\' '
        "naming the model's repeated layer class (on a freshly built model: this one is partly "
        "sharded), or use --strategy deepspeed"
    )


def _clean(name: str) -> str:
    return name.replace(_WRAPPED, "")


def _names(value: Any, option: str, alternative: str = "") -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"fsdp {option} {value!r} is not valid; give a list of module class names{alternative}"
        )
    return frozenset(value)
