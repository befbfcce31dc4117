"""Prepared loaders keep their place in the epoch: a pickled iterator goes on with the next batch and
the same random draws; at another world size the rest of the epoch reads every sample no suspended
rank had read, once (drawn over dataset sizes, world sizes, shuffling, drop_last and stopping
points)."""

from __future__ import annotations

import random
from typing import Any

import cloudpickle
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from jupyter_shard.rank.loader_state import (
    LoaderIterator,
    ShardLoader,
    ShardSampler,
    live_positions,
    plan_indices,
    reshard,
    resharding,
)
from jupyter_shard.rank.loaders import distributed_loader


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _loader(
    n: int, rank: int, world: int, *, shuffle: bool = True, batch: int = 3, drop: bool = False
) -> Any:
    source = DataLoader(_dataset(n), batch_size=batch, shuffle=shuffle, drop_last=drop)
    return distributed_loader(source, rank, world)


def _ids(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in b[0]]


@pytest.mark.parametrize("seed", range(40))
def test_a_rank_list_is_the_distributed_samplers_own(seed: int) -> None:
    draw = random.Random(seed)
    n, world = draw.randint(1, 40), draw.randint(1, 6)
    shuffle, drop, epoch = draw.random() < 0.5, draw.random() < 0.5, draw.randint(0, 3)
    if drop and n < world:
        n = world
    for rank in range(world):
        reference = DistributedSampler(_dataset(n), world, rank, shuffle=shuffle, drop_last=drop)
        reference.set_epoch(epoch)
        ours = ShardSampler(_dataset(n), world, rank, shuffle, drop_last=drop)
        assert plan_indices(ours, epoch, None) == list(reference)


def test_prepare_gives_a_loader_whose_iterators_can_be_kept() -> None:
    loader = _loader(20, 1, 2)
    assert isinstance(loader, ShardLoader) and isinstance(loader.sampler, ShardSampler)
    it = iter(loader)
    assert isinstance(it, LoaderIterator)
    next(it)
    assert live_positions()[it.key] == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pickled_iterator_goes_on_with_the_next_batch_and_the_same_draws(workers: int) -> None:
    """The iterator and its loader are pickled together (as a suspend pickles the namespace), three
    batches in; the copy yields what the original yields next, and neither its creation nor its
    workers' seed moves the global generator."""
    source = DataLoader(_dataset(40), batch_size=4, shuffle=True, num_workers=workers)
    loader = distributed_loader(source, 0, 2)
    loader.sampler.set_epoch(3)
    torch.manual_seed(5)
    it = iter(loader)
    for _ in range(3):
        next(it)
    blob = cloudpickle.dumps({"loader": loader, "it": it})
    state = torch.get_rng_state()
    expected = _ids(list(it))
    after = torch.randn(3)
    torch.set_rng_state(state)
    copy = cloudpickle.loads(blob)
    assert copy["it"].loader is copy["loader"]
    assert _ids(list(copy["it"])) == expected
    assert torch.equal(torch.randn(3), after)
    if workers:
        assert copy["it"]._inner._base_seed == it._inner._base_seed


def test_an_exhausted_iterator_stays_exhausted_and_a_new_one_starts_the_epoch() -> None:
    loader = _loader(10, 0, 1, shuffle=False)
    it = iter(loader)
    first = _ids(list(it))
    copy = cloudpickle.loads(cloudpickle.dumps({"l": loader, "it": it}))
    assert list(copy["it"]) == []
    assert _ids(list(copy["l"])) == first


def _epoch_after_resume(
    n: int, old: int, new: int, reads: list[int], *, shuffle: bool, drop: bool, epoch: int = 1
) -> tuple[list[int], list[list[int]]]:
    """(samples read before, each new rank's samples after) of one epoch suspended at ``old`` ranks,
    rank ``r`` having read ``reads[r]`` batches of 2, and resumed at ``new``: every iterator goes
    through the pickle as a suspend sends it (rank 0's namespace on every new rank)."""
    before: list[int] = []
    blobs = []
    for rank in range(old):
        loader = _loader(n, rank, old, shuffle=shuffle, batch=2, drop=drop)
        loader.sampler.set_epoch(epoch)
        it = iter(loader)
        for _ in range(reads[rank]):
            before += _ids([next(it)])
        blobs.append((it.key, it.samples_read(), cloudpickle.dumps({"loader": loader, "it": it})))
    counts = [read for _, read, _ in blobs]
    after = []
    for rank in range(new):
        with resharding(rank, new, {blobs[0][0]: counts}):
            copy = cloudpickle.loads(blobs[0][2])
        assert copy["loader"].sampler.num_replicas == new and copy["loader"].sampler.rank == rank
        after.append(_ids(list(copy["it"])))
    return before, after


