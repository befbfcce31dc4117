"""jupyter_shard.strategies.ddp: DistributedDataParallel on a real gloo group of one CPU rank.

(The options ``ddp`` accepts and refuses by name are tested in ``tests/unit/test_strategies.py``.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from jupyter_shard.strategies.base import StrategyContext
from jupyter_shard.strategies.ddp import DDPStrategy

pytestmark = pytest.mark.timeout(60)


def _ready(**options: object) -> DDPStrategy:
    s = DDPStrategy(**options)
    s.setup(StrategyContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    return s


def test_an_unknown_comm_hook_is_refused_when_the_strategy_is_made() -> None:
    with pytest.raises(ValueError) as info:
        DDPStrategy(comm_hook="int8")
    assert str(info.value) == "ddp comm_hook 'int8' is not valid; choose one of: fp16, bf16, powersgd"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sync_batchnorm": True}, "ddp sync_batchnorm needs CUDA ranks"),
        (
            {"comm_hook": "bf16"},
            "ddp comm_hook 'bf16' needs CUDA ranks with NCCL; on CPU use 'fp16' or 'powersgd'",
        ),
    ],
)
def test_what_needs_cuda_is_refused_on_cpu_ranks_with_what_to_use(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _ready(**options).wrap(nn.BatchNorm1d(2))


def test_wrap_gives_ddp_with_the_options_and_unwrap_the_model_back(gloo: None) -> None:
    s = _ready(find_unused_parameters=True, broadcast_buffers=False)
    model = nn.Linear(3, 1)
    wrapped = s.wrap(model)
    assert isinstance(wrapped, DistributedDataParallel)
    assert wrapped.find_unused_parameters is True and wrapped.broadcast_buffers is False
    assert wrapped.device_ids is None, "CPU ranks name no device"
    assert s.unwrap(wrapped) is model


@pytest.mark.parametrize(
    ("hook", "function"), [("fp16", "fp16_compress_hook"), ("powersgd", "powerSGD_hook")]
)
def test_a_comm_hook_runs_on_the_gradients_and_they_still_arrive(
    gloo: None, monkeypatch: pytest.MonkeyPatch, hook: str, function: str
) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    module = default_hooks if hook == "fp16" else powerSGD_hook
    original, calls = getattr(module, function), []

    def recording(state, bucket):  # type: ignore[no-untyped-def]  # torch checks the annotations
        calls.append(bucket)
        return original(state, bucket)

    monkeypatch.setattr(module, function, recording)
    s = _ready(comm_hook=hook)
    wrapped = s.wrap(nn.Linear(3, 1))
    wrapped(torch.ones(2, 3)).sum().backward()
    assert calls, f"the {hook} hook reduced the gradients"
    assert torch.allclose(s.unwrap(wrapped).weight.grad, torch.full((1, 3), 2.0), atol=1e-2)


def test_no_sync_skips_the_all_reduce_of_a_ddp_model_only(gloo: None) -> None:
    s = _ready()
    wrapped = s.wrap(nn.Linear(2, 1))
    with s.no_sync(wrapped):
        assert wrapped.require_backward_grad_sync is False
    assert wrapped.require_backward_grad_sync is True
    with s.no_sync(nn.Linear(2, 1)):
        pass
