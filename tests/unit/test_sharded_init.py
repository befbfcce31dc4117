"""Sharded initialisation without a process group: which modules become FSDP units by default, what
a meta build must offer to be initialised again, the meta template, and giving up replaced storage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_shard.rank.shard import _meta_copy
from jupyter_shard.strategies.fsdp import SPLIT_ABOVE, default_units
from jupyter_shard.strategies.sharded_init import (
    built_on_meta,
    check_initialisable,
    meta_build,
    release_storage,
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(width, width), nn.Linear(width, 2 * width)
        self.out, self.norm = nn.Linear(2 * width, width), nn.LayerNorm(width)


class Transformer(nn.Module):
    def __init__(self, width: int, depth: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)


def test_one_unit_per_repeated_block_and_per_large_leftover_module() -> None:
    with torch.device("meta"):
        model = Transformer(width=256, depth=6, vocab=4000)
    units = default_units(model)
    blocks = [m for m in units if isinstance(m, Block)]
    assert blocks == list(model.layers)[::-1]  # children before parents: the last layer first
    # the embedding and the head each hold about a block's worth: units of their own, not the root's
    assert model.embed in units and model.head in units
    assert not any(isinstance(m, nn.Linear) and m is not model.head for m in units)
    assert len(units) == 6 + 2


def test_small_modules_beside_the_blocks_stay_in_the_root_unit() -> None:
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Embedding(10, 1024), *[nn.Linear(1024, 1024) for _ in range(4)], nn.LayerNorm(1024)
        )
    units = default_units(model)
    assert units == [model[4], model[3], model[2], model[1]]  # the blocks; not the small embedding or norm


def test_a_stack_of_equal_layers_is_split_per_layer() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    assert default_units(model) == list(model)[::-1]


def test_a_small_model_stays_one_unit() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    assert sum(p.numel() for p in model.parameters()) < SPLIT_ABOVE
    assert default_units(model) == []


def test_meta_build_allocates_nothing_and_yields_the_generator_state() -> None:
    torch.manual_seed(3)
    expected = torch.get_rng_state()
    with meta_build() as state:
        model = nn.Linear(4096, 4096)
    assert torch.equal(state, expected)
    assert built_on_meta(model) and model.weight.is_meta
    assert torch.equal(torch.get_rng_state(), expected)  # building on meta draws nothing


def test_modules_without_reset_parameters_are_named() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(8))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Scale())
    with pytest.raises(ValueError, match=r"1 \(Scale\).*reset_parameters\(\)"):
        check_initialisable(model)
    check_initialisable(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8)))


def test_meta_template_has_full_shapes_and_no_storage() -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32))
    template = _meta_copy(model)
    assert template is not None
    shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in template.state_dict().items()} == shapes
    assert all(t.is_meta for t in (*template.parameters(), *template.buffers()))
    assert not any(t.is_meta for t in model.parameters())  # the original is untouched


def test_release_storage_frees_replaced_parameters() -> None:
    layer = nn.Linear(256, 256)
    release_storage(list(layer.parameters()))
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.float32
    assert layer.weight.untyped_storage().nbytes() == 0