def _uninterrupted(n: int, world: int, *, shuffle: bool, drop: bool, epoch: int = 1) -> set[int]:
    """The samples one whole epoch reads at ``world`` ranks."""
    seen: set[int] = set()
    for rank in range(world):
        loader = _loader(n, rank, world, shuffle=shuffle, batch=2, drop=drop)
        loader.sampler.set_epoch(epoch)
        seen |= set(_ids(list(loader)))
    return seen


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (4, 1), (1, 4), (3, 5)])
@pytest.mark.parametrize("seed", range(12))
def test_at_another_world_size_the_epoch_reads_each_sample_once(old: int, new: int, seed: int) -> None:
    draw = random.Random(seed * 100 + old * 10 + new)
    n = draw.randint(max(old, new) * 2, 60)
    shuffle, drop = draw.random() < 0.7, draw.random() < 0.3
    batches = len(_loader(n, 0, old, batch=2, drop=drop))
    reads = [draw.randint(0, batches)] * old
    before, after = _epoch_after_resume(n, old, new, reads, shuffle=shuffle, drop=drop)
    later = [i for part in after for i in part]
    whole = _uninterrupted(n, old, shuffle=shuffle, drop=drop)
    assert not set(before) & set(later), "a sample read before the suspend was read again"
    assert len(later) - len(set(later)) < new, "more repeats than evening out the ranks needs"
    assert len({len(part) for part in after}) == 1, "ranks would take different numbers of steps"
    if not drop:
        assert set(before) | set(later) == whole
    else:  # each rank's last short batch is left out, before the suspend as after it
        assert set(before) | set(later) <= set(range(n))
        assert len(set(range(n)) - set(before) - set(later)) <= max(n - len(whole), (2 - 1) * new)


def test_ranks_that_read_different_amounts_leave_exactly_the_unread_samples() -> None:
    before, after = _epoch_after_resume(30, 3, 2, [4, 1, 0], shuffle=True, drop=False)
    later = [i for part in after for i in part]
    assert sorted(set(before) | set(later)) == list(range(30))
    assert not set(before) & set(later)


def test_two_resumes_in_one_epoch_still_read_each_sample_once() -> None:
    """2 ranks read 2 batches, resume at 3 which read 1 batch each, resume at 2 which finish."""
    n = 40
    first = []
    blobs = []
    for rank in range(2):
        loader = _loader(n, rank, 2, batch=2)
        it = iter(loader)
        first += _ids([next(it), next(it)])
        blobs.append(cloudpickle.dumps({"loader": loader, "it": it}))
    key = "unused"
    second, blobs3 = [], []
    for rank in range(3):
        with resharding(rank, 3, None):
            probe = cloudpickle.loads(blobs[0])
        key = probe["it"].key
        with resharding(rank, 3, {key: [4, 4]}):
            copy = cloudpickle.loads(blobs[0])
        second += _ids([next(copy["it"])])
        blobs3.append((copy["it"].samples_read(), cloudpickle.dumps(copy)))
    third = []
    for rank in range(2):
        with resharding(rank, 2, {key: [r for r, _ in blobs3]}):
            copy = cloudpickle.loads(blobs3[0][1])
        third += _ids(list(copy["it"]))
    assert sorted(first + second + third) == list(range(n))


def test_reshard_keeps_the_epochs_order() -> None:
    sampler = ShardSampler(_dataset(12), 2, 0, False)
    assert reshard(sampler, 0, None, [2, 2]) == list(range(4, 12))
    assert reshard(sampler, 0, None, [6, 6]) == []
