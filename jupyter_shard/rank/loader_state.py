"""Where ``shard.prepare``'s loaders are in their epoch, kept through a suspend and carried to
another world size.

A prepared loader is a :class:`ShardLoader` over a :class:`ShardSampler` (a DistributedSampler).
Iterating it gives a :class:`LoaderIterator`, which counts the samples it has handed out. Both can be
pickled: a suspended ``it = iter(loader)`` comes back as an iterator that goes on with the next batch
of the same epoch, and the samples before it are never loaded again.

An epoch's order is a *plan*: a list of dataset indices split over ``world`` ranks as a
DistributedSampler splits them (padded with the list's start to a multiple of ``world``, or cut to
one with ``drop_last``; rank ``r`` takes every ``world``-th from ``r``). The usual plan is the
sampler's own permutation for the seed and epoch. A resume at another world size makes a new plan:
the samples no suspended rank had read yet, in their order, split over the new ranks, so the rest
of the epoch reads each of them once (:func:`reshard`, as elastic streaming datasets do).

The random state a new iterator draws its workers' seed from is kept with it, and a resumed
iterator draws the same seed without moving the generator again: at the same world size the next
batches are the ones an uninterrupted run reads, to the sample.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = [
    "LoaderIterator",
    "ShardLoader",
    "ShardSampler",
    "live_positions",
    "plan_indices",
    "reshard",
    "resharding",
]

_SERIALS = itertools.count()
_LIVE: weakref.WeakSet[LoaderIterator] = weakref.WeakSet()
# key -> each suspended rank's samples read, while a resume at another world size unpickles
_RESHARD: dict[str, list[int]] | None = None
_WORLD: tuple[int, int] | None = None  # (rank, world size) of the pool being resumed


class ShardSampler(DistributedSampler[Any]):
    """A DistributedSampler that can be told, for one epoch, to draw a given list instead (the rest
    of an epoch a resume goes on with)."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool, **options: Any) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, **options)
        self._next: tuple[int, list[int]] | None = None

    def draw_next(self, epoch: int, indices: list[int]) -> None:
        self._next = (epoch, indices)

    def __iter__(self) -> Iterator[Any]:
        pending, self._next = self._next, None
        if pending is not None and pending[0] == self.epoch:
            return iter(pending[1])
        return super().__iter__()

    def __reduce__(self) -> Any:
        options = (self.dataset, self.shuffle, self.seed, self.drop_last, self.epoch)
        return _sampler_again, (*options, self.num_replicas, self.rank)


