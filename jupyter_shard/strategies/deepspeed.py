"""``deepspeed``: the DeepSpeed engine with ZeRO stages 0–3, CPU/NVMe offload and its own checkpoints.

The pool's options become a DeepSpeed config: ``--zero-stage`` (default 0: plain data parallel),
``--offload cpu|nvme`` (optimizer state for stage ≥ 1, parameters too at stage 3), ``--precision``
(``bf16-mixed`` → ``bf16``, ``16-mixed`` → ``fp16`` with dynamic loss scaling), ``accumulate``
(``gradient_accumulation_steps``) and ``clip_grad_norm`` (``gradient_clipping``). ``--config ds.json``
is merged under them; a value set on both sides that differs is an error naming both.

``--precision`` means what it means in Lightning's DeepSpeed strategy, on CPU and CUDA alike: after
``shard.prepare`` the parameters are in the engine's dtype at every ZeRO stage (the optimizer keeps
fp32 masters), and each forward casts its floating-point inputs to it (integer tensors untouched).
No autocast: DeepSpeed turns a caller's autocast off inside the engine on CUDA only (it asks
``torch.is_autocast_enabled()``, which sees CUDA), and it casts no parameter that
``zero.Init(module=...)`` partitioned, so both are done here. A ``--config`` enabling ``bf16``,
``fp16`` or ``torch_autocast`` itself is followed as written.

The engine owns backward and the step: :meth:`backward` calls ``engine.backward`` (which divides by
the accumulation count) on every micro-step and advances the engine's micro-step counter before an
accumulation boundary, so the engine's boundaries are the ones ``shard.step()`` sees.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from jupyter_shard.strategies import deepspeed_dcp
from jupyter_shard.strategies.base import StrategyBase, parameter_names, rebuild_optimizer
from jupyter_shard.strategies.deepspeed_builds import guard_builds
from jupyter_shard.strategies.deepspeed_config import build_config, fit_stage3_buffers, parameter_dtype
from jupyter_shard.strategies.precision import cast_floating_inputs, cast_parameters

_TORCH_ONLY = {"foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}
EXTENSIONS_DIR = Path.home() / ".cache" / "jupyter_shard" / "torch_extensions"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def deepspeed_environment(device_type: str) -> None:
    """CPU accelerator on CPU ranks, and one persistent build cache for DeepSpeed's compiled ops.

    Set before DeepSpeed is first imported, by this strategy or by a framework that uses it
    (Lightning, Accelerate, the Hugging Face Trainer), so every user of a pool shares the builds
    (each guarded by :func:`~jupyter_shard.strategies.deepspeed_builds.guard_builds`, which a rank
    installs as torch's extension builder is imported).
    """
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))


def import_deepspeed(device: torch.device) -> Any:
    """Import deepspeed for ``device`` (see :func:`deepspeed_environment`), its op builds guarded."""
    deepspeed_environment(device.type)
    guard_builds()
    import deepspeed

    return deepspeed


class DeepSpeedStrategy(StrategyBase):
    name = "deepspeed"
    accepts: ClassVar[frozenset[str]] = frozenset(
        {
            "reduce_bucket_size",
            "allgather_bucket_size",
            "overlap_comm",
            "contiguous_gradients",
            "activation_checkpointing",
        }
    )
    config_is_options = False

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.config: dict[str, Any] = {}

    def _configure(self) -> dict[str, Any]:
        extra = self.ctx.extra
        return build_config(
            self.ctx,
            zero_stage=extra.get("zero_stage"),
            offload=str(extra.get("offload") or "none"),
            config_path=extra.get("config"),
            options=self.options,
        )

    def init_module(self) -> contextlib.AbstractContextManager[torch.Tensor | None]:
        """ZeRO-3: ``deepspeed.zero.Init`` partitions each layer as its constructor returns, so no
        rank holds the whole model; below stage 3 every rank keeps all of it, built on its device."""
        self.config = self._configure()
        if self.stage != 3:
            return super().init_module()
        ds = import_deepspeed(self.ctx.device)
        ds.init_distributed(dist_backend=self._backend(), auto_mpi_discovery=False)
        init: contextlib.AbstractContextManager[Any] = ds.zero.Init(config_dict_or_path=self.config)
        return _yielding_none(init)

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        self.config = self._configure()
        if optimizer is not None and "optimizer" in self.config:
            warnings.warn(
                "the optimizer section of the DeepSpeed config is used; the optimizer passed to "
                "shard.prepare is ignored",
                stacklevel=3,
            )
            optimizer = None
        ds = import_deepspeed(self.ctx.device)
        ds.init_distributed(dist_backend=self._backend(), auto_mpi_discovery=False)
        if "activation_checkpointing" in self.config:
            ds.checkpointing.configure(None, deepspeed_config=self.config)
        checkpointed = self.config.pop("checkpoint_modules", None) or self.options.get(
            "activation_checkpointing"
        )
        if checkpointed:
            _checkpoint_modules(model, {str(name) for name in checkpointed})
        name = parameter_dtype(self.config)
        dtype = _DTYPES[name] if name else None
        if _partitioned(model):
            _check_partitioned_dtype(model, dtype)
        elif dtype is not None:
            # Before anything moves them. zero.Init below keeps each parameter's dtype, and the engine
            # casts only models it partitions itself; below ZeRO-3 the device gets the small copy.
            cast_parameters(model, dtype)
        if self.stage == 3:
            if not _partitioned(model):
                # Partitioned parameter by parameter, each full copy freed as it goes: the whole model
                # never reaches the device, and the rank never holds it twice. (Also the dtype: the
                # engine's own conversion on a CPU device picks bf16 for NVMe swap buffers whatever
                # the config says, DeepSpeed 0.19.)
                ds.zero.Init(module=model, config_dict_or_path=self.config)
            fit_stage3_buffers(
                self.config, max(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
            )
        else:
            model = super().wrap(model)
        client_optimizer = _engine_optimizer(optimizer, model, self.config) if optimizer else None
        engine, engine_optimizer, _, _ = ds.initialize(
            model=model,
            optimizer=client_optimizer,
            model_parameters=None if client_optimizer else [p for p in model.parameters() if p.requires_grad],
            config=self.config,
            dist_init_required=False,
        )
        if dtype is not None:
            cast_floating_inputs(engine, dtype)
        return engine, engine_optimizer

    def _backend(self) -> str:
        """The backend DeepSpeed records for the pool's group (which exists already): its plain name,
        not the device-mapped ``cpu:gloo,cuda:nccl`` a CUDA pool's group reports."""
        return "nccl" if self.ctx.device.type == "cuda" else "gloo"

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    def unwrap(self, model: nn.Module) -> nn.Module:
        module: nn.Module = getattr(model, "module", model)
        return module

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the engine decides when gradients are reduced

    def backward(self, loss: torch.Tensor, model: nn.Module) -> None:
        engine: Any = model
        engine.backward(loss)
        # shard.step() reaches step() only at boundaries; the engine must still count micro-steps.
        if self.ctx.accumulate > 1 and not engine.is_gradient_accumulation_boundary():
            engine.step()

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        engine: Any = model
        engine.step()  # clips, unscales, steps and zeroes gradients at the engine's boundary

    def clip_gradients(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        raise RuntimeError(
            "deepspeed clips inside engine.step(): set clip_grad_norm (gradient_clipping) instead"
        )

    # -- state ---------------------------------------------------------------------------------

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]
    ) -> None:
        """DeepSpeed's sharded checkpoint in directory ``path``: a temporary tag, renamed, then ``latest``."""
        engine: Any = model
        tag = f"step{extra.get('step', 0)}"
        tmp_tag = f".tmp-{tag}"
        if self.ctx.rank == 0:
            shutil.rmtree(path / tmp_tag, ignore_errors=True)
        dist.barrier()
        engine.save_checkpoint(str(path), tag=tmp_tag, client_state=dict(extra), save_latest=False)
        dist.barrier()
        if self.ctx.rank == 0:
            final, old = path / tag, path / f".old-{tag}"
            if final.exists():
                final.rename(old)
            (path / tmp_tag).rename(final)
            shutil.rmtree(old, ignore_errors=True)
            latest_tmp = path / ".latest.tmp"
            with open(latest_tmp, "w") as fh:
                fh.write(tag)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(latest_tmp, path / "latest")
        dist.barrier()

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        engine: Any = model
        if not (path / "latest").is_file():
            raise FileNotFoundError(f"{path} is not a deepspeed checkpoint directory (no 'latest' file)")
        load_path, client_state = engine.load_checkpoint(
            str(path), load_optimizer_states=optimizer is not None, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise RuntimeError(f"deepspeed could not load a checkpoint from {path}")
        return dict(client_state or {})

    @property
    def dcp_format(self) -> str:
        """ZeRO-3 writes partitions, the stages below whole masters: each stage reads its own."""
        return f"deepspeed-zero{self.stage}"

    def dcp_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """By parameter name: ZeRO-3's partitions as DTensors, whole fp32 masters below (deepspeed_dcp)."""
        return deepspeed_dcp.dcp_state(model, optimizer, self.stage, self.ctx.device)

    def load_dcp_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
    ) -> None:
        deepspeed_dcp.load_dcp_state(model, optimizer, state, self.stage)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """fp32 weights on rank 0: the optimizer's master copies where ZeRO keeps them (collective).

        One tensor at a time, each copied to the CPU before the next is assembled: ZeRO-3 gathers a
        single parameter with ``GatheredParameters`` (or its fp32 master), so the device holds at
        most one full parameter beyond this rank's partitions, whatever the model's size.
        """
        ds = import_deepspeed(self.ctx.device)
        unfused = _unfused_masters(getattr(model, "optimizer", None))
        keep = self.ctx.rank == 0
        copies: dict[int, torch.Tensor | None] = {}
        state: dict[str, torch.Tensor] = {}
        for key, value in self.unwrap(model).state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                state[key] = value  # a module's extra state
                continue
            if id(value) not in copies:  # tied parameters are assembled once
                copies[id(value)] = _full_copy(ds, value, unfused.get(id(value)), keep)
            copy = copies[id(value)]
            if copy is not None:
                state[key] = copy
        return state if keep else None

    def memory(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes held here: parameters (ZeRO-3: this rank's partition), gradients, and optimizer state
        (ZeRO ≥ 1: the fp32 master partition plus the inner optimizer's state over it)."""
        module = self.unwrap(model) if model is not None else None
        params = list(module.parameters()) if module is not None else []
        if self.stage == 3:
            params = [getattr(p, "ds_tensor", p) for p in params]
        masters: list[torch.Tensor] = list(
            getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
            or getattr(optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3
            or list(_unfused_masters(optimizer).values())  # bf16/fp16 without ZeRO
        )
        inner = getattr(optimizer, "optimizer", optimizer)
        state = [
            v
            for per_param in (inner.state.values() if inner is not None else [])
            for v in per_param.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        grads = [t.grad for t in [*params, *masters] if t.grad is not None]
        grads += _zero_gradient_partitions(optimizer)
        return {
            "parameters": _bytes(params, set()),
            "gradients": _bytes(grads, set()),
            "optimizer": _bytes([*masters, *state], set()),
        }


@contextlib.contextmanager
def _yielding_none(inner: contextlib.AbstractContextManager[Any]) -> Any:
    with inner:
        yield None


def _partitioned(model: nn.Module) -> bool:
    """Built under ``zero.Init`` (``shard.init_module`` at stage 3): parameters carry ``ds_id``."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _checkpoint_modules(model: nn.Module, class_names: set[str]) -> None:
    """Recompute the activations of modules of these classes in backward instead of keeping them.

    The wrappers keep the same parameter objects, so an optimizer built on the model still applies.
    """
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    found = {type(m).__name__ for m in model.modules()} & class_names
    if not found:
        raise ValueError(
            f"activation checkpointing: no module of class {', '.join(sorted(class_names))} in the model"
        )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: type(m).__name__ in class_names,
    )


def _zero_gradient_partitions(optimizer: Any) -> list[torch.Tensor]:
    """This rank's reduced gradient partitions, which ZeRO keeps outside ``param.grad``."""
    found: list[torch.Tensor] = []
    averaged = getattr(optimizer, "averaged_gradients", None)  # ZeRO-1/2, between backward and step
    if isinstance(averaged, dict):
        for grads in averaged.values():
            found.extend(g for g in (grads or []) if isinstance(g, torch.Tensor))
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)  # ZeRO-3
    if isinstance(flat, torch.Tensor):
        found.append(flat)
    return found


def _bytes(tensors: Sequence[torch.Tensor], seen: set[tuple[int, int, int]]) -> int:
    """Bytes of ``tensors`` not already counted: overlapping views of one buffer (ZeRO's flat
    partitions and the per-parameter views into them) count once. ``seen`` holds counted
    ``(storage, start, end)`` byte ranges across calls."""
    total = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        storage = t.untyped_storage().data_ptr()
        start = int(t.storage_offset()) * t.element_size()
        end = start + t.numel() * t.element_size()
        for other, lo, hi in list(seen):
            if other == storage and lo < end and start < hi:  # overlap: merge into one range
                seen.discard((other, lo, hi))
                total -= hi - lo
                start, end = min(start, lo), max(end, hi)
        seen.add((storage, start, end))
        total += end - start
    return total


def _unfused_masters(optimizer: Any) -> dict[int, torch.Tensor]:
    """ZeRO-0 bf16/fp16 (FP16_UnfusedOptimizer): id of each low-precision parameter -> fp32 master."""
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if not low or not high:
        return {}
    return {id(p): m for lg, hg in zip(low, high, strict=True) for p, m in zip(lg, hg, strict=True)}


def _check_partitioned_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """A model partitioned by ``zero.Init`` can no longer be cast: it must have been built in ``dtype``."""
    wanted = dtype or torch.float32
    found = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != wanted})
    if found:
        raise ValueError(
            f"deepspeed: the model was partitioned with {', '.join(found)} parameters, but the engine runs "
            f"in {wanted}: build it under shard.init_module() (it partitions in the engine's dtype) or "
            "without zero.Init"
        )


def _full_copy(ds: Any, t: torch.Tensor, master: torch.Tensor | None, keep: bool) -> torch.Tensor | None:
    """The whole of ``t`` as a CPU tensor (float32 if floating point) where ``keep``; every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param

    no_optimizer = hasattr(t, "ds_id") and not hasattr(t, "_z3_optimizer")  # ZeRO-3 prepared without one
    if master is None and isinstance(t, nn.Parameter) and not no_optimizer:
        master = safe_get_full_fp32_param(t)  # collective at ZeRO >= 1; None where no master exists
    if master is not None:
        return _cpu_copy(master).reshape(_full_shape(t)) if keep else None
    with ds.zero.GatheredParameters([t], modifier_rank=None):  # a no-op for a tensor ZeRO does not own
        return _cpu_copy(t) if keep else None


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    dtype = torch.float32 if t.is_floating_point() else t.dtype
    return t.detach().to("cpu", dtype=dtype, copy=True)


def _full_shape(p: torch.Tensor) -> torch.Size:
    shape: torch.Size = getattr(p, "ds_shape", p.shape)
    return shape


def _engine_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, config: dict[str, Any]
) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over ``model``; Adam/AdamW become DeepSpeedCPUAdam when offloading."""
    zero = config.get("zero_optimization", {})
    offloaded = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    if offloaded and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        d = optimizer.defaults
        adamw = type(optimizer) is torch.optim.AdamW
        groups = [{k: v for k, v in g.items() if k not in _TORCH_ONLY} for g in optimizer.param_groups]
        return DeepSpeedCPUAdam(  # type: ignore[no-any-return]
            groups,
            lr=float(d["lr"]),
            betas=tuple(d["betas"]),
            eps=d["eps"],
            weight_decay=d["weight_decay"],
            amsgrad=bool(d.get("amsgrad", False)),
            adamw_mode=adamw,
        )
    return rebuild_optimizer(optimizer, parameter_names(model), model)  # the engine keeps the parameters
