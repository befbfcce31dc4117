"""jupyter_shard.transfer.pickling: values split into an in-band pickle and views of their bulk data,
and built
back exactly: every dtype, non-contiguous and zero-size tensors, parameters, arrays, nested containers.

Each round trip copies the out-of-band buffers into fresh ``bytearray``s first, as a receiver does,
so nothing built can share memory with the original."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from jupyter_shard.transfer import pickling

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def round_trip(value: Any) -> tuple[Any, pickling.Packed]:
    packed = pickling.dumps(value)
    received = [bytearray(b) for b in packed.buffers]
    return pickling.loads(packed.inband, received), packed


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad)
    assert torch.equal(a.detach().resolve_conj(), b.detach()), (a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_comes_back_bit_for_bit_with_its_bytes_out_of_band(dtype: torch.dtype) -> None:
    source = (torch.randn(64, 33) * 100).to(dtype)
    value, packed = round_trip(source)
    same_tensor(source, value)
    assert packed.sizes == [source.nelement() * source.element_size()], "the data went out of band"
    assert len(packed.inband) < 1024


def test_non_contiguous_views_keep_their_strides_and_big_storages_are_not_sent_whole() -> None:
    base = torch.arange(1000, dtype=torch.float32)
    transposed = base.reshape(10, 100).t()
    value, packed = round_trip(transposed)
    same_tensor(transposed, value)
    assert value.stride() == transposed.stride(), "a dense transposed view keeps its layout"
    assert packed.sizes == [4000]

    strided = base[::10]  # 100 elements of a 1000-element storage
    value, packed = round_trip(strided)
    same_tensor(strided, value)
    assert packed.sizes == [400], "only the view's own elements travel"
    window = base[100:110]  # contiguous, but a small part of its storage
    value, packed = round_trip(window)
    same_tensor(window, value)
    assert packed.sizes == [40]


def test_zero_size_zero_dim_and_conjugated_tensors() -> None:
    for source in (
        torch.empty(0),
        torch.empty(3, 0, 2, dtype=torch.int64),
        torch.tensor(2.5),
        torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
        torch.ones(4, 4).neg().t(),
    ):
        value, _ = round_trip(source)
        same_tensor(source, value)


def test_parameters_and_requires_grad_survive_and_autograd_history_does_not() -> None:
    weight = torch.nn.Parameter(torch.randn(3, 3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    activation = weight * 2  # a non-leaf with a grad_fn
    value, _ = round_trip({"w": weight, "f": frozen, "a": activation})
    same_tensor(weight, value["w"])
    same_tensor(frozen, value["f"])
    assert value["a"].grad_fn is None and value["a"].requires_grad
    assert torch.equal(value["a"].detach(), activation.detach())


def test_a_dtensor_is_sent_as_this_ranks_shard_a_plain_tensor(mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    def sharded(local: torch.Tensor) -> Any:
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    shard = torch.arange(6.0).reshape(3, 2)
    weight = torch.nn.Parameter(sharded(shard.clone()))  # an FSDP2 parameter: a DTensor marked as one
    frozen = torch.nn.Parameter(sharded(shard.clone()), requires_grad=False)
    state = {"exp_avg": sharded(shard * 2), "meta": sharded(torch.empty(3, 2, device="meta"))}
    assert weight.shape == (6, 2) and isinstance(weight, DTensor)

    value, packed = round_trip({"w": weight, "f": frozen, "state": state})
    assert b"DeviceMesh" not in packed.inband, "nothing the kernel would need a process group for"
    same_tensor(torch.nn.Parameter(shard), value["w"])
    same_tensor(torch.nn.Parameter(shard, requires_grad=False), value["f"])
    same_tensor(shard * 2, value["state"]["exp_avg"])
    meta = value["state"]["meta"]  # not sent as bytes: pickled as the plain tensor it is
    assert type(meta) is torch.Tensor and meta.is_meta and meta.shape == (3, 2)


def test_nested_containers_of_tensors_arrays_and_objects() -> None:
    shared = torch.arange(6.0)
    source: dict[str, Any] = {
        "layers": [torch.randn(4, 5), (np.arange(12).reshape(3, 4), np.asfortranarray(np.ones((3, 2))))],
        "meta": OrderedDict(step=3, name="run", empty=np.empty((0, 5))),
        "twice": (shared, shared),
        "module": torch.nn.Linear(3, 2),
        "strided_array": np.arange(20)[::3],
    }
    value, packed = round_trip(source)
    same_tensor(source["layers"][0], value["layers"][0])
    np.testing.assert_array_equal(value["layers"][1][0], source["layers"][1][0])
    np.testing.assert_array_equal(value["layers"][1][1], source["layers"][1][1])
    assert value["layers"][1][1].flags.f_contiguous
    assert value["meta"] == OrderedDict(step=3, name="run", empty=value["meta"]["empty"])
    assert value["meta"]["empty"].shape == (0, 5)
    assert value["twice"][0] is value["twice"][1], "one object stays one object"
    assert all(
        torch.equal(a, b)
        for a, b in zip(value["module"].parameters(), source["module"].parameters(), strict=True)
    )
    np.testing.assert_array_equal(value["strided_array"], source["strided_array"])
    assert len(packed.buffers) >= 5


def test_what_is_built_is_writable_and_shares_nothing_with_the_source() -> None:
    source: dict[str, Any] = {"t": torch.zeros(1000), "a": np.zeros(1000)}
    value, _ = round_trip(source)
    value["t"][0] = 1.0
    value["a"][0] = 1.0
    assert source["t"][0] == 0 and source["a"][0] == 0


def test_the_buffers_are_views_of_the_value_not_copies() -> None:
    tensor = torch.zeros(1 << 16)
    packed = pickling.dumps(tensor)
    tensor[5] = 3.0  # seen through the buffer: nothing was copied
    assert np.frombuffer(packed.buffers[0], dtype=np.float32)[5] == 3.0


def test_a_short_buffer_is_refused_rather_than_read_past() -> None:
    packed = pickling.dumps(torch.ones(100))
    with pytest.raises(RuntimeError):
        pickling.loads(packed.inband, [bytearray(40)])
    with pytest.raises(pickle.UnpicklingError):
        pickling.loads(packed.inband, [])


@pytest.mark.parametrize("step", [1, 7, 25, 4096])
def test_a_value_in_parts_is_reassembled_exactly_whatever_the_part_size(step: int) -> None:
    source = {"a": torch.randn(100), "e": torch.empty(0), "b": np.arange(37, dtype=np.int8)}
    packed = pickling.dumps(source)
    total = sum(packed.sizes)
    assembly = pickling.Assembly(packed.sizes)
    for offset in range(0, total, step):
        assert not assembly.complete
        assembly.add(offset, pickling.pieces(packed.buffers, offset, min(step, total - offset)))
    assert assembly.complete
    value = pickling.loads(packed.inband, assembly.buffers)
    assert torch.equal(value["a"], source["a"]) and np.array_equal(value["b"], source["b"])


def test_parts_out_of_order_or_past_the_end_are_refused() -> None:
    packed = pickling.dumps(torch.ones(10))
    assembly = pickling.Assembly(packed.sizes)
    with pytest.raises(ValueError, match="expected"):
        assembly.add(8, [b"x" * 8])
    with pytest.raises(ValueError, match="more bytes"):
        assembly.add(0, [b"x" * 41])
    with pytest.raises(ValueError, match="outside"):
        pickling.pieces(packed.buffers, 30, 20)
