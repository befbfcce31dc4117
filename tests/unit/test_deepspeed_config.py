"""ZeRO-3's buffers sized by the model's largest layer, where the DeepSpeed config leaves them unset."""

from __future__ import annotations

from jupyter_shard.strategies.deepspeed_config import fit_stage3_buffers


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
