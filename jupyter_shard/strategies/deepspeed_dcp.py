"""A DeepSpeed engine's state as ``torch.distributed.checkpoint`` (DCP) saves it and loads it.

DeepSpeed's own checkpoint holds each rank's flat partitions, and another world size needs its
offline conversion first. DCP reshards on load, so the state here is keyed by parameter name:

* ZeRO-3 keeps each parameter partitioned flat: rank ``r`` holds elements ``[r·P, (r+1)·P)`` with
  ``P = ceil(numel / world)``, the last partitions padded. Without the padding that is exactly
  ``torch.chunk``'s split, which is what a 1-D ``DTensor`` with ``Shard(0)`` means, so each rank's
  fp32 master partition and optimizer-state partitions are wrapped as DTensors over a 1-D mesh of the
  whole world, and DCP writes each rank's piece and reads the pieces a new world size needs.
* Below stage 3 the model is whole on every rank and the fp32 masters and optimizer state are
  assembled whole (DeepSpeed's ``safe_get_full_*``), saved as replicated tensors: DCP writes one copy
  and every rank of any world size reads all of it.

Optimizers create their state lazily at the first step, so a freshly prepared engine has none to load
into: :func:`dcp_state` creates it first with one step at learning rate 0 over zero gradients (which
leaves every weight as it is; the values are overwritten by the load). Besides the masters and the
optimizer state, the engine's step counters and a dynamic loss scaler's state are kept, so training
continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

#: wrapper modules that insert a level in parameter names without changing what the parameter is
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def chunk_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The elements ``[start, end)`` of a flat tensor of ``numel`` that ``rank`` holds, padding dropped.

    ZeRO-3's partition size is ``ceil(numel / world)``; ranks past the end hold only padding (an
    empty range). This is ``torch.chunk``'s split, the one ``Shard(0)`` describes.
    """
    size = -(-numel // world)
    return min(rank * size, numel), min((rank + 1) * size, numel)


def state_name(name: str) -> str:
    """A parameter's name without the levels that activation checkpointing or compilation insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def padded(local: torch.Tensor, size: int) -> torch.Tensor:
    """``local`` (flat) followed by zeros up to ``size`` elements: the shape of a ZeRO-3 partition."""
    out = torch.zeros(size, dtype=local.dtype, device=local.device)
    out[: local.numel()] = local.reshape(-1)
    return out


def dcp_state(engine: nn.Module, optimizer: Any, stage: int, device: torch.device) -> dict[str, Any]:
    """The engine's state, keyed by parameter name, for ``dcp.save`` and ``dcp.load`` (collective)."""
    state: dict[str, Any] = {"engine": _counters(engine)}
    scaler = _scaler_state(optimizer)
    if scaler:
        state["loss_scaler"] = scaler
    if stage == 3:
        state.update(_zero3_state(engine, optimizer, device))
    else:
        state.update(_full_state(engine, optimizer, stage))
    return state


def load_dcp_state(engine: nn.Module, optimizer: Any, state: dict[str, Any], stage: int) -> None:
    """Put what DCP loaded into the dict :func:`dcp_state` returned back into the engine (collective)."""
    if stage == 3:
        _load_zero3(engine, optimizer, state)
    else:
        _load_full(engine, optimizer, state, stage)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "ds_opt_adam"):
        _replay_cpu_adam(inner)
    for key, value in state["engine"].items():
        setattr(engine, key, int(value.item()))
    scaler = _scaler(optimizer)
    for key, value in state.get("loss_scaler", {}).items():
        setattr(scaler, key, _like(getattr(scaler, key), value))


# -- ZeRO-3: this rank's flat partitions as DTensors ---------------------------------------------


