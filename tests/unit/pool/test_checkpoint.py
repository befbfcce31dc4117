"""``consolidate()``: each checkpoint layout ``shard.save`` writes, read back as one plain state dict,
built here without a process group (torch's own converters write the sharded layout)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from jupyter_shard.pool.checkpoint import consolidate, load_full_state_dict


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_single_file_checkpoint_gives_its_model_part_that_loads_into_the_plain_model(
    tmp_path: Path,
) -> None:
    model = _model()
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}}, "step": 7}, tmp_path / "ckpt.pt")
    out = consolidate(tmp_path / "ckpt.pt", tmp_path / "full.pt")
    assert out == tmp_path / "full.pt"
    loaded = torch.load(out, weights_only=True)
    assert _same(loaded, model.state_dict())
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    fresh.load_state_dict(loaded)  # strict: exactly the model's keys
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "full.pt"]  # no temporary left


def test_a_flat_checkpoint_keeps_only_model_keys_without_their_prefix(tmp_path: Path) -> None:
    model = _model()
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    flat["optim.lr"] = torch.tensor(0.1)
    torch.save(flat, tmp_path / "flat.pt")
    assert _same(load_full_state_dict(tmp_path / "flat.pt"), model.state_dict())


def test_a_bare_state_dict_is_taken_as_the_model(tmp_path: Path) -> None:
    model = _model()
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    assert _same(load_full_state_dict(str(tmp_path / "sd.pt")), model.state_dict())


@pytest.mark.parametrize(
    "content",
    [{"model": {"w": 1.0}}, {"epoch": 3}, [torch.zeros(1)]],
    ids=["not-tensors", "no-model", "a-list"],
)
def test_a_file_without_a_model_state_dict_is_refused(tmp_path: Path, content: object) -> None:
    torch.save(content, tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"x\.pt: found no model state dict of tensors in this checkpoint"):
        load_full_state_dict(tmp_path / "x.pt")


def test_a_directory_that_is_no_checkpoint_says_what_was_expected(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        ValueError, match=r"is not a jupyter_shard checkpoint: expected a file from shard\.save"
    ):
        load_full_state_dict(tmp_path)
    with pytest.raises(ValueError, match="is not a jupyter_shard checkpoint"):
        load_full_state_dict(tmp_path / "missing.pt")


def test_a_sharded_dcp_directory_is_merged_where_given_or_one_level_down(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    model = _model()
    torch.save({"model": model.state_dict(), "extra": {"step": 3}}, tmp_path / "plain.pt")
    root = tmp_path / "ckpt"
    torch_save_to_dcp(tmp_path / "plain.pt", root / "step-3")
    assert (root / "step-3" / ".metadata").is_file()
    assert _same(load_full_state_dict(root / "step-3"), model.state_dict())
    assert _same(load_full_state_dict(root), model.state_dict())


def _deepspeed_dir(tmp_path: Path, files: dict[str, object]) -> Path:
    directory = tmp_path / "ds"
    tag = directory / "global_step5"
    tag.mkdir(parents=True)
    (directory / "latest").write_text("global_step5\n")
    for name, content in files.items():
        torch.save(content, tag / name)
    return directory


def test_a_zero_0_deepspeed_checkpoint_is_read_from_its_module_file(tmp_path: Path) -> None:
    model = _model()
    directory = _deepspeed_dir(tmp_path, {"mp_rank_00_model_states.pt": {"module": model.state_dict()}})
    assert _same(load_full_state_dict(directory), model.state_dict())


def test_a_sharded_deepspeed_checkpoint_without_deepspeed_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _deepspeed_dir(tmp_path, {"zero_pp_rank_0_mp_rank_00_optim_states.pt": {}})
    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", None)  # importing it fails
    with pytest.raises(
        ImportError, match=r"install deepspeed to consolidate it \(pip install 'jupyter_shard"
    ):
        load_full_state_dict(directory)
