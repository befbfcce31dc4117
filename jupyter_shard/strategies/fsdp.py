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
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
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
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from jupyter_shard.strategies.base import PRECISIONS, StrategyBase, StrategyContext, atomic_torch_save
from jupyter_shard.strategies.sharded_init import built_on_meta, materialise, meta_build, release_storage

SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
EXTRA_FILE = "extra.pt"
_WRAPPED = "_checkpoint_wrapped_module."
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
            _check_named_units(model, self.wrap_classes)
        named = [(n, m) for n, m in model.named_modules() if n and not n.endswith(_WRAPPED[:-1])]
        targets: list[nn.Module] = []
        claimed: set[int] = set()
        barred = _split_sharers(model)
        for _, module in reversed(named):
            if id(module) in barred or _without_forward(module):
                continue
            if self.wrap_classes:
                if _class_name(module) in self.wrap_classes:
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


SPLIT_ABOVE = 1 << 20  # parameters: a smaller model stays one unit (one all-gather per step is cheaper)
#: modules that hold others but never run themselves: FSDP2 refuses them as units, and their hooks
#: would never fire
_NO_FORWARD = (nn.ModuleList, nn.ModuleDict)
#: instances of a stacked class this many times apart in size are stages, not blocks
UNEVEN = 3


def default_units(model: nn.Module) -> list[nn.Module]:
    """One FSDP unit per repeated block, and one per other large module; children before parents.

    The block is the repeated layer of the model's stack: of the classes with two or more instances
    that hold other modules and stand side by side in a ``ModuleList`` or ``Sequential`` (a
    transformer's layer, a ResNet's block, not its ``Linear`` or its two ``T5Stack``s), the one whose
    instances hold the most parameters. Without such a class, the coarsest class with two or more
    instances that together hold a third of the parameters (a stack of ``Linear``). The rest of the
    model's modules get a unit of their own when they hold at least as many parameters as an average
    block (an embedding, an output head), so that no unit, the root included, is much bigger than a
    block. A model under :data:`SPLIT_ABOVE` parameters stays one unit.

    A parameter shared between modules (tied input and output embeddings, T5's shared table) belongs
    to the smallest module that holds every module using it, as FSDP2 requires: no module that holds
    only some of its users becomes a unit, so a tied embedding is left to the root. A module without
    a ``forward`` of its own (``ModuleList``, ``ModuleDict``) is never a unit.
    """
    total = sum(p.numel() for p in model.parameters())
    if total < SPLIT_ABOVE:
        return []
    named = [(n, m) for n, m in model.named_modules() if n and not n.endswith(_WRAPPED[:-1])]
    barred = _split_sharers(model)
    able = [(n, m) for n, m in named if id(m) not in barred and not _without_forward(m)]
    blocks = _blocks(able, _listed(named), total)
    chosen = {id(m) for m in blocks}
    claimed = {id(p) for m in blocks for p in m.parameters()}
    in_blocks = sum(p.numel() for m in blocks for p in m.parameters())
    threshold = in_blocks // len(blocks) if blocks else total // 8  # an average block
    targets: list[nn.Module] = []
    for _, module in reversed(able):
        if id(module) in chosen:
            targets.append(module)
            continue
        free = [p for p in module.parameters() if id(p) not in claimed]
        if free and sum(p.numel() for p in free) >= threshold:
            targets.append(module)
            claimed.update(id(p) for p in free)
    return targets


def unit_policies(
    model: nn.Module, targets: list[nn.Module], dtype: torch.dtype | None
) -> list[tuple[nn.Module, MixedPrecisionPolicy]]:
    """Every module ``fully_shard`` is called on, children first and the root last, with its mixed
    precision policy: ``targets`` and the root compute in ``dtype`` and reduce in float32; under a
    low ``dtype`` each of :func:`fp32_units` is a unit first that keeps float32."""
    low = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=dtype)
    fp32 = [m for m in fp32_units(model) if m is not model] if dtype is not None else []
    kept = {id(m) for m in fp32}
    return [(m, keep) for m in fp32] + [(m, low) for m in [*targets, model] if id(m) not in kept]


def fp32_units(model: nn.Module) -> list[nn.Module]:
    """The modules that keep float32 parameters under a low ``--precision``, each its own FSDP unit:
    batch norms, whose running statistics stay float32 and which CPU kernels refuse to mix with
    bfloat16 parameters (``expected scalar type BFloat16 but found Float``). Their unit computes in
    float32 and hands its output on in the low dtype."""
    norms: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return norms[::-1]


def unit_problem(model: nn.Module, module: nn.Module, name: str) -> str | None:
    """Why ``module`` (called ``name`` in ``model``) cannot be an FSDP unit of its own, or None."""
    if _without_forward(module):
        return f"{name} is a {type(module).__name__}, which has no forward of its own"
    if id(module) in _split_sharers(model):
        return f"{name} shares a parameter with a module outside it (tied weights)"
    return None


