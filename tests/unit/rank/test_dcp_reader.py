"""Whole contiguous tensors of a checkpoint are read straight into their targets; every other item
(a transposed tensor, a pickled value, an empty or a zero-dimensional tensor) the way DCP reads it,
and every value comes back equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from jupyter_shard.rank import dcp_reader
from jupyter_shard.rank.dcp_digests import without_crc32
from jupyter_shard.rank.dcp_reader import DirectReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _saved(tmp_path: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(64, 32, generator=g),
        "half": torch.randn(100, generator=g).to(torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64),
        "t": torch.randn(8, 5, generator=g).t(),  # saved with its strides: not contiguous
        "step": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
        "extra": {"epoch": 2, "note": "x"},
    }
    with without_crc32():  # as a suspend writes them
        dcp_save(state, checkpoint_id=tmp_path, no_dist=True)
    return state


def _targets(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (torch.full_like(v, 7) if isinstance(v, torch.Tensor) else {"epoch": 0, "note": ""})
        for k, v in state.items()
    }


def test_values_come_back_equal_and_whole_contiguous_tensors_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _saved(tmp_path)
    in_place: list[str] = []
    real = dcp_reader._read_in_place

    def counting(fh: Any, item: Any, *rest: Any) -> bool:
        done = real(fh, item, *rest)
        if done:
            in_place.append(item.dest_index.fqn)
        return done

    monkeypatch.setattr(dcp_reader, "_read_in_place", counting)
    targets = _targets(state)
    w = targets["w"]
    dcp_load(targets, storage_reader=DirectReader(tmp_path), no_dist=True)
    assert sorted(in_place) == ["half", "ids", "step", "w"]
    assert targets["w"] is w  # filled in place
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(targets[key], value) and targets[key].dtype == value.dtype, key
    assert targets["extra"] == {"epoch": 2, "note": "x"}


def test_the_same_as_dcps_own_reader(tmp_path: Path) -> None:
    state = _saved(tmp_path)
    ours, theirs = _targets(state), _targets(state)
    dcp_load(ours, storage_reader=DirectReader(tmp_path), no_dist=True)
    dcp_load(theirs, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    for key in state:
        if isinstance(state[key], torch.Tensor):
            assert torch.equal(ours[key], theirs[key]), key


def test_a_target_of_another_dtype_or_layout_goes_through_dcp(tmp_path: Path) -> None:
    state = _saved(tmp_path)
    targets = _targets(state)
    targets["w"] = torch.zeros(32, 64).t()  # not contiguous
    targets["ids"] = torch.zeros(17, dtype=torch.int32)  # DCP converts
    dcp_load(targets, storage_reader=DirectReader(tmp_path), no_dist=True)
    assert torch.equal(targets["w"], state["w"]) and torch.equal(targets["ids"], state["ids"].int())


def test_a_file_cut_short_is_an_error_not_a_partial_tensor(tmp_path: Path) -> None:
    state = _saved(tmp_path)
    (shard,) = tmp_path.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:-3000])  # inside the last items
    with pytest.raises(BaseException) as failed:  # DCP raises CheckpointException, a BaseException
        dcp_load(_targets(state), storage_reader=DirectReader(tmp_path), no_dist=True)
    assert "central directory" in str(failed.value) or "ended inside" in str(failed.value)


def test_touch_zeroes_each_large_contiguous_cpu_tensor_and_nothing_around_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dcp_reader, "TOUCH_MIN", 64)
    whole = torch.ones(300)
    inside = whole[100:200]  # a tensor of the state dict inside a larger buffer that is not
    big = torch.ones(64)
    state: dict[str, Any] = {
        "inside": inside,
        "nested": {"big": big, "again": [big]},  # one tensor under two keys (tied weights)
        "small": torch.ones(4),  # under TOUCH_MIN: left to fault in as it is filled
        "strided": torch.ones(40, 40).t(),  # not contiguous: its bytes are not one range
        "value": 3,
    }
    assert dcp_reader.touch(state) == (100 + 64) * 4
    assert torch.equal(whole[:100], torch.ones(100)) and torch.equal(whole[200:], torch.ones(100))
    assert not inside.any() and not big.any()
    assert torch.equal(state["small"], torch.ones(4)) and torch.equal(state["strided"], torch.ones(40, 40))


def test_touched_targets_are_loaded_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp_reader, "TOUCH_MIN", 1)
    state = _saved(tmp_path)
    targets = _targets(state)
    assert dcp_reader.touch(targets) == (64 * 32 + 17 * 2) * 4 + 100 * 2 + 4  # all but "t" and "empty"
    dcp_load(targets, storage_reader=DirectReader(tmp_path), no_dist=True)
    for key in ("w", "half", "ids", "t", "step", "empty"):
        assert torch.equal(targets[key], state[key]), key