def _sampler_again(
    dataset: Any, shuffle: bool, seed: int, drop_last: bool, epoch: int, world: int, rank: int
) -> ShardSampler:
    """The sampler at the resumed pool's rank and world size (its own where no pool is resuming)."""
    rank, world = _WORLD if _WORLD is not None else (rank, world)
    sampler = ShardSampler(dataset, world, rank, shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return sampler


class ShardLoader(DataLoader[Any]):
    """A DataLoader over a :class:`ShardSampler` whose iterators can be suspended and resumed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.serial = next(_SERIALS)
        self.iterators_made = 0

    def __iter__(self) -> LoaderIterator:  # type: ignore[override]
        sampler = self.sampler
        assert isinstance(sampler, ShardSampler)
        return LoaderIterator(self, sampler.epoch, None, 0, None)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_iterator": None}  # persistent workers start again after a resume

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        global _SERIALS
        made = next(_SERIALS)  # later loaders number after every resumed one
        _SERIALS = itertools.count(max(made, int(state["serial"]) + 1))


class LoaderIterator:
    """An iterator over a :class:`ShardLoader` that knows how many samples it has handed out."""

    def __init__(
        self,
        loader: ShardLoader,
        epoch: int,
        plan: tuple[list[int], int] | None,
        read: int,
        rng: torch.Tensor | None,
        key: str | None = None,
        done: bool = False,
    ) -> None:
        self.loader = loader
        self.epoch = epoch
        self.plan = plan  # (the epoch's list, the world size it is split over); None: the sampler's own
        self.read = read  # samples of this rank's list handed out before this iterator began
        self.batches = 0
        self.done = done
        if key is None:
            key = f"{loader.serial}.{loader.iterators_made}"
            loader.iterators_made += 1
        self.key = key
        self._rng = rng
        self._inner: Iterator[Any] | None = None
        _LIVE.add(self)
        if rng is None:  # a new iterator: it starts (and its workers start) now, as a DataLoader's does
            self._start()

    def _start(self) -> None:
        loader, sampler = self.loader, self.loader.sampler
        assert isinstance(sampler, ShardSampler)
        generator = loader.generator
        now = generator.get_state() if generator is not None else torch.get_rng_state()
        resumed = self._rng is not None
        if self._rng is None:
            self._rng = now
        else:  # draw the workers' seed as the suspended iterator did, and leave the generator be
            _set_rng(generator, self._rng)
            mine = plan_indices(sampler, self.epoch, self.plan)
            sampler.draw_next(sampler.epoch, mine[self.read :])
        try:
            self._inner = DataLoader.__iter__(loader)
        finally:
            if resumed:
                _set_rng(generator, now)

    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        if self._inner is None:
            self._start()
        assert self._inner is not None
        try:
            batch = next(self._inner)
        except StopIteration:
            self.done = True
            raise
        self.batches += 1
        return batch

    def __len__(self) -> int:
        return len(self.loader)

    def samples_read(self) -> int:
        """Samples of this rank's list for the epoch handed out so far."""
        sampler = self.loader.sampler
        assert isinstance(sampler, ShardSampler)
        total = len(plan_indices(sampler, self.epoch, self.plan))
        size = self.loader.batch_size or 1
        return total if self.done else min(total, self.read + self.batches * size)

    def __reduce__(self) -> Any:
        state = (self.loader, self.epoch, self.plan, self.samples_read(), self._rng, self.key, self.done)
        return _iterator_again, state


def _set_rng(generator: torch.Generator | None, state: torch.Tensor) -> None:
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def _iterator_again(
    loader: ShardLoader,
    epoch: int,
    plan: tuple[list[int], int] | None,
    read: int,
    rng: torch.Tensor,
    key: str,
    done: bool,
) -> LoaderIterator:
    """A suspended iterator, going on where it stopped; at another world size, over its share of what
    the suspended ranks had not read."""
    counts = _RESHARD.get(key) if _RESHARD is not None else None
    if counts is not None and _WORLD is not None and not done:
        sampler = loader.sampler
        assert isinstance(sampler, ShardSampler)
        rest = reshard(sampler, epoch, plan, counts)
        return LoaderIterator(loader, epoch, (rest, _WORLD[1]), 0, rng, key)
    return LoaderIterator(loader, epoch, plan, read, rng, key, done)


def epoch_list(sampler: ShardSampler, epoch: int, plan: tuple[list[int], int] | None) -> list[int]:
    """The epoch's whole list, before it is padded or cut and split."""
    if plan is not None:
        return list(plan[0])
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if not sampler.shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(sampler.seed + epoch)
    return list(torch.randperm(n, generator=g).tolist())


def _padded(order: list[int], world: int, drop_last: bool) -> list[int]:
    """``order`` cut or padded to a multiple of ``world``, as a DistributedSampler does."""
    if drop_last:
        return order[: len(order) // world * world]
    total = math.ceil(len(order) / world) * world
    if not order:
        return []
    return (order * math.ceil(total / len(order)))[:total]


def plan_indices(sampler: ShardSampler, epoch: int, plan: tuple[list[int], int] | None) -> list[int]:
    """This rank's list for ``epoch`` under ``plan`` (the sampler's own split where there is none)."""
    world = plan[1] if plan is not None else sampler.num_replicas
    padded = _padded(epoch_list(sampler, epoch, plan), world, sampler.drop_last)
    return padded[sampler.rank :: world]


def reshard(
    sampler: ShardSampler, epoch: int, plan: tuple[list[int], int] | None, counts: Sequence[int]
) -> list[int]:
    """The samples of the epoch that no rank had read (rank ``r`` read ``counts[r]`` of its list), in
    the epoch's order, each once."""
    world = len(counts)
    order = epoch_list(sampler, epoch, plan)
    padded = _padded(order, world, sampler.drop_last)
    consumed = {r + world * i for r, c in enumerate(counts) for i in range(c)}
    seen = {padded[p] for p in consumed if p < len(padded)}
    rest: list[int] = []
    for p, index in enumerate(padded[: min(len(order), len(padded))]):
        if p not in consumed and index not in seen:
            rest.append(index)
            seen.add(index)
    return rest


def live_positions() -> dict[str, int]:
    """Each live prepared-loader iterator's key and the samples it has handed out this epoch."""
    return {it.key: it.samples_read() for it in list(_LIVE)}


class resharding:
    """While a resume unpickles the namespace: the new pool's rank and world size, and (at another
    world size) every suspended rank's place in each loader's epoch."""

    def __init__(self, rank: int, world: int, counts: Mapping[str, list[int]] | None) -> None:
        self._state = ((rank, world), dict(counts) if counts is not None else None)

    def __enter__(self) -> None:
        global _WORLD, _RESHARD
        _WORLD, _RESHARD = self._state

    def __exit__(self, *exc: object) -> None:
        global _WORLD, _RESHARD
        _WORLD, _RESHARD = None, None