def _zero3_state(engine: nn.Module, optimizer: Any, device: torch.device) -> dict[str, Any]:
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    rank = dist.get_rank()
    if optimizer is not None:
        _check_zero3(optimizer)
        _create_state(optimizer.optimizer, _zero3_flats(optimizer))
    model: dict[str, Any] = {}
    optim: dict[str, dict[str, Any]] = {}
    for name, p in _named(engine):
        _check_partition(p)
        start, end = chunk_bounds(p.ds_numel, dist.get_world_size(), rank)

        def shard(partition: torch.Tensor, start: int = start, end: int = end, p: Any = p) -> DTensor:
            local = partition.reshape(-1)[: end - start]
            return DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size([p.ds_numel]), stride=(1,)
            )

        if optimizer is None or not p.requires_grad:
            model[name] = shard(p.ds_tensor.data)
            continue
        model[name] = shard(optimizer.get_local_fp32_param(p))
        flat_state = optimizer.optimizer.state[_zero3_flat(optimizer, p)]
        optim[name] = {
            key: shard(optimizer.get_local_fp32_param(p, key))
            if _is_partition(value, flat_state)
            else _scalar(value)
            for key, value in flat_state.items()
        }
    return {"model": model, "optim": optim} if optimizer is not None else {"model": model}


def _load_zero3(engine: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    optim: dict[str, dict[str, Any]] = state.get("optim", {})
    for name, p in _named(engine):
        size = p.ds_tensor.numel()
        master = padded(_to_local(state["model"][name]), size)
        if optimizer is not None and p.requires_grad:
            optimizer.set_local_hp_param(master, p)
            flat_state = optimizer.optimizer.state[_zero3_flat(optimizer, p)]
            for key, value in optim[name].items():
                if isinstance(value, DTensor):
                    optimizer.set_local_hp_param(padded(value.to_local(), size), p, key)
                else:
                    flat_state[key] = _like(flat_state[key], value)
        # The engine's own partition (bf16/fp16 or fp32) is what forward gathers: as after a step,
        # it is the master rounded to the engine's dtype.
        p.ds_tensor.data.copy_(master)
    persistent = [p for _, p in _named(engine) if getattr(p, "ds_persist", False)]
    if persistent:  # kept whole on every rank: gathered again from the new partitions, as after a step
        persistent[0].all_gather(persistent)
    invalidate = getattr(optimizer, "invalidate_secondary_tensor", None)
    if invalidate is not None:
        invalidate()


def _check_zero3(optimizer: Any) -> None:
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "params_in_nvme_and_cpu", False):
        raise NotImplementedError(
            "deepspeed ZeRO-3 with NVMe offload: dcp_state cannot reach the swapped-out partitions; "
            "use shard.save/shard.load (DeepSpeed's own checkpoint) or offload to cpu"
        )


def _zero3_flats(optimizer: Any) -> list[tuple[int, torch.Tensor]]:
    flats: list[torch.Tensor] = optimizer.fp32_partitioned_groups_flat
    return [(int(optimizer.sub_group_to_group_id[i]), flat) for i, flat in enumerate(flats)]


def _zero3_flat(optimizer: Any, p: Any) -> torch.Tensor:
    """The fp32 flat partition of the sub-group that holds ``p`` (the inner optimizer's state key)."""
    sub_group = optimizer.grad_position[optimizer.get_param_id(p)][0]
    flat: torch.Tensor = optimizer.fp32_partitioned_groups_flat[sub_group]
    return flat


def _check_partition(p: Any) -> None:
    """The layout :func:`chunk_bounds` describes: partitioned over the whole world, in memory."""
    group = getattr(p, "ds_process_group", None)
    if dist.get_world_size(group=group) != dist.get_world_size():
        raise NotImplementedError(
            "deepspeed ZeRO-3 partitioning over a subgroup (MiCS): dcp_state needs parameters "
            "partitioned over the whole world; use shard.save/shard.load"
        )
    if (
        getattr(p.ds_tensor, "final_location", None) == "nvme"
        or p.ds_tensor.numel() * dist.get_world_size() < p.ds_numel
    ):
        raise NotImplementedError(
            "deepspeed ZeRO-3 with parameters offloaded to NVMe: dcp_state cannot reach the swapped-out "
            "partitions; use shard.save/shard.load (DeepSpeed's own checkpoint) or offload to cpu"
        )


# -- below ZeRO-3: whole tensors, replicated --------------------------------------------------------


