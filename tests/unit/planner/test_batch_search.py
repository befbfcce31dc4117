"""The largest-batch search: always the exact boundary, in few dry runs when the peak is a line."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_shard.planner.batch_search import largest_batch
from jupyter_shard.planner.plan import Plan


def plan_of(peak: int) -> Plan:
    return Plan("ddp", {}, 2, "cuda", peak, 0, 0, 0, 0, 0)


class Counted:
    """A measure from a peak function, counting the sizes it was asked for."""

    def __init__(self, peak: Callable[[int], int]) -> None:
        self.peak = peak
        self.sizes: list[int] = []

    def __call__(self, size: int) -> Plan:
        assert size not in self.sizes, f"size {size} measured twice"
        self.sizes.append(size)
        return plan_of(self.peak(size))


def exact(peak: Callable[[int], int], budget: int, most: int) -> int:
    return max((s for s in range(1, most + 1) if peak(s) <= budget), default=0)


@settings(max_examples=300, deadline=None)
@given(
    base=st.integers(0, 10**9),
    slope=st.integers(1, 10**7),
    curve=st.integers(0, 10**4),
    step=st.integers(0, 10**8),
    every=st.integers(1, 64),
    budget=st.integers(1, 2 * 10**9),
    most=st.integers(1, 5000),
)
def test_the_answer_is_the_largest_size_that_fits_for_any_growing_peak(
    base: int, slope: int, curve: int, step: int, every: int, budget: int, most: int
) -> None:
    def peak(size: int) -> int:  # a line, a quadratic bend and stairs (allocator blocks)
        return base + slope * size + curve * size * size + step * (size // every)

    measure = Counted(peak)
    size, plan = largest_batch(measure, budget, most)
    assert size == exact(peak, budget, most)
    if size:
        assert plan is not None and plan.peak_bytes == peak(size) <= budget
        assert size == most or (size + 1) in measure.sizes  # the size above was measured not to fit
    else:
        assert plan is None and measure.sizes == [1]


def test_a_straight_line_takes_four_dry_runs_where_doubling_and_bisecting_took_ten() -> None:
    measure = Counted(lambda size: 1000 + 100 * size)
    assert largest_batch(measure, 1000 + 100 * 19, 1 << 24)[0] == 19
    assert measure.sizes == [1, 2, 19, 20]


def test_a_line_that_bends_upward_still_ends_on_the_boundary() -> None:
    def peak(size: int) -> int:
        return 100 * size + (0 if size < 50 else 10**6)  # linear, then a cliff past 49

    measure = Counted(peak)
    assert largest_batch(measure, 100 * 1000, 1 << 24)[0] == 49
    assert len(measure.sizes) <= 16


def test_nothing_fits_and_the_range_ends() -> None:
    assert largest_batch(Counted(lambda size: 10 * size), 5, 100) == (0, None)
    measure = Counted(lambda size: size)
    size, plan = largest_batch(measure, 10**9, 100)
    assert size == 100 and plan is not None and plan.peak_bytes == 100
