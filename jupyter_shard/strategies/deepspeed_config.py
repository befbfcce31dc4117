"""The DeepSpeed config a pool runs with: the user's ``--config`` JSON merged with the pool's options.

Each pool option that was given (``--zero-stage``, ``--offload``, ``--precision`` other than 32,
``accumulate`` above 1, ``clip_grad_norm``) must agree with the JSON where the JSON sets the same
thing; otherwise :class:`ConfigConflict` names both values. Options the pool leaves at their
defaults take the JSON's value. This module does not import deepspeed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_shard.errors import SpecError

if TYPE_CHECKING:
    from jupyter_shard.strategies.base import StrategyContext

#: ZeRO stage when neither ``--zero-stage`` nor the JSON names one: plain data parallel, like ddp.
DEFAULT_STAGE = 0


class ConfigConflict(SpecError):
    """A pool option and the DeepSpeed JSON set the same thing to different values."""


def load_json(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    with open(path) as fh:
        loaded = json.load(fh)
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path}: expected a DeepSpeed config (a JSON object)")
    return loaded


def build_config(
    ctx: StrategyContext,
    *,
    zero_stage: int | None,
    offload: str,
    config_path: str | Path | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    """The merged DeepSpeed config for this rank's engine."""
    source = f"--config {config_path}"
    user = load_json(config_path)
    config = copy.deepcopy(user)
    zero: dict[str, Any] = config.setdefault("zero_optimization", {})

    def agree(option: str, mine: Any, key: str, theirs: Any) -> None:
        if theirs is not None and mine is not None and theirs != mine:
            raise ConfigConflict(
                f"{option} {mine} conflicts with {source}, which sets {key} = {json.dumps(theirs)}; "
                f"remove one of them or make them agree"
            )

    agree("--zero-stage", zero_stage, "zero_optimization.stage", zero.get("stage"))
    stage = int(zero_stage if zero_stage is not None else zero.get("stage", DEFAULT_STAGE))
    zero["stage"] = stage

    if offload != "none":
        if stage == 0:
            raise ConfigConflict(f"--offload {offload} needs ZeRO stage 1, 2 or 3; this pool runs stage 0")
        targets = ["offload_optimizer"] + (["offload_param"] if stage == 3 else [])
        for target in targets:
            section = zero.setdefault(target, {})
            agree("--offload", offload, f"zero_optimization.{target}.device", section.get("device"))
            section["device"] = offload
            if offload == "nvme":
                nvme = section.get("nvme_path") or user.get("nvme_path")
                if not nvme:
                    raise ValueError(
                        f'--offload nvme needs a directory for the swap files: set "nvme_path" in '
                        f"zero_optimization.{target} of the DeepSpeed JSON (--config)"
                    )
                section["nvme_path"] = str(nvme)
            section.setdefault("pin_memory", ctx.device.type == "cuda")
    config.pop("nvme_path", None)  # our shorthand, not a DeepSpeed key
    for key, value in options.items():
        agree(key, value, f"zero_optimization.{key}", zero.get(key))
        zero[key] = value

    _precision(ctx.precision, config, agree)

    accumulate = ctx.accumulate if ctx.accumulate > 1 else None
    agree("accumulate", accumulate, "gradient_accumulation_steps", config.get("gradient_accumulation_steps"))
    steps = int(accumulate or config.get("gradient_accumulation_steps", 1))
    config["gradient_accumulation_steps"] = steps
    micro = int(config.get("train_micro_batch_size_per_gpu", 1))
    config["train_micro_batch_size_per_gpu"] = micro
    # only DeepSpeed's own dataloader uses it; it must agree with micro-batch x steps x world size
    config["train_batch_size"] = micro * steps * ctx.world_size

    agree("clip_grad_norm", ctx.clip_grad_norm, "gradient_clipping", config.get("gradient_clipping"))
    # DeepSpeed >= 0.18 clips at norm 1.0 unless told otherwise; like torch, clip only when asked
    config["gradient_clipping"] = float(ctx.clip_grad_norm or config.get("gradient_clipping", 0.0))

    # a user's optimizer class that DeepSpeed did not test is fine: it is the user's choice
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("steps_per_print", 2**31 - 1)
    return config


def _precision(precision: str, config: dict[str, Any], agree: Any) -> None:
    """``bf16-mixed``/``16-mixed`` become DeepSpeed's ``bf16``/``fp16`` section (parameters held in
    that dtype), unless the JSON chose DeepSpeed's ``torch_autocast`` (float32 parameters, autocast
    inside the engine): then that stays, in the dtype the option names."""
    if "bfloat16" in config and "bf16" not in config:  # DeepSpeed's older name for the section
        config["bf16"] = config.pop("bfloat16")
    enabled = {name: bool(config.get(name, {}).get("enabled", False)) for name in ("bf16", "fp16")}
    if precision == "32":
        return  # the JSON may still enable bf16, fp16 or torch_autocast
    wanted = {"bf16-mixed": "bf16", "16-mixed": "fp16"}[precision]
    other = "fp16" if wanted == "bf16" else "bf16"
    if enabled[other]:
        agree("--precision", precision, f"{other}.enabled", f"true ({other})")
    autocast = config.get("torch_autocast", {})
    if autocast.get("enabled", False):
        dtype = autocast.get("dtype")
        if dtype is not None and str(dtype) not in _DTYPE_NAMES[wanted]:
            agree("--precision", precision, "torch_autocast.dtype", dtype)
        autocast.setdefault("dtype", wanted)
        if not enabled[wanted]:
            return
    section = config.setdefault(wanted, {})
    section["enabled"] = True
    if wanted == "fp16":
        section.setdefault("loss_scale", 0)  # 0: dynamic loss scaling
        section.setdefault("initial_scale_power", 16)


#: the names DeepSpeed reads as each low-precision dtype (its ``DtypeEnum``)
_DTYPE_NAMES = {
    "bf16": {"bf16", "bfloat16", "torch.bfloat16"},
    "fp16": {"fp16", "float16", "half", "torch.float16"},
}


def parameter_dtype(config: dict[str, Any]) -> str | None:
    """``"bf16"`` or ``"fp16"`` where the engine holds the parameters in that dtype; None for float32."""
    for name in ("bf16", "fp16"):
        if config.get(name, {}).get("enabled", False):
            return name
    return None


def fit_stage3_buffers(config: dict[str, Any], largest: int) -> None:
    """Size ZeRO-3's buffers by the model's largest parameter (``largest`` elements), where the
    config leaves them unset.

    DeepSpeed's defaults are sized for large GPUs whatever the model: a 5e8-element reduce bucket
    (2 GB in fp32, allocated whole) and up to 1e9 gathered parameters alive at once (the whole of
    most models). Measured on a 1.5 GB model with 2 CPU ranks, they took a training step's peak to
    4.6× the model on each rank. Sized like this (as the Hugging Face integration's ``"auto"``
    values size them by the hidden size), a step holds the partitions plus a few layers.
    """
    zero: dict[str, Any] = config.setdefault("zero_optimization", {})
    if int(zero.get("stage", 0)) != 3:
        return
    zero.setdefault("reduce_bucket_size", largest)
    zero.setdefault("stage3_prefetch_bucket_size", largest)
    zero.setdefault("stage3_max_live_parameters", 3 * largest)
    zero.setdefault("stage3_max_reuse_distance", 3 * largest)
