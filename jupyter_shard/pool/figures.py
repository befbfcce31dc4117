"""Plotly figures of logged scalars and memory, built as plain dicts.

One builder for the live dashboard, its saved copy and ``history().plot()``: a chart per metric with a
line per rank (``legendgroup`` ``rank k``, so one legend click hides a rank in every chart) and a
dashed mean across ranks. Dicts, not ``plotly.graph_objects``: validating a figure costs more than
drawing it, at up to 5 redraws a second. Arrays stay numpy until :func:`encode` turns them into
Plotly's base64 typed arrays (``{"dtype": "f8", "bdata": ...}``, what plotly.py itself sends), so a
redraw of thousands of points is a few ``tobytes`` calls, not a float-by-float JSON text.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import plotly.graph_objects as go

Floats = npt.NDArray[np.float64]

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
MEAN_COLOR = "#222222"
BAND_COLOR, BAND_FILL = "#7fa7d1", "rgba(31, 119, 180, 0.18)"  # the min–max band of many ranks
CHART_HEIGHT = 250  # pixels per row of charts
GAP_X, GAP_Y = 0.08, 70  # between columns (share of the width), between rows (pixels)
BOTTOM = 80  # pixels under the charts: the last row's axis title, then the legend
Figure = dict[str, Any]


class Logged(Protocol):
    """What :func:`plot_history` reads of a :class:`~jupyter_shard.pool.history.History` (named here,
    not imported: the history imports this module)."""

    @property
    def ranks(self) -> list[int]: ...

    @property
    def metrics(self) -> list[str]: ...

    def sampled(
        self, rank: int, name: str, at_most: int, x: Literal["step", "time"] = "step"
    ) -> tuple[Floats, Floats, int]: ...


_PLAIN_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*")


def trace_uid(*parts: object) -> str:
    """A trace's Plotly ``uid``: its parts joined by ``-``, each as is where it is a plain name
    (``loss-12``, ``memory-3-rss``) and otherwise as ``_`` and its UTF-8 in hex (``train/loss``:
    ``_747261696e2f6c6f7373``), so that different parts never give one uid. When a trace goes away
    between redraws Plotly looks its colorbar up with the CSS selector ``.cb<uid>``: a uid that is no
    CSS name (``loss:12``) made that redraw throw, and the live figure stopped updating whenever the
    ranks drawn on their own changed."""
    return "-".join(
        text if _PLAIN_UID.fullmatch(text) else "_" + text.encode().hex()
        for text in (str(part) for part in parts)
    )


def color(rank: int) -> str:
    return PALETTE[rank % len(PALETTE)]


@dataclass
class RankSeries:
    """What one rank's line shows: ``x``/``y`` as drawn, ``points`` in the whole series."""

    rank: int
    x: Floats
    y: Floats
    points: int


def line_traces(
    metric: str,
    series: Sequence[RankSeries],
    mean: tuple[Floats, Floats] | None,
    *,
    axis: int = 1,
    x_label: str = "step",
    legend: bool = True,
    why: Mapping[int, str] | None = None,
) -> list[dict[str, Any]]:
    """One line per rank plus the dashed mean, on axes ``x{axis}``/``y{axis}``; ``why`` names what
    sets a rank apart (``rank 7 (slowest)``) where only some are drawn."""
    xref, yref = _axis_ref("x", axis), _axis_ref("y", axis)
    traces = []
    for s in series:
        traces.append(
            {
                "type": "scatter",
                "mode": "lines" if len(s.x) > 1 else "markers",
                "uid": trace_uid(metric, s.rank),
                "name": f"rank {s.rank}" + (f" ({why[s.rank]})" if why and s.rank in why else ""),
                "legendgroup": f"rank {s.rank}",
                "showlegend": legend,
                "x": s.x,
                "y": s.y,
                "xaxis": xref,
                "yaxis": yref,
                "line": {"color": color(s.rank), "width": 1.5},
                "marker": {"color": color(s.rank)},
                "meta": {"rank": s.rank, "points": s.points},
                "hovertemplate": f"rank {s.rank} · {x_label} %{{x}}<br>{metric} %{{y:.6~g}}<extra></extra>",
            }
        )
    if mean is not None and len(mean[0]):
        traces.append(
            {
                "type": "scatter",
                "mode": "lines" if len(mean[0]) > 1 else "markers",
                "uid": trace_uid(metric, "mean"),
                "name": "mean",
                "legendgroup": "mean",
                "showlegend": legend,
                "x": mean[0],
                "y": mean[1],
                "xaxis": xref,
                "yaxis": yref,
                "line": {"color": MEAN_COLOR, "width": 2.2, "dash": "dash"},
                "marker": {"color": MEAN_COLOR},
                "meta": {"rank": "mean", "points": len(mean[0])},
                "hovertemplate": f"mean · {x_label} %{{x}}<br>{metric} %{{y:.6~g}}<extra></extra>",
            }
        )
    return traces


