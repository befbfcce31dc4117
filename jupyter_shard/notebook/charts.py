"""Line charts as plain SVG: the same markup is the live dashboard and its static copy in a saved notebook.

Each chart is ``<svg class="jshard-chart" data-metric=NAME>`` with one
``<polyline class="jshard-trace" data-rank=K data-points=N>`` per rank (``N`` = points in the full
series, however few are drawn) and a dashed ``data-rank="mean"`` trace across ranks.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import numpy as np

from jupyter_shard.pool.figures import Floats

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
MEAN_COLOR = "#222"
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 54, 12, 36, 30
PAD = 0.05  # share of the value range left free above and below the lines


BAND_EDGE_COLOR = "#9aa5b1"


@dataclass
class Trace:
    label: str  # a rank number or "mean"
    x: Floats
    y: Floats
    points: int  # how many points the full series has

    @property
    def color(self) -> str:
        if self.label == "mean":
            return MEAN_COLOR
        if not self.label.isdigit():  # "min", "max": the edges of the band of all ranks
            return BAND_EDGE_COLOR
        return PALETTE[int(self.label) % len(PALETTE)]


def nice_ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """About ``count`` round tick values covering ``lo``..``hi``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def fmt(value: float) -> str:
    """Short label: 0.0123, 1.5k, 2.3M."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    size = abs(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if size >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def line_chart(
    metric: str, traces: list[Trace], *, title: str, x_label: str, width: int = 440, height: int = 200
) -> str:
    drawn = [t for t in traces if len(t.x)]
    head = (
        f'<svg class="jshard-chart" data-metric="{html.escape(metric)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg" '
        'style="font: 11px sans-serif; background: #fff">'
    )
    parts = [head, f'<text x="{MARGIN_LEFT}" y="15" font-weight="bold">{html.escape(title)}</text>']
    if not drawn:
        parts.append(
            f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#888">no data yet</text>'
        )
        parts.extend(_trace(t, "") for t in traces)
        return "".join([*parts, "</svg>"])
    xs = np.concatenate([t.x for t in drawn])
    ys = np.concatenate([t.y for t in drawn])
    x_lo, x_hi = float(xs.min()), float(xs.max())
    y_lo, y_hi = float(ys.min()), float(ys.max())
    if y_hi - y_lo < 1e-12 * max(1.0, abs(y_hi)):
        y_lo, y_hi = y_lo - 0.5 * max(1.0, abs(y_lo)), y_hi + 0.5 * max(1.0, abs(y_hi))
    if x_hi <= x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    span = y_hi - y_lo
    y_lo, y_hi = y_lo - PAD * span, y_hi + PAD * span
    plot_w = width - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = height - MARGIN_TOP - MARGIN_BOTTOM

    def scale(x: Floats, y: Floats) -> tuple[Floats, Floats]:
        px = MARGIN_LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w
        py = MARGIN_TOP + (1 - (y - y_lo) / (y_hi - y_lo)) * plot_h
        return px, py

    parts.append(_axes(x_lo, x_hi, y_lo, y_hi, width, height, x_label))
    parts.extend(_trace(t, _points(*scale(t.x, t.y)) if len(t.x) else "") for t in traces)
    parts.append(_legend(traces, width))
    return "".join([*parts, "</svg>"])


def _points(px: Floats, py: Floats) -> str:
    return " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px.tolist(), py.tolist(), strict=True))


def _trace(trace: Trace, points: str) -> str:
    dash = ' stroke-dasharray="5 3"' if trace.label == "mean" else ""
    width = 2 if trace.label == "mean" else 1.3
    last = f"{trace.y[-1]:.6g}" if len(trace.y) else "-"
    return (
        f'<polyline class="jshard-trace" data-rank="{trace.label}" data-points="{trace.points}" '
        f'points="{points}" fill="none" stroke="{trace.color}" stroke-width="{width}"{dash}>'
        f"<title>{'rank ' + trace.label if trace.label != 'mean' else 'mean of ranks'}: "
        f"{trace.points} points, last {last}</title></polyline>"
    )


def _axes(x_lo: float, x_hi: float, y_lo: float, y_hi: float, width: int, height: int, x_label: str) -> str:
    plot_w = width - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = height - MARGIN_TOP - MARGIN_BOTTOM
    bottom = MARGIN_TOP + plot_h
    out = [
        f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{plot_w}" height="{plot_h}" '
        'fill="none" stroke="#ccc"/>'
    ]
    for tick in nice_ticks(y_lo, y_hi):
        y = MARGIN_TOP + (1 - (tick - y_lo) / (y_hi - y_lo)) * plot_h
        out.append(
            f'<line x1="{MARGIN_LEFT}" x2="{MARGIN_LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{MARGIN_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end" fill="#555">{fmt(tick)}</text>'
        )
    for tick in nice_ticks(x_lo, x_hi, 5):
        x = MARGIN_LEFT + (tick - x_lo) / (x_hi - x_lo) * plot_w
        out.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle" fill="#555">{fmt(tick)}</text>')
    out.append(
        f'<text x="{MARGIN_LEFT + plot_w}" y="{height - 3}" text-anchor="end" fill="#888">'
        f"{html.escape(x_label)}</text>"
    )
    return "".join(out)


def _legend(traces: list[Trace], width: int) -> str:
    """One row under the title, right-aligned."""
    out, x = [], width - MARGIN_RIGHT
    for trace in reversed(traces):
        label = "mean" if trace.label == "mean" else f"rank {trace.label}"
        x -= 8 + 6 * len(label) + 14
        out.append(
            f'<rect x="{x}" y="23" width="10" height="3" fill="{trace.color}"/>'
            f'<text x="{x + 13}" y="28" fill="#444">{label}</text>'
        )
    return "".join(out)
