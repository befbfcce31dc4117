"""Every scalar the ranks passed to ``shard.log``, kept in the kernel, plus each rank's memory over time.

Records are stored by column (one ``array('d')`` per rank for steps, times and each metric name), so a
million logged points cost about 8 bytes per value rather than a dict each. Memory stays bounded: a
rank past :data:`RECORD_LIMIT` records has its older half thinned to every other record (recent data
stays at full resolution; :attr:`History.thinned` says it happened). :meth:`History.sampled` gives the
dashboard a few thousand evenly spaced records per series however long the run, and :meth:`History.plot`
a Plotly figure of any metrics.
"""

from __future__ import annotations

import csv
import math
import os
import threading
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

import numpy as np

from jupyter_shard._util.atomic import write_atomic
from jupyter_shard.pool.figures import Floats, binned, mean_across, plot_history

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["History", "binned", "mean_across"]

RECORD_LIMIT = 2_000_000
MEMORY_SAMPLES = 20_000
THROUGHPUT_WINDOW = 5.0
MEMORY_FIELDS = ("rss", "cuda_allocated", "cuda_reserved", "cuda_peak")


class _RankColumns:
    """One rank's records: steps, wall times and one column per metric (NaN where not logged)."""

    def __init__(self) -> None:
        self.steps = array("d")
        self.times = array("d")
        self.values: dict[str, array[float]] = {}

    def __len__(self) -> int:
        return len(self.steps)

    def extend(self, steps: array[float], times: array[float], values: Mapping[str, array[float]]) -> None:
        """Add ``len(steps)`` records; a metric not in ``values`` is NaN for them."""
        before, added = len(self.steps), len(steps)
        for name, column in values.items():
            if name not in self.values:
                self.values[name] = array("d", [math.nan]) * before
            self.values[name].extend(column)
        for name, column in self.values.items():
            if name not in values:
                column.extend(array("d", [math.nan]) * added)
        self.steps.extend(steps)
        self.times.extend(times)

    def thin(self) -> None:
        """Keep every other record of the older half."""
        half = len(self.steps) // 2
        for col in (self.steps, self.times, *self.values.values()):
            col[:] = col[0:half:2] + col[half:]