def _check_named_units(model: nn.Module, classes: frozenset[str]) -> None:
    """One line for an ``auto_wrap`` class that cannot be a unit: no forward, or a split tied weight."""
    for name, module in model.named_modules():
        if name and _class_name(module) in classes:
            problem = unit_problem(model, module, name)
            if problem is not None:
                raise ValueError(
                    f"fsdp auto_wrap names {_class_name(module)}, but {problem}; name the class of the "
                    "model's repeated layer instead, or leave auto_wrap out"
                )


def _cannot_shard(name: str, exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (
        f'fsdp cannot shard {name}: {text[:300]}; pass --config \'{{"auto_wrap": ["<layer class>"]}}\' '
        "naming the model's repeated layer class, or use --strategy deepspeed"
    )


def _blocks(able: list[tuple[str, nn.Module]], parents: set[int], total: int) -> list[nn.Module]:
    """The repeated block's instances (see :func:`default_units`), or none; ``parents`` are the
    modules that stand in a list beside others of their class (:func:`_listed`)."""
    by_class = _outermost_by_class(able)
    stacked = {
        kind: instances
        for kind, instances in by_class.items()
        if sum(id(m) in parents for m in instances) >= 2 and any(True for _ in instances[0].children())
    }
    if stacked:
        blocks = _most_covering(stacked.values())
        sizes = [_size(m) for m in blocks]
        if max(sizes) > UNEVEN * max(min(sizes), 1):
            # stages of uneven width, each a stack of blocks (a ResNet): the blocks inside them
            inside = {id(m) for b in blocks for m in b.modules() if m is not b}
            inner = [ms for ms in stacked.values() if all(id(m) in inside for m in ms)]
            blocks = _most_covering(inner) if inner else blocks
        return blocks
    blocks = []
    for instances in by_class.values():
        covered = sum(_size(m) for m in instances)
        if len(instances) >= 2 and 3 * covered >= total and (not blocks or len(instances) < len(blocks)):
            blocks = instances
    return blocks


def _most_covering(groups: Iterable[list[nn.Module]]) -> list[nn.Module]:
    """The group whose modules hold the most parameters; of equals, the one with fewer modules."""
    return max(groups, key=lambda ms: (sum(_size(m) for m in ms), -len(ms)))


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _listed(named: list[tuple[str, nn.Module]]) -> set[int]:
    """Modules that stand in a ``ModuleList`` or ``Sequential`` beside another of their class."""
    found: set[int] = set()
    for _, module in named:
        if isinstance(module, nn.ModuleList | nn.Sequential):
            kids = list(module.children())
            kinds = [_class_name(k) for k in kids]
            found.update(id(k) for k, kind in zip(kids, kinds, strict=True) if kinds.count(kind) >= 2)
    return found


def _split_sharers(model: nn.Module) -> set[int]:
    """Modules that hold some but not all of the modules using a shared parameter (by identity)."""
    paths: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(name.rsplit(".", 1)[0] if "." in name else "")
    barred_names: set[str] = set()
    for owners in paths.values():
        if len(set(owners)) < 2:
            continue
        common = _common_prefix([o.split(".") if o else [] for o in owners])
        for owner in owners:
            parts = owner.split(".") if owner else []
            for depth in range(len(common) + 1, len(parts) + 1):
                barred_names.add(".".join(parts[:depth]))
    if not barred_names:
        return set()
    return {id(m) for n, m in model.named_modules(remove_duplicate=False) if n in barred_names}


def _common_prefix(paths: list[list[str]]) -> list[str]:
    common = paths[0]
    for path in paths[1:]:
        size = 0
        while size < min(len(common), len(path)) and common[size] == path[size]:
            size += 1
        common = common[:size]
    return common


def _without_forward(module: nn.Module) -> bool:
    inner = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
    return isinstance(inner, _NO_FORWARD) or type(inner).forward is nn.Module.forward


def _outermost_by_class(named: list[tuple[str, nn.Module]]) -> dict[str, list[nn.Module]]:
    """Instances of each module class (by name) that are not inside another instance of that class."""
    found: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in named:
        if not any(True for _ in module.parameters()):
            continue
        kind = _class_name(module)
        seen = found.setdefault(kind, [])
        if not any(name.startswith(outer + ".") for outer, _ in seen):
            seen.append((name, module))
    return {kind: [m for _, m in pairs] for kind, pairs in found.items()}


def _clean(name: str) -> str:
    return name.replace(_WRAPPED, "")


def _class_name(module: nn.Module) -> str:
    inner = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
    return type(inner).__name__


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
