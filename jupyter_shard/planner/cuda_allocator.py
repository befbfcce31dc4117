"""CUDA's caching allocator, replayed over a traced step: what ``max_memory_reserved`` would read.

Why it exists: a CUDA plan's peak counts the bytes of the tensors alive at once, rounded to the
allocator's 512-byte blocks, which is what ``torch.cuda.max_memory_allocated`` reads. A GPU runs out
of memory on what the allocator has reserved from the driver, which is more: it carves blocks out of
segments (2 MiB for blocks up to 1 MiB, 20 MiB for blocks up to 10 MiB, larger ones their own size
rounded up to 2 MiB), keeps freed blocks cached for reuse and never gives a segment back during
training, so a free block too small for the next request leaves a new segment to be reserved beside
it. :class:`CachingAllocator` replays the allocations and frees of a traced step through the same
rules as torch's ``CUDACachingAllocator.cpp`` with its default settings (best fit by size then
address, splitting a block when enough remains, merging a freed block with its free neighbours in the
segment, no ``max_split_size_mb``, no expandable segments).

Not modelled: blocks kept apart per CUDA stream (FSDP all-gathers and reduce-scatters on streams of
their own, whose freed blocks the compute stream does not reuse), ``empty_cache`` and the allocator's
retry after freeing cached segments when memory runs out.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

KiB, MiB = 1 << 10, 1 << 20
MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of this
SMALL_SIZE = 1 * MiB  # kSmallSize: blocks up to this come from the small pool
SMALL_SEGMENT = 2 * MiB  # kSmallBuffer: the small pool's segments
LARGE_SEGMENT = 20 * MiB  # kLargeBuffer: segments for blocks under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger blocks get a segment of their size rounded to this


def round_size(size: int) -> int:
    """A block's size for a request of ``size`` bytes (torch's ``round_size``)."""
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment reserved when no cached block holds a block of ``size`` (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocator:
    """Blocks and segments as CUDA's caching allocator hands them out; ``peak_reserved`` and
    ``peak_allocated`` are what ``max_memory_reserved`` and ``max_memory_allocated`` would read."""

    def __init__(self) -> None:
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self._pools: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self._live: dict[object, _Block] = {}
        self._next_address = 0

    def malloc(self, key: object, size: int) -> None:
        """Hand out a block of ``size`` bytes, known afterwards by ``key``."""
        if key in self._live:
            self.free(key)
        size = round_size(size)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size)
        if block is None:
            grown = segment_size(size)
            block = _Block(self._next_address, grown, small)
            self._next_address += grown
            self.reserved += grown
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.address + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        """Return ``key``'s block to its pool, merged with the free blocks beside it; unknown keys
        (tensors that were never on the device) are ignored."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                block = first
        self._insert(block)

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        pool = self._pools[small]
        at = bisect.bisect_left(pool, (size, -1))
        if at == len(pool):
            return None
        return pool.pop(at)[2]

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.address, block))

    def _remove(self, block: _Block) -> None:
        pool = self._pools[block.small]
        at = bisect.bisect_left(pool, (block.size, block.address))
        assert pool[at][2] is block
        del pool[at]


def follow(tracker: Any, host: Collection[object] = ()) -> CachingAllocator:
    """A :class:`CachingAllocator` fed by torch's memory ``tracker``: each storage it tracks already
    or starts tracking is a ``malloc``, each it stops tracking a ``free``, a resize both. Storages
    whose role is in ``host`` (an offload plan's sharded state) stay off the device."""
    allocator = CachingAllocator()
    update: Callable[..., None] = tracker._update_snap
    on_device: set[int] = set()

    def place(winfo: Any) -> None:
        key = id(winfo)
        if winfo.reftype in host or winfo.mem_consumed <= 0:
            if key in on_device:
                on_device.discard(key)
                allocator.free(key)
            return
        on_device.add(key)
        allocator.malloc(key, winfo.mem_consumed)

    def snap(u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
        update(u_type, winfo, *args, **kwargs)
        kind = getattr(u_type, "name", "")
        if kind == "DEL":
            if id(winfo) in on_device:
                on_device.discard(id(winfo))
                allocator.free(id(winfo))
        elif kind == "ADD" or kind == "SIZE":
            place(winfo)
        elif kind == "REF" and (id(winfo) in on_device) == (winfo.reftype in host):
            place(winfo)  # moved between a device role and a host one

    for winfo, _ in list(tracker._WINFO.values()):  # what it tracks already (parameters, gradients)
        place(winfo)
    tracker._update_snap = snap
    return allocator
