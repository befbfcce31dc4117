"""Turn a ``shard.save`` checkpoint of any strategy into one plain ``state_dict`` file.

Runs in the kernel (or any process) without a process group: a single-file checkpoint (``none``,
``ddp``) is read directly, a sharded ``torch.distributed.checkpoint`` directory (``fsdp``) is merged
with DCP's own converter, and a DeepSpeed ZeRO directory with DeepSpeed's ``zero_to_fp32``. The
result loads into the plain ``nn.Module`` the model was built as: ``model.load_state_dict(torch.load(out))``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from jupyter_shard.strategies.base import atomic_torch_save

__all__ = ["consolidate", "load_full_state_dict"]


def load_full_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model's full, unsharded state dict (CPU tensors) from a checkpoint written by ``shard.save``."""
    source = Path(path)
    if source.is_file():
        return _model_part(torch.load(source, map_location="cpu", weights_only=False), source)
    if (source / ".metadata").is_file():
        return _from_dcp(source)
    if (source / "latest").is_file():
        return _from_deepspeed(source)
    if source.is_dir():
        for child in sorted(source.iterdir()):
            if (child / ".metadata").is_file():
                return _from_dcp(child)
    raise ValueError(
        f"{source} is not a jupyter_shard checkpoint: expected a file from shard.save, a "
        "torch.distributed.checkpoint directory (.metadata) or a DeepSpeed directory (latest)"
    )


def consolidate(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the full model state dict of checkpoint ``path`` to ``out`` (atomically); returns ``out``."""
    target = Path(out)
    atomic_torch_save(load_full_state_dict(path), target)
    return target


def _model_part(state: Any, source: Path) -> dict[str, torch.Tensor]:
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    elif isinstance(state, dict) and any(str(k).startswith("model.") for k in state):
        state = {str(k)[len("model.") :]: v for k, v in state.items() if str(k).startswith("model.")}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{source}: found no model state dict of tensors in this checkpoint")
    return {str(k): v.detach().to("cpu", copy=True) for k, v in state.items()}


def _from_dcp(directory: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="jupyter_shard-consolidate-") as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(directory, merged)
        return _model_part(torch.load(merged, map_location="cpu", weights_only=False), directory)


def _from_deepspeed(directory: Path) -> dict[str, torch.Tensor]:
    tag = directory / (directory / "latest").read_text().strip()
    if not any("zero_pp_rank" in p.name for p in tag.iterdir()):  # ZeRO-0: whole module in one file
        states = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return _model_part({"model": states["module"]}, directory)
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise ImportError(
            f"{directory} is a DeepSpeed checkpoint; install deepspeed to consolidate it "
            "(pip install 'jupyter_shard[deepspeed]')"
        ) from exc
    state = get_fp32_state_dict_from_zero_checkpoint(str(directory))
    return _model_part(dict(state), directory)
