"""``shard.prepare``'s dataloaders: each rank's loader rebuilt to read only its part of the dataset.

The loader is built again with every argument it was given (its workers, how they start and are
seeded, collation, pinning, prefetching, timeout, order) and a DistributedSampler in place of its
sampler: a loader whose dataset touches CUDA needs ``multiprocessing_context="spawn"``, and one
rebuilt without it forks workers that fail. The rebuilt loader knows where each of its iterators is
in the epoch, so a suspend keeps that place (:mod:`~jupyter_shard.rank.loader_state`). What a
DistributedSampler cannot stand in for is refused with what to do instead: an IterableDataset picks
its own samples, and a custom sampler or batch sampler picks them in a way the DistributedSampler
would throw away.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from jupyter_shard.rank.loader_state import ShardLoader, ShardSampler

__all__ = ["distributed_loader"]

_LEAVE_OUT = "and leave the loader out of shard.prepare"


def distributed_loader(loader: DataLoader[Any], rank: int, world_size: int) -> DataLoader[Any]:
    """``loader`` reading the ``rank``-th of ``world_size`` parts of its dataset (shuffled when it
    shuffled); a loader that already draws through a DistributedSampler is returned as it is."""
    source = _sampler_of(loader)
    if isinstance(source, DistributedSampler):
        return loader
    batch_size, drop_last = loader.batch_size, loader.drop_last
    if isinstance(loader.batch_sampler, BatchSampler) and batch_size is None:  # given as batch_sampler
        batch_size, drop_last = loader.batch_sampler.batch_size, loader.batch_sampler.drop_last
    sampler = ShardSampler(loader.dataset, world_size, rank, isinstance(source, RandomSampler))
    return ShardLoader(
        loader.dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )


def _sampler_of(loader: DataLoader[Any]) -> Any:
    """The sampler that picks ``loader``'s samples (the one inside a plain BatchSampler given as its
    ``batch_sampler``), where a DistributedSampler can stand in for it; else a ``ValueError`` that
    says what to do."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            "shard.prepare cannot split a DataLoader over an IterableDataset "
            f"({type(loader.dataset).__name__}): it yields its own samples, so no sampler chooses them. "
            "Have it yield this rank's share (e.g. every shard.world_size-th sample from shard.rank) "
            + _LEAVE_OUT
        )
    batches, sampler = loader.batch_sampler, loader.sampler
    if batches is not None and loader.batch_size is None:  # the user's own batch_sampler
        if type(batches) is not BatchSampler:
            raise ValueError(
                f"shard.prepare cannot split a DataLoader whose batch_sampler is a {type(batches).__name__}: "
                "it decides which samples make each batch, and cannot be given a DistributedSampler. "
                "Build it over DistributedSampler(dataset, num_replicas=shard.world_size, rank=shard.rank) "
                "yourself " + _LEAVE_OUT
            )
        sampler = batches.sampler
    plain = type(sampler) is SequentialSampler or (
        type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None
    )
    if not plain and not isinstance(sampler, DistributedSampler):
        raise ValueError(
            f"shard.prepare cannot split a DataLoader whose sampler is a {_describe(sampler)}: a "
            "DistributedSampler in its place would draw from the whole dataset its own way. Give each "
            "rank its share yourself (a sampler over this rank's indices, shard.rank of shard.world_size) "
            + _LEAVE_OUT
        )
    return sampler


def _describe(sampler: Any) -> str:
    if type(sampler) is RandomSampler:
        return f"RandomSampler(replacement={sampler.replacement}, num_samples={sampler._num_samples})"
    return type(sampler).__name__