class History:
    """Logged metrics (``jupyter_shard.history()``) and memory samples of a pool's ranks.

    Iterating gives records ``{"rank", "step", "time", <metric>: value, ...}`` in arrival order per
    rank; :meth:`to_csv` writes them; :meth:`series` gives one metric of one rank as numpy arrays.
    """

    def __init__(self, record_limit: int = RECORD_LIMIT) -> None:
        self.record_limit = record_limit
        self.thinned = False
        self.version = 0  # grows with every logged batch; the dashboard redraws soon when it moved
        self._ranks: dict[int, _RankColumns] = {}
        self._memory: dict[int, deque[tuple[float, ...]]] = {}
        self._lock = threading.Lock()

    # -- writing (the pool's receiving thread) ------------------------------------------------------

    def extend(self, rank: int, records: Iterable[Mapping[str, Any]]) -> None:
        """Add ``shard.log`` records ``{"step", "ts", "values"}`` of one rank (one per call)."""
        for record in records:
            values = {name: array("d", [float(v)]) for name, v in record["values"].items()}
            step, ts = array("d", [float(record["step"])]), array("d", [float(record["ts"])])
            self.extend_columns(rank, step, ts, values)

    def extend_columns(
        self, rank: int, steps: array[float], times: array[float], values: Mapping[str, array[float]]
    ) -> None:
        """Add a batch of records as columns (what the ranks send): steps, wall times, values by name."""
        with self._lock:
            columns = self._ranks.setdefault(rank, _RankColumns())
            columns.extend(steps, times, values)
            while len(columns) > self.record_limit:
                columns.thin()
                self.thinned = True
            self.version += 1

    def add_memory(self, rank: int, ts: float, memory: Mapping[str, int]) -> None:
        """One heartbeat's memory: host RSS and (on GPU) CUDA allocated, reserved and peak bytes."""
        row = (ts, float(memory.get("rss", 0)), *(float(memory.get(k, math.nan)) for k in MEMORY_FIELDS[1:]))
        with self._lock:
            samples = self._memory.setdefault(rank, deque(maxlen=MEMORY_SAMPLES))
            samples.append(row)

    def clear(self) -> None:
        with self._lock:
            self._ranks.clear()
            self._memory.clear()
            self.thinned = False
            self.version += 1

    # -- reading ---------------------------------------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    @property
    def metrics(self) -> list[str]:
        """Metric names in the order they were first logged."""
        with self._lock:
            names: dict[str, None] = {}
            for columns in self._ranks.values():
                names.update(dict.fromkeys(columns.values))
            return list(names)

    def __len__(self) -> int:
        return sum(len(c) for c in self._ranks.values())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records())

    def __repr__(self) -> str:
        return f"<History: {len(self)} records from {len(self._ranks)} ranks; metrics {self.metrics}>"

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            out: list[dict[str, Any]] = []
            for rank in sorted(self._ranks):
                columns = self._ranks[rank]
                for i in range(len(columns)):
                    record: dict[str, Any] = {"rank": rank, "step": _int(columns.steps[i])}
                    record["time"] = columns.times[i]
                    for name, column in columns.values.items():
                        if not math.isnan(column[i]):
                            record[name] = column[i]
                    out.append(record)
            return out

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write every record (columns rank, step, time and one per metric); written atomically."""
        names = self.metrics

        def write(fh: TextIO) -> None:
            writer = csv.DictWriter(fh, fieldnames=["rank", "step", "time", *names], restval="")
            writer.writeheader()
            writer.writerows(self.records())

        return write_atomic(path, write)

    def series(self, rank: int, name: str) -> tuple[Floats, Floats]:
        """``(steps, values)`` of one metric of one rank, without the records that lack it."""
        with self._lock:
            columns = self._ranks.get(rank)
            if columns is None or name not in columns.values:
                return np.empty(0), np.empty(0)
            steps = np.array(columns.steps, dtype=np.float64)
            values = np.array(columns.values[name], dtype=np.float64)
        keep = np.isfinite(values)
        return steps[keep], values[keep]

    def sampled(
        self, rank: int, name: str, at_most: int, x: Literal["step", "time"] = "step"
    ) -> tuple[Floats, Floats, int]:
        """``series`` thinned to at most ``at_most`` evenly spaced records (the last one always kept),
        and how many records hold the metric: what a chart of a few hundred bins needs, without
        copying millions of records at every redraw. ``x="time"`` gives wall times instead of steps;
        ``at_most=0`` keeps every record."""
        with self._lock:
            columns = self._ranks.get(rank)
            if columns is None or name not in columns.values or not len(columns):
                return np.empty(0), np.empty(0), 0
            # views pin the arrays' buffers (an extend meanwhile raises BufferError): they are
            # dropped before the lock is released
            steps = np.frombuffer(columns.steps if x == "step" else columns.times, dtype=np.float64)
            values = np.frombuffer(columns.values[name], dtype=np.float64)
            keep = np.flatnonzero(np.isfinite(values))
            total = len(keep)
            if total > at_most > 0:
                last = keep[-1]
                keep = keep[:: -(-total // at_most)]
                if keep[-1] != last:
                    keep = np.append(keep[:-1], last)
            picked = steps[keep], values[keep]
            del steps, values
        return picked[0], picked[1], total

    def last_value(self, rank: int, name: str) -> float | None:
        """The rank's latest logged value of ``name`` (None before one), without copying the series."""
        with self._lock:
            columns = self._ranks.get(rank)
            column = columns.values.get(name, array("d")) if columns is not None else array("d")
            for i in range(len(column) - 1, -1, -1):
                if not math.isnan(column[i]):
                    return column[i]
        return None

    def count(self, rank: int, name: str) -> int:
        steps, _ = self.series(rank, name)
        return len(steps)

    def last(self, rank: int) -> tuple[float, float] | None:
        """``(step, wall time)`` of the rank's last record."""
        columns = self._ranks.get(rank)
        if columns is None or not len(columns):
            return None
        return columns.steps[-1], columns.times[-1]

    def throughput(self, rank: int, now: float) -> float | None:
        """Steps per second over the last few seconds (None before two records)."""
        with self._lock:
            columns = self._ranks.get(rank)
            if columns is None or len(columns) < 2 or now - columns.times[-1] > THROUGHPUT_WINDOW:
                return None
            times = np.frombuffer(columns.times, dtype=np.float64)
            first = int(np.searchsorted(times, columns.times[-1] - THROUGHPUT_WINDOW))
            # the view pins the array's buffer (an extend meanwhile raises BufferError): drop it
            # before the lock is released, not when the frame goes
            del times
            first = min(first, len(columns) - 2)
            span = columns.times[-1] - columns.times[first]
            return (columns.steps[-1] - columns.steps[first]) / span if span > 0 else None

    def memory(self, rank: int) -> tuple[Floats, Floats, Floats]:
        """``(wall times, rss bytes, cuda allocated bytes or NaN)`` of the rank's heartbeats."""
        times, columns = self.memory_columns(rank)
        return times, columns["rss"], columns["cuda_allocated"]

    def memory_columns(self, rank: int) -> tuple[Floats, dict[str, Floats]]:
        """Wall times of the rank's heartbeats and, by name (:data:`MEMORY_FIELDS`), bytes or NaN."""
        with self._lock:
            samples = list(self._memory.get(rank, ()))
        data = np.array(samples, dtype=np.float64).reshape(-1, 1 + len(MEMORY_FIELDS))
        return data[:, 0], {name: data[:, i + 1] for i, name in enumerate(MEMORY_FIELDS)}

    def plot(
        self,
        *metrics: str,
        smooth: float = 0.0,
        x: Literal["step", "time"] = "step",
        points: int | None = 10_000,
    ) -> go.Figure:
        """A ``plotly.graph_objects.Figure``: a chart per metric (all by default), a line per rank and
        their mean. ``smooth`` in [0, 1) is an exponential moving average's weight (0: raw values);
        ``x="time"`` plots against seconds since the first record; each line holds at most ``points``
        evenly spaced records (``None``: every one)."""
        return plot_history(self, metrics, smooth=smooth, x=x, points=points)

    @property
    def memory_ranks(self) -> list[int]:
        return sorted(self._memory)


def _int(step: float) -> int | float:
    return int(step) if step.is_integer() else step