def _full_state(engine: nn.Module, optimizer: Any, stage: int) -> dict[str, Any]:
    inner, masters = _full_layout(optimizer, stage)
    if inner is not None:
        _create_state(inner, [(i, t) for i, g in enumerate(inner.param_groups) for t in g["params"]])
        _link_fragments(optimizer)
    model: dict[str, Any] = {}
    optim: dict[str, dict[str, Any]] = {}
    for name, p in _named(engine):
        if hasattr(p, "_hp_mapping") and inner is not None:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            model[name] = safe_get_full_fp32_param(p)
            flat_state = inner.state[_hp_flat(optimizer, inner, p)]
            optim[name] = {
                key: safe_get_full_optimizer_state(p, key)
                if _is_partition(value, flat_state)
                else _scalar(value)
                for key, value in flat_state.items()
            }
            continue
        master = masters.get(id(p), p)
        model[name] = master.data
        if inner is not None and master in inner.state:
            optim[name] = {
                key: value if isinstance(value, torch.Tensor) and value.dim() > 0 else _scalar(value)
                for key, value in inner.state[master].items()
            }
    return {"model": model, "optim": optim} if inner is not None else {"model": model}


def _load_full(engine: nn.Module, optimizer: Any, state: dict[str, Any], stage: int) -> None:
    inner, masters = _full_layout(optimizer, stage)
    optim: dict[str, dict[str, Any]] = state.get("optim", {})
    for name, p in _named(engine):
        value = _to_local(state["model"][name])
        if hasattr(p, "_hp_mapping") and inner is not None:
            from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

            safe_set_full_fp32_param(p, value)
            flat_state = inner.state[_hp_flat(optimizer, inner, p)]
            for key, saved in optim[name].items():
                if _is_partition(flat_state[key], flat_state):
                    safe_set_full_optimizer_state(p, _to_local(saved), key)
                else:
                    flat_state[key] = _like(flat_state[key], saved)
        else:
            master = masters.get(id(p), p)
            _assign(master, value)
            if inner is not None and name in optim:
                per_param = inner.state[master]
                for key, saved in optim[name].items():
                    if isinstance(per_param[key], torch.Tensor) and per_param[key].dim() > 0:
                        _assign(per_param[key], saved)
                    else:
                        per_param[key] = _like(per_param[key], saved)
        # The model's whole parameter on every rank, as the engine makes it after a step.
        _assign(p, value)


def _full_layout(optimizer: Any, stage: int) -> tuple[torch.optim.Optimizer | None, dict[int, torch.Tensor]]:
    """The optimizer that holds the state, and each low-precision parameter's fp32 master where ZeRO-0
    keeps one per parameter (``FP16_UnfusedOptimizer``)."""
    if optimizer is None:
        return None, {}
    if getattr(optimizer, "fp32_groups_flat", None) is not None and stage == 0:
        raise NotImplementedError(
            "deepspeed ZeRO-0 with the fused fp16 optimizer: its masters are one flat tensor per group; "
            "use ZeRO stage 1-3 for dcp_state, or shard.save/shard.load"
        )
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    masters: dict[int, torch.Tensor] = {}
    if stage == 0 and low and high:
        masters = {id(p): m for lg, hg in zip(low, high, strict=True) for p, m in zip(lg, hg, strict=True)}
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner, masters
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None, masters


def _link_fragments(optimizer: Any) -> None:
    """ZeRO-1/2 and the bf16 optimizer link each parameter to its optimizer-state fragments at the
    first step; once the state exists, link them now so ``safe_*_optimizer_state`` can reach them."""
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def _hp_flat(optimizer: Any, inner: torch.optim.Optimizer, p: Any) -> torch.Tensor:
    """The flat fp32 partition (the inner optimizer's state key) of ``p``'s parameter group."""
    groups = getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None) or []
    for i, group in enumerate(groups):
        if any(q is p for q in group):
            flat: torch.Tensor = inner.param_groups[i]["params"][0]
            return flat
    raise RuntimeError(f"deepspeed: parameter of shape {tuple(p.shape)} is in no optimizer group")


# -- shared --------------------------------------------------------------------------------------


def _named(engine: nn.Module) -> Iterator[tuple[str, Any]]:
    module: nn.Module = getattr(engine, "module", engine)
    for name, p in module.named_parameters():
        yield state_name(name), p


