"""The dashboard as one Plotly figure: the status table, a chart per logged scalar, memory per rank.

One figure, so a redraw is one message however many charts. Each series is read as at most
:data:`SAMPLE` evenly spaced records (``History.sampled``) and drawn as at most :data:`BINS` points,
each the mean of its bin of steps (every logged point while a series is shorter than that); the
kernel's history keeps every value. The same figure is the live view (rendered in place by the
JupyterLab extension, which keeps zoom, hidden ranks and the log switch across redraws) and, when the
cell ends, the saved ``application/vnd.plotly.v1+json`` output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from jupyter_shard.notebook.charts import fmt
from jupyter_shard.pool.figures import (
    Chart,
    Figure,
    RankSeries,
    band_across,
    band_traces,
    binned,
    color,
    grid_figure,
    line_traces,
    mean_across,
    trace_uid,
)
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankSnapshot
from jupyter_shard.spec import format_ranks

if TYPE_CHECKING:
    from jupyter_shard.pool.pool import Pool

BINS = 1000  # points drawn per series, however long it is
BAND_FROM = 9  # ranks from which a chart draws the mean and a min–max band, and only the strays alone
TROUBLE_ROWS = 8  # ranks in trouble shown a row each; past that, a row per kind of trouble
STRAYS = 3  # ranks drawn on their own in a banded chart: a NaN, the slowest, the furthest from the mean
SAMPLE = 4 * BINS  # records read per series for a redraw: evenly spaced, the last one always
COMPACT_METRICS = 2
COLUMNS = ("rank", "state", "step", "steps/s", "memory", "heartbeat", "cell", "last line")
WIDTHS = (7, 10, 5, 6, 9, 8, 13, 16)  # a row of many ranks ("0-4,6-1023", "running (1023)") on one line
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
    if len(raw) >= BAND_FROM:
        return _banded_chart(name, raw, lo, hi, axis, legend)
    series = [RankSeries(rank, *binned(x, y, lo, hi, BINS), points=n) for rank, (x, y, n) in raw.items()]
    mean = None
    if len(raw) > 1:  # over the steps every rank has reached: a rank ahead would drag the end
        common = min(float(x[-1]) for x, _, _ in raw.values())
        mean = mean_across([(x[x <= common], y[x <= common]) for x, y, _ in raw.values()], lo, common, BINS)
        title = f"{name} · mean of {len(raw)} ranks {mean[1][-1]:.4g}"
    else:
        title = f"{name} · {series[0].y[-1]:.4g}"
    return Chart(title, "step", line_traces(name, series, mean, axis=axis, legend=legend))


def _banded_chart(
    name: str, raw: dict[int, tuple[Any, Any, int]], lo: float, hi: float, axis: int, legend: bool
) -> Chart:
    """Many ranks: their mean, their min–max band, and only the ranks that stray as lines."""
    common = min(float(x[-1]) for x, _, _ in raw.values())
    pairs = [(x[x <= common], y[x <= common]) for x, y, _ in raw.values()]
    mean = mean_across(pairs, lo, common, BINS)
    band = band_across([(x, y) for x, y, _ in raw.values()], lo, hi, BINS)
    why = strays({rank: (float(x[-1]), float(y[-1])) for rank, (x, y, _) in raw.items()})
    series = [
        RankSeries(rank, *binned(raw[rank][0], raw[rank][1], lo, hi, BINS), points=raw[rank][2])
        for rank in why
    ]
    traces = band_traces(name, band, len(raw), axis=axis, legend=legend, x_label="step")
    traces += line_traces(name, series, mean, axis=axis, legend=legend, why=why)
    last = f"{mean[1][-1]:.4g}" if len(mean[1]) else "-"
    return Chart(f"{name} · mean of {len(raw)} ranks {last}", "step", traces)


def strays(last: dict[int, tuple[float, float]], at_most: int = STRAYS) -> dict[int, str]:
    """The ranks worth a line of their own among many, by their last ``(step, value)``: those with a
    NaN or infinite value, the slowest (furthest behind in step), then the furthest from the others'
    mean (``highest`` or ``lowest`` at the ends, else ``high`` or ``low``); at most ``at_most``, by rank
    within each kind."""
    out: dict[int, str] = {}
    for rank in sorted(last):
        if not np.isfinite(last[rank][1]) and len(out) < at_most:
            out[rank] = "nan" if np.isnan(last[rank][1]) else "inf"
    steps = [step for step, _ in last.values()]
    slowest = min(last, key=lambda k: (last[k][0], k))
    if min(steps) < max(steps) and slowest not in out and len(out) < at_most:
        out[slowest] = "slowest"
    values = {k: v for k, (_, v) in last.items() if np.isfinite(v)}
    if len(values) > 1:
        centre = float(np.mean(list(values.values())))
        top, bottom = max(values.values()), min(values.values())
        for rank in sorted(values, key=lambda k: (-abs(values[k] - centre), k)):
            if len(out) >= at_most:
                break
            if rank not in out and values[rank] != centre:  # "highest" and "lowest" only at the ends
                above = values[rank] > centre
                out[rank] = (
                    ("highest" if values[rank] == top else "high")
                    if above
                    else ("lowest" if values[rank] == bottom else "low")
                )
    return out


def memory_chart(history: History, axis: int, legend: bool) -> Chart:
    columns = {rank: history.memory_columns(rank) for rank in history.memory_ranks}
    cuda = any(bool(np.isfinite(c["cuda_allocated"]).any()) for _, c in columns.values())
    start = min((float(t[0]) for t, _ in columns.values() if len(t)), default=0.0)
    lines = CUDA_LINES if cuda else (("rss", "RSS", "solid"),)
    xref, yref = ("x", "y") if axis == 1 else (f"x{axis}", f"y{axis}")
    if len(columns) >= BAND_FROM:
        return _banded_memory(columns, cuda, start, axis, legend)
    traces = []
    for rank, (times, values) in columns.items():
        for field, label, dash in lines:
            x, y = binned(times - start, values[field] / 2**20, 0.0, float(times[-1] - start), BINS)
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines" if len(x) > 1 else "markers",
                    "uid": trace_uid("memory", rank, field),
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


def _banded_memory(
    columns: dict[int, tuple[Any, dict[str, Any]]], cuda: bool, start: float, axis: int, legend: bool
) -> Chart:
    """Many ranks' memory: the mean and min–max band of one figure (CUDA allocated, else RSS) over
    time, and the rank using the most drawn on its own."""
    field, label = ("cuda_allocated", "CUDA allocated") if cuda else ("rss", "host RSS")
    series = {
        rank: (times - start, values[field] / 2**20)
        for rank, (times, values) in columns.items()
        if len(times)
    }
    end = max((float(t[-1]) for t, _ in series.values()), default=0.0)
    bins = 200
    band = band_across(list(series.values()), 0.0, end, bins, always_bin=True)
    mean = mean_across(list(series.values()), 0.0, end, bins, always_bin=True)
    top = max(series, key=lambda k: (float(np.nanmax(series[k][1])) if len(series[k][1]) else -1.0, -k))
    top_series = RankSeries(top, *binned(*series[top], 0.0, end, BINS), points=len(series[top][0]))
    traces = band_traces("memory", band, len(series), axis=axis, legend=legend, x_label="s")
    traces += line_traces(
        "memory", [top_series], mean, axis=axis, x_label="s", legend=legend, why={top: "most"}
    )
    # short enough to clear the linear/log switch at two charts a row (the legend names the band)
    return Chart(f"{label}, MiB · {len(series)} ranks", "seconds", traces)


def status_trace(rows: list[RankSnapshot]) -> dict[str, Any]:
    """The per-rank status as a Plotly table; dead and broken ranks red (:data:`ROW_COLORS`), stuck
    ones yellow."""
    cells: list[list[str]] = [[] for _ in COLUMNS]
    fills = []
    for values, kind in status_rows(rows):
        for column, value in zip(cells, values, strict=True):
            column.append(_plain(value))
        fills.append(ROW_COLORS.get(kind, "#ffffff"))
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


def _row_values(row: RankSnapshot, cut: bool) -> tuple[str, ...]:
    return (
        str(row.rank),
        row.problem or row.state.value,
        fmt(row.step) if row.step is not None else "-",
        f"{row.steps_per_s:.1f}" if row.steps_per_s is not None else "-",
        memory_text(row.memory),
        f"{row.heartbeat_age:.0f} s ago" if row.heartbeat_age is not None else "-",
        _cut(row.cell or "-", 40) if cut else row.cell or "-",
        _cut(row.last_line or "", 80) if cut else row.last_line or "",
    )


def status_rows(rows: list[RankSnapshot], cut: bool = True) -> list[tuple[tuple[str, ...], str]]:
    """The status table's rows and what each is tinted by: a row per rank below BAND_FROM ranks;
    from there a row per group of :func:`row_groups` (their ranks, count, step range, throughput,
    largest memory, oldest heartbeat)."""
    if len(rows) < BAND_FROM:
        return [(_row_values(r, cut), row_kind(r)) for r in rows]
    return [
        (_row_values(members[0], cut) if alone else _group_values(members), row_kind(members[0]))
        for members, alone in row_groups(rows)
    ]


def row_groups(rows: list[RankSnapshot]) -> list[tuple[list[RankSnapshot], bool]]:
    """The rows of many ranks (the status table's, the side panel's), as ``(ranks, alone)``: the
    ranks that need attention, each alone (past TROUBLE_ROWS of them, a group per kind of trouble:
    1,024 failed ranks are not 1,024 rows), then a group per state for the others."""
    troubled = [r for r in rows if r.problem]
    if len(troubled) <= TROUBLE_ROWS:
        out = [([r], True) for r in troubled]
    else:
        out = [(members, False) for members in _by(troubled, row_kind)]
    return out + [(members, False) for members in _by([r for r in rows if not r.problem], row_kind)]


def _by(rows: list[RankSnapshot], kind: Callable[[RankSnapshot], str]) -> list[list[RankSnapshot]]:
    groups: dict[str, list[RankSnapshot]] = {}
    for r in rows:
        groups.setdefault(kind(r), []).append(r)
    return list(groups.values())


def _group_values(members: list[RankSnapshot]) -> tuple[str, ...]:
    """One status row for ``members``: their ranks, the first one's problem (and how many more) or
    their state and count, the range of their steps, mean throughput, the largest memory, the oldest
    heartbeat."""
    first, count = members[0], len(members)
    if first.problem:
        label = f"{first.problem} (and {count - 1} more)" if count > 1 else first.problem
    else:
        label = f"{first.state.value} ({count})"
    steps = [r.step for r in members if r.step is not None]
    rates = [r.steps_per_s for r in members if r.steps_per_s is not None]
    ages = [r.heartbeat_age for r in members if r.heartbeat_age is not None]
    biggest = max(members, key=lambda r: (r.memory.get("cuda_allocated", 0), r.memory.get("rss", 0)))
    cells = {r.cell for r in members if r.cell}
    return (
        format_ranks([r.rank for r in members]),
        label,
        (f"{fmt(min(steps))}–{fmt(max(steps))}" if min(steps) != max(steps) else fmt(steps[0]))
        if steps
        else "-",
        f"{sum(rates) / len(rates):.1f}" if rates else "-",
        f"≤ {memory_text(biggest.memory)}" if biggest.memory else "-",
        f"≤ {max(ages):.0f} s ago" if ages else "-",
        _cut(next(iter(cells)), 40) if len(cells) == 1 else ("-" if not cells else f"{len(cells)} cells"),
        "",
    )


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
    shown = len(status_rows(rows))
    table_height = HEADER_HEIGHT + (ROW_HEIGHT + 6) * max(1, min(shown, MAX_ROWS)) + 8
    figure = grid_figure(charts, columns=2, title=title, table=status_trace(rows), table_height=table_height)
    figure["layout"]["meta"] = {"jupyter_shard": "dashboard", "metrics": names}
    return figure


def _cut(text: str, size: int) -> str:
    return text if len(text) <= size else text[: size - 1] + "…"


def _plain(text: str) -> str:
    """Plotly reads a few HTML tags in table text: rank output must show as typed."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
