"""The dashboard as one Plotly figure: the status table, a chart per logged scalar, memory per rank.

One figure, so a redraw is one message however many charts. Each series is read as at most
:data:`SAMPLE` evenly spaced records (``History.sampled``) and drawn as at most :data:`BINS` points,
each the mean of its bin of steps (every logged point while a series is shorter than that); the
kernel's history keeps every value. The same figure is the live view (rendered in place by the
JupyterLab extension, which keeps zoom, hidden ranks and the log switch across redraws) and, when the
cell ends, the saved ``application/vnd.plotly.v1+json`` output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jupyter_shard.notebook.charts import fmt
from jupyter_shard.pool.figures import (
    Chart,
    Figure,
    RankSeries,
    binned,
    color,
    grid_figure,
    line_traces,
    mean_across,
)
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankSnapshot

if TYPE_CHECKING:
    from jupyter_shard.pool.pool import Pool

BINS = 1000  # points drawn per series, however long it is
SAMPLE = 4 * BINS  # records read per series for a redraw: evenly spaced, the last one always
COMPACT_METRICS = 2
COLUMNS = ("rank", "state", "step", "steps/s", "memory", "heartbeat", "cell", "last line")
WIDTHS = (4, 9, 5, 5, 12, 6, 14, 20)
ROW_HEIGHT, HEADER_HEIGHT, MAX_ROWS = 20, 24, 8
# rows that need attention, by the first word of their problem (or their state): red where only a
# restart helps (dead; broken, its CUDA context lost, in a pinker red), yellow where a rank is stuck
ROW_COLORS = {"dead": "#fde2e1", "broken": "#f6d5ec", "stuck": "#fff3cd"}
CUDA_LINES: tuple[tuple[str, str, str], ...] = (
    ("cuda_allocated", "allocated", "solid"),
    ("cuda_reserved", "reserved", "dash"),
    ("cuda_peak", "peak", "dot"),
)


def metric_chart(history: History, name: str, axis: int, legend: bool) -> Chart:
    sampled = {rank: history.sampled(rank, name, SAMPLE) for rank in history.ranks}
    raw = {rank: (x, y, n) for rank, (x, y, n) in sampled.items() if len(x)}
    if not raw:
        return Chart(f"{name} (no data yet)", "step", [])
    lo = min(float(x.min()) for x, _, _ in raw.values())
    hi = max(float(x.max()) for x, _, _ in raw.values())
    series = [RankSeries(rank, *binned(x, y, lo, hi, BINS), points=n) for rank, (x, y, n) in raw.items()]
    mean = None
    if len(raw) > 1:  # over the steps every rank has reached: a rank ahead would drag the end
        common = min(float(x[-1]) for x, _, _ in raw.values())
        mean = mean_across([(x[x <= common], y[x <= common]) for x, y, _ in raw.values()], lo, common, BINS)
        title = f"{name} · mean of {len(raw)} ranks {mean[1][-1]:.4g}"
    else:
        title = f"{name} · {series[0].y[-1]:.4g}"
    return Chart(title, "step", line_traces(name, series, mean, axis=axis, legend=legend))


def memory_chart(history: History, axis: int, legend: bool) -> Chart:
    columns = {rank: history.memory_columns(rank) for rank in history.memory_ranks}
    cuda = any(bool(np.isfinite(c["cuda_allocated"]).any()) for _, c in columns.values())
    start = min((float(t[0]) for t, _ in columns.values() if len(t)), default=0.0)
    lines = CUDA_LINES if cuda else (("rss", "RSS", "solid"),)
    xref, yref = ("x", "y") if axis == 1 else (f"x{axis}", f"y{axis}")
    traces = []
    for rank, (times, values) in columns.items():
        for field, label, dash in lines:
            x, y = binned(times - start, values[field] / 2**20, 0.0, float(times[-1] - start), BINS)
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines" if len(x) > 1 else "markers",
                    "uid": f"memory:{rank}:{field}",
                    "name": f"rank {rank}",
                    "legendgroup": f"rank {rank}",
                    "showlegend": legend and field == lines[0][0],
                    "x": x,
                    "y": y,
                    "xaxis": xref,
                    "yaxis": yref,
                    "line": {"color": color(rank), "width": 1.5, "dash": dash},
                    "marker": {"color": color(rank)},
                    "meta": {"rank": rank, "points": len(times)},
                    "hovertemplate": f"rank {rank} · %{{x:.1f}} s<br>{label} %{{y:.1f}} MiB<extra></extra>",
                }
            )
    what = "CUDA allocated, reserved (dashed), peak (dotted)" if cuda else "host RSS"
    return Chart(f"memory per rank: {what}, MiB", "seconds", traces)


def status_trace(rows: list[RankSnapshot]) -> dict[str, Any]:
    """The per-rank status as a Plotly table; dead and broken ranks red (:data:`ROW_COLORS`), stuck
    ones yellow."""
    cells: list[list[str]] = [[] for _ in COLUMNS]
    fills = []
    for row in rows:
        values = (
            str(row.rank),
            row.problem or row.state.value,
            fmt(row.step) if row.step is not None else "-",
            f"{row.steps_per_s:.1f}" if row.steps_per_s is not None else "-",
            memory_text(row.memory),
            f"{row.heartbeat_age:.0f} s ago" if row.heartbeat_age is not None else "-",
            _cut(row.cell or "-", 40),
            _cut(row.last_line or "", 80),
        )
        for column, value in zip(cells, values, strict=True):
            column.append(_plain(value))
        fills.append(ROW_COLORS.get(row_kind(row), "#ffffff"))
    return {
        "type": "table",
        "uid": "status",
        "columnwidth": list(WIDTHS),
        "header": {
            "values": [f"<b>{c}</b>" for c in COLUMNS],
            "align": "left",
            "fill": {"color": "#f3f3f3"},
            "font": {"size": 11},
            "height": HEADER_HEIGHT,
        },
        "cells": {
            "values": cells,
            "align": "left",
            "fill": {"color": [fills] * len(COLUMNS)},
            "font": {"size": 11},
            "height": ROW_HEIGHT,
        },
    }


def row_kind(row: RankSnapshot) -> str:
    """What a status row is tinted by: its problem's first word (``dead``, ``broken``, ``stuck``), else
    its state."""
    return row.problem.split(":", 1)[0] or row.state.value


def memory_text(memory: dict[str, int]) -> str:
    if not memory:
        return "-"
    text = f"{memory.get('rss', 0) / 2**20:.0f} MiB"
    if "cuda_allocated" in memory:
        text += (
            f" · cuda {memory['cuda_allocated'] / 2**20:.0f} / {memory.get('cuda_reserved', 0) / 2**20:.0f}"
            f" / peak {memory.get('cuda_peak', 0) / 2**20:.0f} MiB"
        )
    return text


def dashboard_figure(pool: Pool, *, compact: bool) -> Figure:
    """The whole dashboard of ``pool`` as one figure (arrays still numpy: see ``figures.encode``)."""
    history = pool.history
    names = history.metrics[:COMPACT_METRICS] if compact else history.metrics
    charts = [metric_chart(history, name, i + 1, i == 0) for i, name in enumerate(names)]
    charts.append(memory_chart(history, len(charts) + 1, not charts))
    rows = pool.activity()
    title = pool.spec.describe()
    run = pool.background
    if run is not None and run.running:
        title += f" · {run.describe()}"
    if history.thinned:
        title += " · older points thinned 2:1 to bound memory"
    table_height = HEADER_HEIGHT + (ROW_HEIGHT + 6) * max(1, min(len(rows), MAX_ROWS)) + 8
    figure = grid_figure(charts, columns=2, title=title, table=status_trace(rows), table_height=table_height)
    figure["layout"]["meta"] = {"jupyter_shard": "dashboard", "metrics": names}
    return figure


def _cut(text: str, size: int) -> str:
    return text if len(text) <= size else text[: size - 1] + "…"


def _plain(text: str) -> str:
    """Plotly reads a few HTML tags in table text: rank output must show as typed."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
