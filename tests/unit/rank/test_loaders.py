"""``shard.prepare``'s dataloaders (:mod:`jupyter_shard.rank.loaders`): rebuilt with every argument
they were given and a DistributedSampler, or refused with what to do where none can stand in."""

from __future__ import annotations

import inspect
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from jupyter_shard.rank.shard import Shard

DATA = TensorDataset(torch.arange(20.0))
# DataLoader's arguments other than the dataset and the ones that choose samples
KEPT = [
    name
    for name in inspect.signature(DataLoader.__init__).parameters
    if name not in ("self", "dataset", "shuffle", "sampler", "batch_sampler")
]


def _collate(batch: list[Any]) -> Any:
    return batch


def _init_worker(worker_id: int) -> None:
    pass


def prepared(loader: DataLoader[Any], rank: int = 1, world_size: int = 2) -> DataLoader[Any]:
    """``loader`` as rank ``rank``'s ``shard.prepare`` gives it back."""
    helper = Shard(rank, rank, world_size, torch.device("cpu"), "none", lambda *_: None, {})
    _, _, out = helper.prepare(torch.nn.Linear(1, 1), None, loader)
    return out  # type: ignore[no-any-return]


def test_every_argument_the_loader_was_given_survives() -> None:
    """A loader whose dataset touches CUDA needs its ``spawn`` context: a rebuilt one that forks
    fails in its workers. Every argument here differs from DataLoader's default."""
    loader = DataLoader(
        DATA,
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=_collate,
        pin_memory=True,
        drop_last=True,
        timeout=7.5,
        worker_init_fn=_init_worker,
        multiprocessing_context=multiprocessing.get_context("spawn"),
        generator=torch.Generator().manual_seed(3),
        prefetch_factor=5,
        persistent_workers=True,
        pin_memory_device="cuda",
        in_order=False,
    )
    default = DataLoader(DATA)
    assert KEPT and all(getattr(loader, n) != getattr(default, n) for n in KEPT), "each one set"
    out = prepared(loader)
    assert out.dataset is DATA
    assert {n: getattr(out, n) for n in KEPT} == {n: getattr(loader, n) for n in KEPT}
    assert out.multiprocessing_context.get_start_method() == "spawn"
    assert isinstance(out.sampler, DistributedSampler)
    assert (out.sampler.rank, out.sampler.num_replicas, out.sampler.shuffle) == (1, 2, True)


def indices(loader: DataLoader[Any]) -> Iterator[list[int]]:
    for (batch,) in loader:
        yield [int(i) for i in batch]


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(DATA, batch_size=4),
        lambda: DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), 4, drop_last=False)),
    ],
    ids=["batch_size", "plain-batch_sampler"],
)
def test_the_ranks_read_disjoint_halves_in_batches_of_the_same_size(make: Any) -> None:
    halves = [list(indices(prepared(make(), rank))) for rank in (0, 1)]
    assert [len(b) for h in halves for b in h] == [4, 4, 2, 4, 4, 2]
    seen = [i for h in halves for b in h for i in b]
    assert sorted(seen) == list(range(20))


def test_a_loader_that_already_has_a_distributed_sampler_is_left_as_it_is() -> None:
    sampler: DistributedSampler[Any] = DistributedSampler(DATA, num_replicas=2, rank=1, seed=7)
    loader = DataLoader(DATA, batch_size=4, sampler=sampler)
    assert prepared(loader) is loader


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))


class _Buckets(BatchSampler):
    pass


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        (DataLoader(_Stream(), batch_size=2), r"over an IterableDataset \(_Stream\): it yields its own"),
        (
            DataLoader(DATA, batch_sampler=_Buckets(SequentialSampler(DATA), 4, drop_last=False)),
            r"batch_sampler is a _Buckets: .* Build it over DistributedSampler\(dataset, num_replicas=",
        ),
        (
            DataLoader(DATA, sampler=WeightedRandomSampler([1.0] * 20, 20)),
            r"sampler is a WeightedRandomSampler: a DistributedSampler in its place",
        ),
        (
            DataLoader(DATA, sampler=RandomSampler(DATA, replacement=True)),
            r"RandomSampler\(replacement=True, num_samples=None\)",
        ),
        (
            DataLoader(DATA, batch_sampler=BatchSampler(list(range(20)), 4, drop_last=False)),
            r"sampler is a list",
        ),
    ],
    ids=["iterable", "custom-batch_sampler", "weighted", "with-replacement", "index-list"],
)
def test_what_a_distributed_sampler_cannot_split_is_refused_with_what_to_do(
    loader: DataLoader[Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as failure:
        prepared(loader)
    assert str(failure.value).endswith("leave the loader out of shard.prepare")