@dataclass
class Chart:
    """One chart of a grid: its title, x-axis label and traces (already on their axis)."""

    title: str
    x_label: str
    traces: list[dict[str, Any]]


def grid_figure(
    charts: Sequence[Chart],
    *,
    columns: int,
    title: str = "",
    table: dict[str, Any] | None = None,
    table_height: int = 0,
) -> Figure:
    """The charts on a grid of ``columns``, each with a linear/log switch, under an optional table
    trace ``table_height`` pixels high. ``uirevision`` keeps the user's zoom and hidden lines across
    redraws (Plotly matches traces by ``uid``)."""
    top = table_height + GAP_Y if table is not None else 0
    rows = max(1, math.ceil(len(charts) / columns))
    head = 60 if title else 30
    height = head + top + rows * CHART_HEIGHT + (rows - 1) * GAP_Y + BOTTOM
    layout: dict[str, Any] = {
        "uirevision": "jupyter_shard",
        "height": height,
        "margin": {"l": 60, "r": 20, "t": head, "b": BOTTOM},
        "hovermode": "closest",
        "legend": {"orientation": "h", "x": 0, "y": 0, "yanchor": "bottom", "yref": "container"},
        "template": {"layout": {"plot_bgcolor": "#fff", "paper_bgcolor": "#fff"}},
        "annotations": [],
        "updatemenus": [],
    }
    if title:
        layout["title"] = {"text": title, "x": 0, "xanchor": "left", "font": {"size": 14}}
    inner = height - head - BOTTOM
    width = (1 - GAP_X * (columns - 1)) / columns
    data: list[dict[str, Any]] = []
    if table is not None:
        data.append({**table, "domain": {"x": [0, 1], "y": [1 - table_height / inner, 1]}})
    for i, chart in enumerate(charts):
        axis, row, col = i + 1, i // columns, i % columns
        x0 = col * (width + GAP_X)
        y1 = 1 - (top + row * (CHART_HEIGHT + GAP_Y)) / inner
        y0 = y1 - CHART_HEIGHT / inner
        suffix = "" if axis == 1 else str(axis)
        grid = {
            "showgrid": True,
            "gridcolor": "#eee",
            "zeroline": False,
            "linecolor": "#ccc",
            "showline": True,
        }
        layout[f"xaxis{suffix}"] = {
            **grid,
            "domain": [x0, x0 + width],
            "anchor": _axis_ref("y", axis),
            "title": {"text": chart.x_label, "standoff": 4},
        }
        layout[f"yaxis{suffix}"] = {**grid, "domain": [max(0.0, y0), y1], "anchor": _axis_ref("x", axis)}
        layout["annotations"].append(
            {
                "text": f"<b>{_escape(chart.title)}</b>",
                "x": x0,
                "y": y1,
                "xref": "paper",
                "yref": "paper",
                "xanchor": "left",
                "yanchor": "bottom",
                "yshift": 6,
                "showarrow": False,
                "font": {"size": 12},
            }
        )
        layout["updatemenus"].append(_scale_switch(suffix, x0 + width, y1))
        data.extend(chart.traces)
    return {"data": data, "layout": layout}


def _scale_switch(suffix: str, x: float, y: float) -> dict[str, Any]:
    """Two buttons over a chart's top-right corner: its y axis linear or log."""
    key = f"yaxis{suffix}.type"
    return {
        "name": f"y{suffix or '1'} scale",
        "type": "buttons",
        "direction": "left",
        "showactive": True,
        "active": 0,
        "x": x,
        "y": y,
        "xanchor": "right",
        "yanchor": "bottom",
        "pad": {"r": 0, "t": 0, "b": 2},
        "font": {"size": 10},
        "buttons": [
            {"label": "linear", "method": "relayout", "args": [{key: "linear"}]},
            {"label": "log", "method": "relayout", "args": [{key: "log"}]},
        ],
    }