def _create_state(inner: torch.optim.Optimizer, flats: list[tuple[int, torch.Tensor]]) -> None:
    """Create the optimizer state (lazy in torch's optimizers and DeepSpeed's CPU Adam) without
    changing a weight or the step count: one step at learning rate 0 over zero gradients, each group
    holding its flat partitions for the step (ZeRO-3 empties the groups between steps), then each
    created state's step count set back to 0 and its moments to zeros, as a first real step finds
    them, so a suspend before the first step neither takes one nor shifts Adam's bias correction."""
    if all(inner.state.get(flat) for _, flat in flats):
        return
    created = [flat for _, flat in flats if not inner.state.get(flat)]
    saved = [(g["params"], g["lr"]) for g in inner.param_groups]
    grads = [flat.grad for _, flat in flats]
    try:
        for group in inner.param_groups:
            group["params"], group["lr"] = [], 0.0
        for index, flat in flats:
            inner.param_groups[index]["params"].append(flat)
            flat.grad = torch.zeros_like(flat)
        inner.step()
        for flat in created:  # as a first real step finds it: no step taken, moments zero
            state = inner.state.get(flat, {})
            for key, value in state.items():
                if key == "step":
                    state[key] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0
                elif isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.zero_()  # weight decay in the gradient (Adam, not AdamW) moved them
    finally:
        for group, (params, lr) in zip(inner.param_groups, saved, strict=True):
            group["params"], group["lr"] = params, lr
        for (_, flat), grad in zip(flats, grads, strict=True):
            flat.grad = grad


def _replay_cpu_adam(inner: Any) -> None:
    """Bring DeepSpeedCPUAdam's native step state to the loaded step, the way training reached it.

    The C++ optimizer keeps ``beta^step`` itself, multiplied by ``beta`` once per step; set to a step
    out of sequence it takes ``pow(beta, step)`` instead, which differs in the last bits. Empty
    updates (no elements) walk it through steps ``1 … step`` after a reset (other betas), so the next
    real step multiplies from the same product as an uninterrupted run.
    """
    steps = [int(s["step"]) for s in inner.state.values() if "step" in s]
    if not steps:
        return
    group = inner.param_groups[0]
    beta1, beta2 = group["betas"]
    empty = torch.empty(0, dtype=torch.float32)

    def update(step: int, b1: float, b2: float) -> None:
        inner.ds_opt_adam.adam_update(
            inner.opt_id,
            step,
            0.0,
            b1,
            b2,
            group["eps"],
            0.0,
            group["bias_correction"],
            empty,
            empty,
            empty,
            empty,
        )

    update(0, 0.0, 0.0)
    for step in range(1, max(steps) + 1):
        update(step, beta1, beta2)


def _is_partition(value: Any, flat_state: dict[str, Any]) -> bool:
    """An optimizer-state entry with one value per element (``exp_avg``), not a scalar (``step``)."""
    reference = next(v for v in flat_state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return isinstance(value, torch.Tensor) and value.shape == reference.shape


def _scalar(value: Any) -> torch.Tensor:
    """A scalar state entry as a replicated 0-d tensor (a copy: the live value keeps changing)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def _like(current: Any, loaded: torch.Tensor) -> Any:
    """``loaded`` in the form the live entry has: the same tensor filled in place, or a Python number."""
    if isinstance(current, torch.Tensor):
        current.copy_(loaded)
        return current
    return type(current)(loaded.item()) if current is not None else loaded.item()


def _to_local(value: Any) -> torch.Tensor:
    local: torch.Tensor = value.to_local() if isinstance(value, DTensor) else value
    return local


def _assign(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` into ``target`` unless DCP already loaded into ``target`` itself."""
    if target.data_ptr() == value.data_ptr() and target.dtype == value.dtype:
        return
    with torch.no_grad():
        target.data.copy_(value.reshape(target.shape))


def _counters(engine: nn.Module) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(int(getattr(engine, key))) for key in _ENGINE_COUNTERS if hasattr(engine, key)}


def _scaler_state(optimizer: Any) -> dict[str, torch.Tensor]:
    """A dynamic loss scaler's scale and counters (fp16), which decide the next steps' scaling."""
    scaler = _scaler(optimizer)
    found = {key: getattr(scaler, key, None) for key in _SCALER_FIELDS}
    return {
        key: _scalar(value) for key, value in found.items() if isinstance(value, (int, float, torch.Tensor))
    }


def _scaler(optimizer: Any) -> Any:
    """Where the loss scale lives: ZeRO's ``loss_scaler``, or ZeRO-0's ``loss_scale_config``."""
    return getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)
