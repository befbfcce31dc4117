"""Sharded initialisation without a real process group: which modules become FSDP units by default,
that a meta build is filled with exactly the values of a plain build from the same seed (every
``torch.nn`` layer; whole tensors and a 2-rank mesh's shards), what a meta build must offer to be
initialised again, the meta template, and giving up replaced storage."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from jupyter_shard.rank.shard import _meta_copy
from jupyter_shard.strategies.fsdp_units import SPLIT_ABOVE, default_units
from jupyter_shard.strategies.sharded_init import (
    built_on_meta,
    check_initialisable,
    materialise,
    meta_build,
    release_storage,
)

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(width, width), nn.Linear(width, 2 * width)
        self.out, self.norm = nn.Linear(2 * width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.out(torch.relu(self.mlp(self.attn(x)))))


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


# Every torch.nn layer with parameters or buffers, small. Attention and the transformer layers have
# initialisers that rewrite their children's tensors after the children drew them; the layers of the
# transformer stacks are deep copies of one layer, built and then dropped.
LAYERS: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: nn.Linear(6, 5),
    "Bilinear": lambda: nn.Bilinear(4, 3, 5),
    "Conv1d": lambda: nn.Conv1d(3, 4, 3),
    "Conv2d": lambda: nn.Conv2d(3, 4, 3, bias=False),
    "Conv3d": lambda: nn.Conv3d(2, 4, 2),
    "ConvTranspose1d": lambda: nn.ConvTranspose1d(3, 4, 3),
    "ConvTranspose2d": lambda: nn.ConvTranspose2d(4, 2, 3, groups=2),
    "ConvTranspose3d": lambda: nn.ConvTranspose3d(2, 3, 2),
    "Embedding": lambda: nn.Embedding(10, 4, padding_idx=2),
    "EmbeddingBag": lambda: nn.EmbeddingBag(10, 4, padding_idx=0),
    "LayerNorm": lambda: nn.LayerNorm(6),
    "GroupNorm": lambda: nn.GroupNorm(2, 6),
    "BatchNorm1d": lambda: nn.BatchNorm1d(5),
    "BatchNorm2d": lambda: nn.BatchNorm2d(5),
    "BatchNorm3d": lambda: nn.BatchNorm3d(5),
    "SyncBatchNorm": lambda: nn.SyncBatchNorm(5),
    "InstanceNorm1d": lambda: nn.InstanceNorm1d(5, affine=True, track_running_stats=True),
    "InstanceNorm2d": lambda: nn.InstanceNorm2d(5, affine=True),
    "InstanceNorm3d": lambda: nn.InstanceNorm3d(5, affine=True, track_running_stats=True),
    "RMSNorm": lambda: nn.RMSNorm(6),
    "PReLU": lambda: nn.PReLU(4),
    "RNN": lambda: nn.RNN(4, 5, num_layers=2, bidirectional=True),
    "LSTM": lambda: nn.LSTM(4, 5, num_layers=2, proj_size=3),
    "GRU": lambda: nn.GRU(4, 5, bias=False),
    "RNNCell": lambda: nn.RNNCell(4, 5),
    "LSTMCell": lambda: nn.LSTMCell(4, 5),
    "GRUCell": lambda: nn.GRUCell(4, 5),
    "MultiheadAttention": lambda: nn.MultiheadAttention(8, 2),
    "MultiheadAttention-kv": lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True, kdim=6, vdim=4),
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(8, 2, 16),
    "TransformerDecoderLayer": lambda: nn.TransformerDecoderLayer(8, 2, 16, norm_first=True),
    "TransformerEncoder": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2, nn.LayerNorm(8)
    ),
    "TransformerDecoder": lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16), 2),
    "Transformer": lambda: nn.Transformer(8, 2, 2, 1, 16, batch_first=True),
    "AdaptiveLogSoftmaxWithLoss": lambda: nn.AdaptiveLogSoftmaxWithLoss(16, 20, [5, 10]),
    "Sequential": lambda: nn.Sequential(
        nn.Embedding(10, 8), nn.TransformerEncoderLayer(8, 2, 16), nn.LayerNorm(8), nn.Linear(8, 10)
    ),
}


def _plain(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def _on_meta(build: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    with meta_build() as state:
        model = build()
    assert built_on_meta(model)
    return model, state


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)  # non-persistent ones too


def _assert_same(built: nn.Module, plain: nn.Module) -> None:
    mine, theirs = dict(_tensors(built)), dict(_tensors(plain))
    assert mine.keys() == theirs.keys()
    differ = [n for n, t in theirs.items() if not torch.equal(mine[n].detach(), t.detach())]
    assert not differ, f"not as a plain build: {differ}"


@pytest.mark.parametrize("name", LAYERS)
def test_every_torch_nn_layer_gets_the_values_of_a_plain_build(name: str) -> None:
    plain = _plain(LAYERS[name])
    model, state = _on_meta(LAYERS[name])
    materialise(model, CPU, state)
    _assert_same(model, plain)
    assert torch.equal(torch.get_rng_state(), state)  # the generator is left as it was


def test_a_build_that_ties_reseeds_and_drops_a_layer() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            nn.Linear(64, 64)  # drawn from the generator, then dropped
            self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)
            self.head.weight = self.embed.weight
            torch.manual_seed(7)
            self.body = nn.Linear(8, 8).to(torch.float64)

    plain = _plain(Tied)
    model, state = _on_meta(Tied)
    materialise(model, CPU, state)
    _assert_same(model, plain)


def test_a_model_with_init_weights_is_initialised_by_it() -> None:
    class Titan(nn.Module):  # the torchtitan way: init_weights() on the top-level model, rope buffer
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.out = nn.Linear(8, 16, bias=False)
            self.register_buffer("freqs", self._freqs(), persistent=False)

        def _freqs(self) -> torch.Tensor:
            return torch.polar(torch.ones(4, 4), torch.outer(torch.arange(4.0), torch.arange(0, 8, 2.0)))

        def init_weights(self, buffer_device: torch.device | None = None) -> None:
            with torch.device(buffer_device or self.freqs.device):
                self.freqs = self._freqs()
            nn.init.normal_(self.tok.weight)
            for layer in self.layers:
                nn.init.trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)
            nn.init.trunc_normal_(self.out.weight, std=8**-0.5)

    plain = _plain(Titan)
    plain.init_weights()
    model, state = _on_meta(Titan)
    materialise(model, CPU, state)
    _assert_same(model, plain)


def test_a_model_put_on_meta_some_other_way_runs_initialisers_children_first() -> None:
    build = LAYERS["Sequential"]  # attention: its own initialiser after its out_projection's
    plain = _plain(build)
    with torch.device("meta"):
        model = build()
    torch.manual_seed(0)
    materialise(model, CPU, None)
    _assert_same(model, plain)


def test_a_failed_build_leaves_torch_as_it_was() -> None:
    linear = nn.Linear.reset_parameters
    with pytest.raises(RuntimeError, match="in the block"), meta_build():
        nn.Linear(2, 2)
        raise RuntimeError("in the block")
    assert nn.Linear.reset_parameters is linear
    assert not nn.Linear(2, 2).weight.is_meta


@pytest.mark.parametrize("name", ["Sequential", "Transformer", "LSTM", "Bilinear"])
def test_each_rank_keeps_its_slice_of_the_plain_values(name: str, mesh: DeviceMesh) -> None:
    plain = _plain(LAYERS[name])
    model, state = _on_meta(LAYERS[name])
    for unit in [*model.children(), model]:
        fully_shard(unit, mesh=mesh)
    materialise(model, CPU, state)
    theirs = dict(plain.named_parameters())
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor), n
        assert torch.equal(p.to_local(), theirs[n].detach().chunk(2)[1]), n  # rank 1's rows


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))


def test_modules_without_reset_parameters_are_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Scale())
    with pytest.raises(ValueError, match=r"1 \(Scale\): gain.*reset_parameters\(\)"):
        check_initialisable(model)
    with meta_build() as state:
        model = nn.Sequential(nn.Linear(8, 8), Scale())
    with pytest.raises(ValueError, match=r"1 \(Scale\): gain.*reset_parameters\(\)"):
        materialise(model, CPU, state)
    check_initialisable(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8)))


def test_a_tensor_its_initialiser_leaves_alone_is_named() -> None:
    class Half(nn.Linear):  # its constructor sets `scale`, which meta storage cannot keep
        def __init__(self) -> None:
            super().__init__(8, 8)
            self.register_buffer("scale", torch.full((8,), 0.5))

    with meta_build() as state:
        model = nn.Sequential(nn.Linear(8, 8), Half())
    with pytest.raises(ValueError, match=r"no initialiser sets: 1 \(Half\): scale\. "):
        check_initialisable(model, state)


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss, nn.NLLLoss])
def test_a_loss_weight_is_data_that_cannot_be_rebuilt(loss: Callable[..., nn.Module]) -> None:
    why = r"holds weight as data: a loss's weight is given, not initialised.*outside shard\.init_module\(\)"
    with meta_build(), pytest.raises(ValueError, match=rf"{loss.__name__} {why}"):
        loss(weight=torch.ones(3))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), loss(weight=torch.ones(3)))
    with pytest.raises(ValueError, match=rf"1 \({loss.__name__}\) {why}.*after shard\.prepare"):
        check_initialisable(model)
    with meta_build() as state:
        criterion = loss()  # no weight: nothing to rebuild
        model = nn.Sequential(nn.Linear(4, 3), criterion)
    materialise(model, CPU, state)


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