def _axis_ref(letter: str, axis: int) -> str:
    return letter if axis == 1 else f"{letter}{axis}"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def binned(x: Floats, y: Floats, lo: float, hi: float, bins: int) -> tuple[Floats, Floats]:
    """At most ``bins`` points: the raw points if few, else the mean of ``x`` and ``y`` per bin of x."""
    if len(x) <= bins:
        return x, y
    return bin_means(x, y, lo, hi, bins)


def mean_across(
    series: list[tuple[Floats, Floats]], lo: float, hi: float, bins: int, *, always_bin: bool = False
) -> tuple[Floats, Floats]:
    """The mean over ranks against step: exact per step when short, per bin of steps when long or
    ``always_bin`` (times, which no two ranks share)."""
    series = [(x, y) for x, y in series if len(x)]
    if not series:
        return np.empty(0), np.empty(0)
    if (max(len(x) for x, _ in series) <= bins and not always_bin) or hi <= lo:
        xs = np.concatenate([x for x, _ in series])
        ys = np.concatenate([y for _, y in series])
        steps, index = np.unique(xs, return_inverse=True)
        return steps, np.bincount(index, weights=ys) / np.bincount(index)
    fit = bin_means if always_bin else binned
    per_rank = [fit(x, y, lo, hi, bins) for x, y in series]
    return fit(
        np.concatenate([x for x, _ in per_rank]), np.concatenate([y for _, y in per_rank]), lo, hi, bins
    )


def band_across(
    series: list[tuple[Floats, Floats]], lo: float, hi: float, bins: int, *, always_bin: bool = False
) -> tuple[Floats, Floats, Floats]:
    """The lowest and highest value over ranks against step (per bin of steps when long, or always:
    times, which no two ranks share): ``x``, the lows, the highs; NaN and infinite values left out
    (a rank that has them is drawn on its own)."""
    series = [(x, y) for x, y in series if len(x)]
    if not series:
        return np.empty(0), np.empty(0), np.empty(0)
    if (always_bin or max(len(x) for x, _ in series) > bins) and hi > lo:
        series = [bin_means(x, y, lo, hi, bins) for x, y in series]
        keys: list[Floats] = [np.clip(np.floor((x - lo) / (hi - lo) * bins), 0, bins - 1) for x, _ in series]
    else:
        keys = [x for x, _ in series]
    ks = np.concatenate(keys)
    xs = np.concatenate([x for x, _ in series])
    ys = np.concatenate([y for _, y in series])
    _, index = np.unique(ks, return_inverse=True)
    size = int(index.max()) + 1
    low, high = np.full(size, np.inf), np.full(size, -np.inf)
    finite = np.isfinite(ys)
    np.minimum.at(low, index[finite], ys[finite])
    np.maximum.at(high, index[finite], ys[finite])
    where = np.bincount(index, weights=xs, minlength=size) / np.bincount(index, minlength=size)
    ok = np.isfinite(low)
    return where[ok], low[ok], high[ok]


def band_traces(
    metric: str, band: tuple[Floats, Floats, Floats], ranks: int, *, axis: int, legend: bool, x_label: str
) -> list[dict[str, Any]]:
    """The min–max band of ``ranks`` ranks as two traces (the upper edge, then the lower one filled
    up to it), one legend entry."""
    x, low, high = band
    xref, yref = _axis_ref("x", axis), _axis_ref("y", axis)
    name = f"min–max of {ranks} ranks"
    hover = f"{x_label} %{{x}}<br>{metric} %{{y:.6~g}}<extra></extra>"
    common = {"type": "scatter", "mode": "lines", "x": x, "xaxis": xref, "yaxis": yref, "legendgroup": "band"}
    return [
        {
            **common,
            "uid": trace_uid(metric, "max"),
            "name": name,
            "showlegend": False,
            "y": high,
            "line": {"color": BAND_COLOR, "width": 0.5},
            "meta": {"rank": "max", "points": len(x)},
            "hovertemplate": f"highest of {ranks} ranks · {hover}",
        },
        {
            **common,
            "uid": trace_uid(metric, "min"),
            "name": name,
            "showlegend": legend,
            "y": low,
            "fill": "tonexty",
            "fillcolor": BAND_FILL,
            "line": {"color": BAND_COLOR, "width": 0.5},
            "meta": {"rank": "min", "points": len(x)},
            "hovertemplate": f"lowest of {ranks} ranks · {hover}",
        },
    ]


