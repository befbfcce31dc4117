"""The caching allocator's replay: torch's rules for blocks and segments, case by case and at random."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from jupyter_shard.planner.cuda_allocator import CachingAllocator, MiB, round_size, segment_size
from jupyter_shard.planner.dry_run import dry_run


def test_blocks_and_segments_follow_torchs_sizes() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513)] == [512, 512, 512, 1024]
    assert segment_size(1 * MiB) == 2 * MiB  # the small pool's segments
    assert segment_size(1 * MiB + 512) == 20 * MiB  # the large pool, under 10 MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB: its own size, rounded to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_blocks_share_a_2_mib_segment_and_reuse_what_was_freed() -> None:
    alloc = CachingAllocator()
    for key in range(4):
        alloc.malloc(key, 256 * 1024)
    assert alloc.reserved == 2 * MiB and alloc.allocated == 1 * MiB
    alloc.free(0)
    alloc.malloc("again", 100_000)
    assert alloc.reserved == 2 * MiB  # the freed block is split, no new segment


def test_a_freed_block_too_small_for_the_next_request_leaves_a_new_segment() -> None:
    alloc = CachingAllocator()
    alloc.malloc("a", 6 * MiB)  # a 20 MiB segment: a at 0-6, 14 MiB free after it
    alloc.malloc("b", 6 * MiB)  # b at 6-12, 8 MiB free after it
    alloc.free("a")  # 6 MiB free in front, not next to the 8 MiB (b is between)
    alloc.malloc("c", 7 * MiB)  # best fit: the 8 MiB block, whole (1 MiB left is not split off)
    assert alloc.reserved == 20 * MiB
    alloc.malloc("d", 7 * MiB)  # 6 MiB and 1 MiB free, neither holds 7: a new segment
    assert alloc.reserved == 40 * MiB
    assert alloc.peak_allocated == 21 * MiB  # b, c's 8 MiB block and d
    alloc.free("b")  # merges with the 6 MiB in front: 12 MiB free
    alloc.malloc("e", 12 * MiB)  # over 10 MiB, yet held by the merged block
    assert alloc.reserved == 40 * MiB


def test_a_large_remainder_is_split_off_only_when_over_1_mib() -> None:
    alloc = CachingAllocator()
    alloc.malloc("a", 11 * MiB)  # a 12 MiB segment: 1 MiB left, not split off
    assert alloc.allocated == 12 * MiB
    alloc.malloc("b", 512)  # the small pool never takes from the large one
    assert alloc.reserved == 14 * MiB


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3), st.integers(1, 24 * MiB)), max_size=120))
def test_any_sequence_keeps_the_allocators_books(ops: list[tuple[bool, int, int]]) -> None:
    alloc = CachingAllocator()
    live: dict[int, int] = {}
    for n, (grow, shift, size) in enumerate(ops):
        size >>= shift * 4  # bytes, KiB and MiB alike
        if grow or not live:
            alloc.malloc(n, size)
            live[n] = size
        else:
            alloc.free(next(iter(live)))
            live.pop(next(iter(live)))
        assert alloc.allocated >= sum(round_size(s) for s in live.values())
        assert alloc.peak_reserved >= alloc.reserved >= alloc.allocated
    for key in list(live):
        alloc.free(key)
    assert alloc.allocated == 0
    # every segment merged back into one free block
    blocks = [b for pool in alloc._pools.values() for _, _, b in pool]
    assert sum(b.size for b in blocks) == alloc.reserved
    assert all(b.prev is None and b.next is None for b in blocks)


def test_a_cuda_plan_reserves_at_least_its_peak_and_a_cpu_plan_reserves_nothing() -> None:
    model = nn.Sequential(*(nn.Linear(700, 700) for _ in range(6)))  # 1.9 MB weights: the large pool
    cuda = dry_run(model, torch.randn(16, 700), 2, "cuda", ["ddp", "fsdp FULL_SHARD"])
    for plan in cuda.values():
        assert plan.peak_bytes <= plan.reserved_bytes < plan.peak_bytes + 64 * MiB
        assert "reserved: the step's allocations" in plan.source["device"]
    assert cuda["ddp"].reserved_bytes % (2 * MiB) == 0  # whole segments
    cpu = dry_run(model, torch.randn(16, 700), 2, "cpu", ["ddp"])
    assert cpu["ddp"].reserved_bytes == 0


def test_the_replay_sees_every_tensor_the_tracker_counts(monkeypatch: object) -> None:
    """Fed completely (parameters and gradients tracked before the replay starts included), the
    replay's peak of allocated blocks is the trace's peak."""
    import pytest

    from jupyter_shard.planner import tracing

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    seen: list[tuple[int, int]] = []
    original = tracing.with_reserved

    def spy(traced: tracing.Traced, tracker: object) -> tracing.Traced:
        seen.append((tracker.jshard_allocator.peak_allocated, traced.peak))  # type: ignore[attr-defined]
        return original(traced, tracker)

    monkeypatch.setattr(tracing, "with_reserved", spy)
    model = nn.Sequential(*(nn.Linear(700, 700) for _ in range(6)))
    dry_run(model, torch.randn(16, 700), 2, "cuda", ["ddp", "fsdp FULL_SHARD"])
    assert len(seen) == 2 and all(replayed == traced for replayed, traced in seen)
