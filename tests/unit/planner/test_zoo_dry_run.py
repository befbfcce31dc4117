"""The dry run on the models users train (``tests/zoo.py``): tied embeddings plan under fsdp and
ZeRO-3, a ResNet with BatchNorm plans from a builder and from code, and a tokenizer's
``BatchEncoding`` plans as the dict it holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from jupyter_shard.planner.dry_run import dry_run
from tests import zoo

SHARDED = ["fsdp FULL_SHARD", "fsdp SHARD_GRAD_OP", "deepspeed ZeRO-3"]


def batch(name: str) -> Any:
    _, make_batch = zoo.build(name)
    return make_batch(8)  # type: ignore[operator]


@pytest.mark.parametrize("name", sorted(zoo.TIED))
def test_a_tied_model_plans_under_every_sharded_strategy(name: str) -> None:
    plans = dry_run(zoo.code(name), batch(name), 2, device="cpu", strategies=SHARDED)
    assert set(plans) == set(SHARDED)
    whole = sum(p.numel() * 4 for p in zoo.build(name)[0].parameters())  # type: ignore[attr-defined]
    for plan in plans.values():
        # the shards and the optimizer state are at least half the model's state
        assert plan.parameters + plan.optimizer >= whole // 2 * 3 * 0.9, plan
        assert plan.largest_unit is not None


def test_a_resnet_with_batch_norm_plans_from_a_builder_and_from_code() -> None:
    code = zoo.code("resnet")

    def builder() -> nn.Module:
        scope: dict[str, Any] = {}
        exec(code, scope)
        model = scope["model"]
        assert isinstance(model, nn.Module)
        return model

    images = batch("resnet")
    for precision in ("32", "bf16-mixed"):
        from_builder = dry_run(builder, images, 2, device="cpu", strategies=SHARDED, precision=precision)
        from_code = dry_run(code, images, 2, device="cpu", strategies=SHARDED, precision=precision)
        assert {k: v.peak_bytes for k, v in from_builder.items()} == {
            k: v.peak_bytes for k, v in from_code.items()
        }
        assert all(p.peak_bytes > 0 for p in from_code.values())


def test_a_tokenizers_batch_encoding_plans_as_its_dict() -> None:
    from transformers import BatchEncoding

    ids = batch("gpt2 tied")
    encoded = BatchEncoding(ids)
    assert not isinstance(encoded, dict)
    as_dict = dry_run(zoo.code("gpt2 tied"), ids, 2, device="cpu", strategies=["ddp"])
    as_encoding = dry_run(zoo.code("gpt2 tied"), encoded, 2, device="cpu", strategies=["ddp"])
    assert as_encoding["ddp"].peak_bytes == as_dict["ddp"].peak_bytes > 0


def test_a_batch_norm_builder_under_the_fake_mode_keeps_no_real_tensor() -> None:
    plans = dry_run(
        lambda: nn.Sequential(nn.Conv2d(3, 1024, 3), nn.BatchNorm2d(1024), nn.AdaptiveAvgPool2d(1)),
        torch.randn(4, 3, 8, 8),
        2,
        device="cpu",
        strategies=["ddp"],
    )
    assert plans["ddp"].parameters > 0


# -- code written for a GPU, planned on a machine without one -------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])


def plain_step(model: nn.Module, batch: torch.Tensor) -> None:
    model(batch).float().mean().backward()


def autocast_step(model: nn.Module, batch: torch.Tensor) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(batch.to("cuda"))
    out.float().mean().backward()


def cpu_autocast_step(model: nn.Module, batch: torch.Tensor) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(batch)
    out.float().mean().backward()


def held_step(model: nn.Module, batch: torch.Tensor) -> None:  # cpu_autocast_step without autocast
    out = model(batch)
    out.float().mean().backward()


def test_a_step_under_cuda_autocast_plans_in_its_low_precision() -> None:
    """Without CUDA, torch turns ``autocast("cuda")`` off with a warning: the plan was fp32's."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "CUDA is not available. Disabling" must not happen
        plain = dry_run(mlp, "torch.randn(256, 1024)", 2, strategies=["ddp"], step=plain_step)["ddp"]
        mixed = dry_run(mlp, "torch.randn(256, 1024)", 2, strategies=["ddp"], step=autocast_step)["ddp"]
    # autocast keeps bfloat16 copies of the weights and of the activations beside the float32 ones
    assert mixed.peak_bytes != plain.peak_bytes
    assert mixed.activations > plain.activations


@pytest.mark.parametrize(
    "ending",
    [".cuda()", '.to("cuda")', '.to(torch.device("cuda"))', ".to(torch.bfloat16).cuda()", '.to("cpu")'],
)
def test_a_builder_that_moves_its_model_to_the_gpu_plans_on_a_cpu_machine(ending: str) -> None:
    code = f"nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]){ending}"
    plan = dry_run(code, "torch.randn(8, 1024)", 2, strategies=["fsdp FULL_SHARD"])["fsdp FULL_SHARD"]
    low = "bfloat16" in ending
    assert plan.parameters == 4 * (1024 * 1024 + 1024) * (2 if low else 4) // 2


def test_a_mixture_of_experts_router_is_named_as_what_cannot_be_traced() -> None:
    from jupyter_shard.errors import SpecError

    with pytest.raises(SpecError, match="shapes that depend on the data") as caught:
        dry_run(zoo.code("mixtral moe"), batch("mixtral moe"), 2, device="cpu", strategies=["ddp"])
    assert "pass a batch" not in str(caught.value) and "\n" not in str(caught.value)


def test_a_cuda_plan_counts_each_tensor_as_the_allocators_512_byte_block() -> None:
    def many_small() -> nn.Module:
        return nn.Sequential(*[nn.Linear(5, 5) for _ in range(40)])

    cpu = dry_run(many_small, "torch.randn(2, 5)", 2, device="cpu", strategies=["ddp"])["ddp"]
    cuda = dry_run(many_small, "torch.randn(2, 5)", 2, device="cuda", strategies=["ddp"])["ddp"]
    assert cpu.parameters == 40 * (25 + 5) * 4  # weight 100 bytes, bias 20 bytes
    assert cuda.parameters == 40 * 2 * 512  # each a block of its own
    assert "512 bytes" in cuda.source["device"] and "not modelled" in cuda.source["device"]
    # restored after the call: a CPU plan counts bytes again
    assert dry_run(many_small, "torch.randn(2, 5)", 2, device="cpu", strategies=["ddp"])["ddp"] == cpu


def test_cuda_devices_by_index_plan_on_a_cpu_machine() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)).to(torch.device("cuda", 0))

    def step(model: nn.Module, batch: torch.Tensor) -> None:
        extra = torch.zeros(1, device=0) + torch.ones(1, device=torch.device(type="cuda", index=0))
        (model(batch.to(0)).mean() + extra.sum()).backward()

    plan = dry_run(build, "torch.randn(4, 64)", 2, strategies=["ddp"], step=step)["ddp"]
    assert plan.parameters == 64 * 64 * 4 + 3 * 512  # three tensors under a 512-byte block


def test_a_cpu_plan_runs_gpu_code_as_a_cpu_pool_would() -> None:
    """A plan for CPU ranks keeps torch's own behaviour: autocast("cuda") is off there."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "CUDA is not available. Disabling"
        plain = dry_run(mlp, "torch.randn(256, 1024)", 2, "cpu", ["ddp"], step=held_step)["ddp"]
        mixed = dry_run(mlp, "torch.randn(256, 1024)", 2, "cpu", ["ddp"], step=cpu_autocast_step)
    assert mixed["ddp"].peak_bytes == plain.peak_bytes
