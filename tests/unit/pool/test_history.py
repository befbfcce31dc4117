"""The kernel's metrics store: records by column, bounded memory, binning for display."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jupyter_shard.pool.history import History, binned, mean_across


def _log(h: History, rank: int, n: int, start: int = 1, **extra: float) -> None:
    h.extend(
        rank,
        [
            {"step": s, "ts": 1000.0 + s, "values": {"loss": 1.0 / s, **extra}}
            for s in range(start, start + n)
        ],
    )


def test_records_come_back_per_rank_with_only_the_metrics_logged() -> None:
    h = History()
    h.extend(
        0, [{"step": 1, "ts": 10.0, "values": {"loss": 0.5}}, {"step": 2, "ts": 11.0, "values": {"acc": 0.9}}]
    )
    h.extend(1, [{"step": 1, "ts": 10.5, "values": {"loss": 0.25, "acc": 0.8}}])
    assert h.records() == [
        {"rank": 0, "step": 1, "time": 10.0, "loss": 0.5},
        {"rank": 0, "step": 2, "time": 11.0, "acc": 0.9},
        {"rank": 1, "step": 1, "time": 10.5, "loss": 0.25, "acc": 0.8},
    ]
    assert h.metrics == ["loss", "acc"] and len(h) == 3
    steps, values = h.series(0, "acc")
    assert steps.tolist() == [2.0] and values.tolist() == [0.9]
    assert h.series(5, "loss")[0].size == 0


def test_to_csv_writes_every_record_atomically(tmp_path: Path) -> None:
    h = History()
    _log(h, 0, 3)
    _log(h, 1, 2, lr=0.1)
    path = h.to_csv(tmp_path / "m.csv")
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 5 and rows[0].keys() == {"rank", "step", "time", "loss", "lr"}
    assert rows[0]["lr"] == "" and rows[3]["lr"] == "0.1"
    assert [p.name for p in tmp_path.iterdir()] == ["m.csv"]


def test_memory_stays_bounded_by_thinning_the_older_half() -> None:
    h = History(record_limit=1000)
    for start in range(1, 5001, 50):  # batches as the ranks send them
        _log(h, 0, 50, start=start)
    assert len(h) <= 1000 and h.thinned
    steps, _ = h.series(0, "loss")
    assert steps[-1] == 5000 and steps[0] == 1
    assert np.all(np.diff(steps) > 0)
    recent = steps[-300:]
    assert np.all(np.diff(recent) == 1), "recent records must stay at full resolution"


def test_throughput_is_steps_per_second_over_the_last_seconds() -> None:
    h = History()
    h.extend(0, [{"step": s, "ts": 100.0 + s * 0.1, "values": {"loss": 1.0}} for s in range(100)])
    rate = h.throughput(0, now=100.0 + 99 * 0.1)
    assert rate == pytest.approx(10.0)
    assert h.throughput(0, now=200.0) is None  # nothing logged lately


def test_binned_keeps_short_series_and_means_long_ones() -> None:
    x = np.arange(10, dtype=float)
    assert binned(x, x, 0, 9, 300)[0] is x
    x = np.arange(100_000, dtype=float)
    bx, by = binned(x, 2 * x, 0, 99_999, 300)
    assert len(bx) <= 300 and np.allclose(by, 2 * bx)


def test_mean_across_ranks_is_exact_per_step_when_short() -> None:
    a = (np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0]))
    b = (np.array([1.0, 2.0]), np.array([3.0, 4.0]))
    steps, mean = mean_across([a, b], 1, 3, 300)
    assert steps.tolist() == [1.0, 2.0, 3.0] and mean.tolist() == [2.0, 3.0, 3.0]


def test_mean_across_long_series_weights_each_rank_equally() -> None:
    x = np.arange(50_000, dtype=float)
    steps, mean = mean_across([(x, np.zeros_like(x)), (x[::5], np.full(10_000, 4.0))], 0, 49_999, 200)
    assert len(steps) <= 200 and np.allclose(mean, 2.0)


def test_memory_samples_keep_cuda_as_nan_on_cpu() -> None:
    h = History()
    h.add_memory(0, 5.0, {"rss": 100})
    h.add_memory(0, 6.0, {"rss": 200, "cuda_allocated": 50})
    t, rss, cuda = h.memory(0)
    assert t.tolist() == [5.0, 6.0] and rss.tolist() == [100.0, 200.0]
    assert math.isnan(cuda[0]) and cuda[1] == 50.0


def _columns(h: History, rank: int, n: int, every: int = 1, offset: int = 0) -> None:
    """``n`` records logged as a batch; ``loss`` only on records ``offset``, ``offset + every``, …"""
    from array import array

    steps = np.arange(n, dtype=np.float64)
    loss = np.full(n, math.nan)
    loss[offset::every] = steps[offset::every] * 2.0
    h.extend_columns(rank, array("d", steps), array("d", steps + 1000.0), {"loss": array("d", loss)})


def test_sampled_reads_evenly_spaced_records_and_keeps_the_last() -> None:
    h = History()
    _columns(h, 0, 1_000_000)
    steps, values, total = h.sampled(0, "loss", 4800)
    assert total == 1_000_000 and 4000 <= len(steps) <= 4800
    assert steps[0] == 0 and steps[-1] == 999_999 and values[-1] == 2 * 999_999
    gaps = np.diff(steps[:-1])
    assert gaps.min() == gaps.max()  # one stride
    assert np.array_equal(values, steps * 2.0)
    small, _, count = h.sampled(0, "loss", 2_000_000)
    assert count == len(small) == 1_000_000


def test_sampled_never_misses_a_sparse_metric() -> None:
    """A metric on every 100th record, off the stride a plain step slice would take."""
    h = History()
    _columns(h, 0, 1_000_000, every=100, offset=7)
    steps, values, total = h.sampled(0, "loss", 4800)
    assert total == 10_000 and 0 < len(steps) <= 4800
    assert np.isfinite(values).all() and (steps % 100 == 7).all()
    assert steps[-1] == 999_907
    assert h.sampled(0, "missing", 10)[2] == 0 and h.sampled(3, "loss", 10)[2] == 0


def test_reads_release_their_views_of_the_columns_with_the_lock() -> None:
    """numpy views on the columns block their growth (BufferError in the receiving thread): a read
    must drop them before its lock is released, when a writer may take it."""
    h = History()
    _columns(h, 0, 1000)
    columns = h._ranks[0]
    resized: list[str] = []

    class Probe:
        """In place of the lock: on release, grow every column as a writer would."""

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            for column in (columns.steps, columns.times, *columns.values.values()):
                column.append(0.0)  # raises BufferError while a view is alive
                column.pop()
            resized.append("ok")

    h._lock = Probe()  # type: ignore[assignment]
    h.sampled(0, "loss", 300)
    h.throughput(0, 2000.0)
    assert resized == ["ok", "ok"]


def test_plot_is_a_plotly_figure_with_a_line_per_rank_and_the_mean() -> None:
    import plotly.graph_objects as go

    h = History()
    _log(h, 0, 50, lr=0.1)
    _log(h, 1, 50, lr=0.2)
    fig = h.plot()
    assert isinstance(fig, go.Figure)
    assert [(t.name, t.yaxis, len(t.x)) for t in fig.data] == [
        ("rank 0", "y", 50), ("rank 1", "y", 50), ("mean", "y", 50),
        ("rank 0", "y2", 50), ("rank 1", "y2", 50), ("mean", "y2", 50),
    ]  # fmt: skip
    assert fig.data[-1].y[0] == pytest.approx(0.15)  # mean lr of the two ranks
    assert fig.layout.xaxis.title.text == "step" and fig.layout.uirevision == "jupyter_shard"
    only_loss = h.plot("loss", points=10)
    assert len(only_loss.data) == 3 and len(only_loss.data[0].x) == 10 and only_loss.data[0].x[-1] == 50


def test_plot_smooths_and_plots_against_time() -> None:
    h = History()
    h.extend(0, [{"step": s, "ts": 500.0 + s / 10, "values": {"loss": float(s % 2)}} for s in range(1000)])
    raw = h.plot("loss")
    smooth = h.plot("loss", smooth=0.9)
    assert np.ptp(np.asarray(raw.data[0].y)[-100:]) == 1.0
    assert np.ptp(np.asarray(smooth.data[0].y)[-100:]) < 0.2  # around 0.5, no longer 0/1
    assert smooth.data[0].y[0] == 0.0, "the average is bias-corrected: it starts at the first value"
    by_time = h.plot("loss", x="time")
    assert by_time.data[0].x[0] == 0.0 and by_time.data[0].x[-1] == pytest.approx(99.9)
    assert by_time.layout.xaxis.title.text == "seconds"


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("acc",), {}, "no metric 'acc' in the history; logged: loss"),
        ((), {"smooth": 1.0}, "smooth=1.0: use a weight in [0, 1)"),
        ((), {"x": "epoch"}, "x='epoch': use x='step' or x='time'"),
        ((), {"points": 0}, "points=0: use a positive count, or None"),
    ],
)
def test_plot_says_what_is_wrong(args: tuple[str, ...], kwargs: dict[str, Any], message: str) -> None:
    h = History()
    _log(h, 0, 5)
    with pytest.raises(ValueError, match=re.escape(message)):
        h.plot(*args, **kwargs)
    with pytest.raises(ValueError, match="nothing is logged yet"):
        History().plot()


def test_memory_keeps_cuda_reserved_and_peak() -> None:
    h = History()
    h.add_memory(0, 5.0, {"rss": 100, "cuda_allocated": 10, "cuda_reserved": 20, "cuda_peak": 30})
    times, columns = h.memory_columns(0)
    assert times.tolist() == [5.0]
    assert {k: v.tolist() for k, v in columns.items()} == {
        "rss": [100.0], "cuda_allocated": [10.0], "cuda_reserved": [20.0], "cuda_peak": [30.0],
    }  # fmt: skip
    assert h.memory_columns(3)[0].size == 0
    assert h.last_value(0, "loss") is None
