"""The DeepSpeed config: ZeRO-3's buffers sized by the model's largest layer where the config leaves
them unset, and what ``--precision`` becomes beside the user's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.strategies.deepspeed_config import (
    ConfigConflict,
    build_config,
    fit_stage3_buffers,
    parameter_dtype,
)


def test_stage3_buffers_follow_the_largest_layer() -> None:
    config = {"zero_optimization": {"stage": 3}}
    fit_stage3_buffers(config, 16_777_216)
    assert config["zero_optimization"] == {
        "stage": 3,
        "reduce_bucket_size": 16_777_216,
        "stage3_prefetch_bucket_size": 16_777_216,
        "stage3_max_live_parameters": 3 * 16_777_216,
        "stage3_max_reuse_distance": 3 * 16_777_216,
    }


def test_values_the_config_sets_are_kept_and_other_stages_untouched() -> None:
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8}}
    fit_stage3_buffers(config, 1000)
    assert config["zero_optimization"]["reduce_bucket_size"] == 5e8
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == 1000
    stage2 = {"zero_optimization": {"stage": 2}}
    fit_stage3_buffers(stage2, 1000)
    assert stage2 == {"zero_optimization": {"stage": 2}}


# -- --precision: the dtype the engine holds parameters in, and the user's JSON winning -------------


def _config(precision: str, user: dict[str, Any] | None = None, tmp: Path | None = None) -> dict[str, Any]:
    import torch

    from jupyter_shard.strategies.base import StrategyContext

    path = None
    if user is not None and tmp is not None:
        path = tmp / "ds.json"
        path.write_text(json.dumps(user))
    ctx = StrategyContext(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), precision=precision)
    return build_config(ctx, zero_stage=3, offload="none", config_path=path, options={})


def test_mixed_precision_holds_the_parameters_in_its_dtype() -> None:
    bf16 = _config("bf16-mixed")
    assert bf16["bf16"] == {"enabled": True} and "fp16" not in bf16
    assert parameter_dtype(bf16) == "bf16"
    fp16 = _config("16-mixed")
    assert fp16["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    assert parameter_dtype(fp16) == "fp16"
    assert parameter_dtype(_config("32")) is None


def test_the_json_chooses_precision_where_the_option_leaves_it(tmp_path: Path) -> None:
    assert parameter_dtype(_config("32", {"bf16": {"enabled": True}}, tmp_path)) == "bf16"
    legacy = _config("bf16-mixed", {"bfloat16": {"enabled": False, "immediate_grad_update": True}}, tmp_path)
    assert "bfloat16" not in legacy, "DeepSpeed's older section name is read as bf16"
    assert legacy["bf16"] == {"enabled": True, "immediate_grad_update": True}


def test_the_jsons_torch_autocast_is_kept_instead_of_low_precision_parameters(tmp_path: Path) -> None:
    autocast = _config("bf16-mixed", {"torch_autocast": {"enabled": True}}, tmp_path)
    assert autocast["torch_autocast"] == {"enabled": True, "dtype": "bf16"}
    assert "bf16" not in autocast and parameter_dtype(autocast) is None, "fp32 parameters under autocast"
    agreed = _config("bf16-mixed", {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, tmp_path)
    assert agreed["torch_autocast"]["dtype"] == "bfloat16"
    with pytest.raises(ConfigConflict, match=r"--precision bf16-mixed conflicts with .*torch_autocast.dtype"):
        _config("bf16-mixed", {"torch_autocast": {"enabled": True, "dtype": "float16"}}, tmp_path)