def bin_means(x: Floats, y: Floats, lo: float, hi: float, bins: int) -> tuple[Floats, Floats]:
    """The mean of ``x`` and ``y`` per bin of x (empty bins left out), however few the points."""
    if hi <= lo or not len(x):
        return x, y
    index = np.clip(((x - lo) / (hi - lo) * bins).astype(np.int64), 0, bins - 1)
    counts = np.bincount(index, minlength=bins)
    used = counts > 0
    xs = np.bincount(index, weights=x, minlength=bins)[used] / counts[used]
    ys = np.bincount(index, weights=y, minlength=bins)[used] / counts[used]
    return xs, ys


def smoothed(y: Floats, weight: float) -> Floats:
    """Exponential moving average with bias correction (TensorBoard's smoothing): ``weight`` in [0, 1)."""
    if weight <= 0 or not len(y):
        return y
    out = np.empty_like(y)
    last, norm = 0.0, 0.0
    for i, value in enumerate(y.tolist()):
        last = weight * last + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out[i] = last / norm
    return out


def plot_history(
    history: Logged,
    metrics: Sequence[str],
    *,
    smooth: float,
    x: Literal["step", "time"],
    points: int | None,
) -> go.Figure:
    """``History.plot``: a chart per metric, a line per rank and their mean, as a plotly Figure."""
    import plotly.graph_objects as go

    logged = history.metrics
    names = list(metrics) or logged
    if not names:
        raise ValueError("nothing is logged yet: call shard.log(loss=...) in a %%distributed cell first")
    unknown = [n for n in names if n not in logged]
    if unknown:
        raise ValueError(f"no metric {unknown[0]!r} in the history; logged: {', '.join(logged) or 'none'}")
    if x not in ("step", "time"):
        raise ValueError(f"x={x!r}: use x='step' or x='time' (seconds since the first record)")
    if not 0 <= smooth < 1:
        raise ValueError(f"smooth={smooth}: use a weight in [0, 1), e.g. 0.9 (0 draws the raw values)")
    if points is not None and points < 1:
        raise ValueError(f"points={points}: use a positive count, or None for every record")
    raw = {
        name: {rank: history.sampled(rank, name, points or 0, x) for rank in history.ranks} for name in names
    }
    start = 0.0
    if x == "time":
        start = min((float(s[0][0]) for by in raw.values() for s in by.values() if len(s[0])), default=0.0)
    x_label = "step" if x == "step" else "seconds"
    charts = []
    for i, name in enumerate(names):
        series = [
            RankSeries(rank, xs - start, smoothed(ys, smooth), total)
            for rank, (xs, ys, total) in raw[name].items()
            if len(xs)
        ]
        mean = None
        if len(series) > 1:
            lo = min(float(s.x.min()) for s in series)
            hi = max(float(s.x.max()) for s in series)
            pairs = [(s.x, s.y) for s in series]
            if x == "step":
                mean = mean_across(pairs, lo, hi, points or max(len(s.x) for s in series))
            else:  # wall times never coincide across ranks: the mean is taken per bin of time
                bins = min(points or 1000, 1000)
                mean = bin_means(np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs]),
                                 lo, hi, bins)  # fmt: skip
        title = name + (f" (smoothed {smooth:g})" if smooth else "")
        traces = line_traces(name, series, mean, axis=i + 1, x_label=x_label, legend=i == 0)
        charts.append(Chart(title, x_label, traces))
    return go.Figure(grid_figure(charts, columns=1))


def typed(values: np.ndarray[Any, Any]) -> dict[str, str]:
    """A numpy array as Plotly's base64 typed array (little-endian float64)."""
    data = np.ascontiguousarray(values, dtype="<f8")
    return {"dtype": "f8", "bdata": base64.b64encode(data.tobytes()).decode("ascii")}


def encode(value: Any) -> Any:
    """``value`` with every numpy array (at any depth) as a typed array: ready for JSON."""
    if isinstance(value, np.ndarray):
        return typed(value)
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`: typed arrays back to lists (for reading figures in tests)."""
    if isinstance(value, Mapping):
        if set(value) == {"dtype", "bdata"}:
            return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).tolist()
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value
