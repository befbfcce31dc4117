"""The largest batch that fits: a search over dry runs that aims where the peak's line says.

Why it exists: a dry run of a large model takes seconds, and the largest batch under a memory budget
took one per step of a doubling-then-bisecting search (10 dry runs for a batch of 19). A training
step's peak grows with the batch along a nearly straight line (activations and temporaries scale with
it; parameters and optimizer state do not), so the size that line predicts from two measured sizes
is usually the answer or next to it. Each guess is still measured, and the answer is only returned
once the size above it has been measured not to fit: the line saves dry runs, it never decides.
When the line is off (a peak that grows faster than the batch), the search falls back to doubling
and bisecting between the sizes measured.
"""

from __future__ import annotations

from collections.abc import Callable

from jupyter_shard.planner.plan import Plan

#: guesses from the line before the search only doubles and bisects
GUESSES = 4


def largest_batch(measure: Callable[[int], Plan], budget: int, most: int) -> tuple[int, Plan | None]:
    """The largest size from 1 to ``most`` whose ``measure(size).peak_bytes`` is within ``budget``,
    with its plan; ``(0, None)`` when size 1 does not fit. ``measure`` runs at most once per size and
    the peak is taken to grow with the size."""
    peaks: dict[int, Plan] = {}

    def fits(size: int) -> bool:
        if size not in peaks:
            peaks[size] = measure(size)
        return peaks[size].peak_bytes <= budget

    if not fits(1):
        return 0, None
    good, bad = 1, most + 1  # good fits; bad does not, or is past the range
    guesses = 0
    while bad - good > 1:
        size = _guess(peaks, good, bad, budget) if guesses < GUESSES else None
        guesses += 1
        if size is None:
            size = good * 2 if bad > most else (good + bad) // 2
            size = min(size, most) if bad > most else size
        if fits(size):
            good = size
        else:
            bad = size
    return good, peaks[good]


def _guess(peaks: dict[int, Plan], good: int, bad: int, budget: int) -> int | None:
    """The size the line through the two measured sizes nearest the boundary says fits last, moved
    inside ``(good, bad)``; None where no line can be drawn (one size measured, a flat peak)."""
    below = sorted(s for s in peaks if s <= good)
    if len(below) >= 2:
        low, high = below[-2], below[-1]
    elif bad in peaks:
        low, high = good, bad
    else:
        return good + 1  # a second point for the line: the size next to the one that fits
    slope = (peaks[high].peak_bytes - peaks[low].peak_bytes) / (high - low)
    if slope <= 0:
        return None
    predicted = good + int((budget - peaks[good].peak_bytes) // slope)
    return min(max(predicted, good + 1), bad - 1)
