"""jupyter_shard.rank.device: the device and backend a rank takes, and values pickled for the kernel.

Only CPU tensors exist here, so what is checked is what a pulled value keeps on the way: the copy
:func:`~jupyter_shard.transfer.pickling.host_copy` makes (detached, a parameter still a parameter,
``requires_grad`` kept) and a
round trip of containers, modules, arrays and plain objects as a pull sends them
(:func:`jupyter_shard.transfer.pickling.dumps` with ``host=True``). That a CUDA tensor
comes back on the CPU, with no CUDA context in the kernel, is tests/gpu/test_cuda_pool.py's.
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from jupyter_shard.rank.device import CUDA_BACKEND, select_device
from jupyter_shard.transfer import pickling

Point = namedtuple("Point", "x y")


def test_a_cpu_rank_talks_gloo_and_a_missing_gpu_says_how_many_are_visible() -> None:
    assert select_device(0, 0, "cpu") == (torch.device("cpu"), "gloo")
    n = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=rf"rank 3 needs CUDA device {n} but {n} are visible; start fewer"):
        select_device(3, n, "cuda", "start fewer ranks")
    assert CUDA_BACKEND == "cpu:gloo,cuda:nccl"


def test_host_copy_detaches_and_keeps_what_the_tensor_was() -> None:
    weight = torch.nn.Parameter(torch.randn(3, 2))
    copy = pickling.host_copy(weight)
    assert type(copy) is torch.nn.Parameter and copy.requires_grad and copy.is_leaf
    assert copy.device.type == "cpu" and torch.equal(copy, weight)

    activation = weight * 2  # a non-leaf with autograd history
    copy = pickling.host_copy(activation)
    assert copy.grad_fn is None and copy.requires_grad and torch.equal(copy, activation)

    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    assert not pickling.host_copy(frozen).requires_grad
    steps = torch.arange(4)
    assert pickling.host_copy(steps).dtype == torch.int64 and not pickling.host_copy(steps).requires_grad


def _round_trip(value: Any, host: bool = True) -> Any:
    packed = pickling.dumps(value, host=host)
    return pickling.loads(packed.inband, [bytearray(b) for b in packed.buffers])


def test_containers_arrays_and_plain_values_come_back_equal() -> None:
    value: dict[str, Any] = {
        "loss": torch.tensor(0.25),
        "history": [torch.ones(2), (torch.zeros(1), "step", 3)],
        "ordered": OrderedDict(b=torch.arange(3), a=np.arange(4.0)),
        "point": Point(torch.tensor([1.0]), None),
        "scale": 1.5,
    }
    back = _round_trip(value)
    assert back.keys() == value.keys() and list(back["ordered"]) == ["b", "a"]
    assert torch.equal(back["loss"], value["loss"]) and back["scale"] == 1.5
    assert torch.equal(back["history"][0], value["history"][0]) and back["history"][1][1:] == ("step", 3)
    assert isinstance(back["ordered"], OrderedDict) and np.array_equal(back["ordered"]["a"], np.arange(4.0))
    assert isinstance(back["point"], Point) and back["point"].y is None


def test_a_module_comes_back_with_its_parameters_and_the_original_is_untouched() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    back = _round_trip(model)
    assert isinstance(back, torch.nn.Sequential)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in before.items())
    assert all(isinstance(p, torch.nn.Parameter) for p in back.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_shared_tensors_stay_shared_and_cloudpickle_objects_still_pickle() -> None:
    shared = torch.ones(2)
    back = _round_trip([shared, shared, lambda x: x + 1])  # cloudpickle: functions by value
    assert back[0] is back[1] and back[2](1) == 2


def test_keep_device_leaves_tensors_as_they_are() -> None:
    value = {"w": torch.randn(2, 2)}
    assert torch.equal(_round_trip(value, host=False)["w"], value["w"])


def test_tensor_bytes_counts_tensors_modules_arrays_and_containers_without_pickling() -> None:
    from jupyter_shard.rank.device import tensor_bytes

    layer = torch.nn.Linear(10, 10)  # 110 float32 parameters
    assert tensor_bytes(torch.zeros(4, dtype=torch.float64)) == 32
    assert tensor_bytes(layer) == 440
    assert tensor_bytes({"w": np.zeros(8, dtype=np.int16), "m": [layer, (torch.ones(2),)]}) == 16 + 440 + 8
    assert tensor_bytes(torch.empty(1000, device="meta")) == 0
    assert tensor_bytes("text") == 0


def test_tensor_bytes_counts_a_dtensor_as_the_local_shard_a_pull_sends(mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    from jupyter_shard.rank.device import tensor_bytes

    shard = torch.zeros(4, 4)  # 64 bytes here, of a (8, 4) tensor of 128 bytes over both ranks
    weight = torch.nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False))
    assert weight.shape == (8, 4)
    assert tensor_bytes(weight) == 64
    assert tensor_bytes({"w": weight, "exp_avg": [DTensor.from_local(shard, mesh, [Shard(0)])]}) == 128
    assert tensor_bytes(weight) == pickling.dumps(weight, host=True).buffers[0].nbytes  # what is sent
