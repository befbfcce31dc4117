"""The SVG line charts: short labels, round ticks, and the markup each trace becomes (where its points
fall, what it is called, how the mean differs)."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest

from jupyter_shard.notebook.charts import (
    MARGIN_BOTTOM,
    MARGIN_LEFT,
    MARGIN_RIGHT,
    MARGIN_TOP,
    MEAN_COLOR,
    PALETTE,
    Trace,
    fmt,
    line_chart,
    nice_ticks,
)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (0.0123456, "0.0123"),
        (999, "999"),
        (1500, "1.5k"),
        (-2_300_000, "-2.3M"),
        (4.2e9, "4.2G"),
        (math.inf, "inf"),
        (math.nan, "nan"),
    ],
)
def test_labels_are_short(value: float, text: str) -> None:
    assert fmt(value) == text


def test_ticks_are_round_steps_inside_the_range() -> None:
    ticks = nice_ticks(0.3, 9.6)
    steps = {round(b - a, 9) for a, b in itertools.pairwise(ticks)}
    assert steps == {2.5} and ticks[0] >= 0.3 and ticks[-1] <= 9.6
    assert nice_ticks(-1, 1) == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert nice_ticks(math.nan, 1) == [] and nice_ticks(0, math.inf) == []
    assert nice_ticks(3, 2) == [3]


def _trace(label: str, y: list[float], points: int | None = None) -> Trace:
    x = np.arange(1, len(y) + 1, dtype=float)
    return Trace(label, x, np.asarray(y, dtype=float), points if points is not None else len(y))


def _polylines(svg: str) -> dict[str, dict[str, str]]:
    found = {}
    for match in re.finditer(r"<polyline ([^>]*)>", svg):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', match.group(1)))
        found[attrs["data-rank"]] = attrs
    return found


def _coords(points: str) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in (p.split(",") for p in points.split())]


def test_each_trace_is_a_polyline_named_by_rank_with_its_full_point_count() -> None:
    svg = line_chart(
        "loss",
        [_trace("0", [3, 2, 1], 3000), _trace("9", [2, 2, 2]), _trace("mean", [2.5, 2, 1.5])],
        title="loss · 1.5",
        x_label="step",
    )
    lines = _polylines(svg)
    assert list(lines) == ["0", "9", "mean"]
    assert lines["0"]["data-points"] == "3000" and lines["0"]["stroke"] == PALETTE[0]
    assert lines["9"]["stroke"] == PALETTE[9 % len(PALETTE)]
    assert lines["mean"]["stroke"] == MEAN_COLOR and lines["mean"]["stroke-dasharray"] == "5 3"
    assert "stroke-dasharray" not in lines["0"]
    assert svg.startswith('<svg class="jshard-chart" data-metric="loss"') and svg.endswith("</svg>")
    assert "rank 0: 3000 points, last 1</title>" in svg and "mean of ranks: 3 points, last 1.5</title>" in svg


def test_points_stay_inside_the_plot_and_keep_their_order() -> None:
    width, height = 400, 200
    svg = line_chart(
        "loss", [_trace("0", [10, -5, 7, 0])], title="t", x_label="step", width=width, height=height
    )
    coords = _coords(_polylines(svg)["0"]["points"])
    xs, ys = [x for x, _ in coords], [y for _, y in coords]
    assert xs == sorted(xs) and xs[0] == MARGIN_LEFT and xs[-1] == width - MARGIN_RIGHT
    assert all(MARGIN_TOP < y < height - MARGIN_BOTTOM for y in ys)
    assert ys[1] == max(ys) and ys[0] == min(ys)  # the lowest value is drawn lowest (SVG y grows down)


def test_a_flat_or_single_point_series_is_still_drawn_inside_the_plot() -> None:
    for y in ([5.0, 5.0, 5.0], [0.0]):
        svg = line_chart("m", [_trace("1", y)], title="t", x_label="step")
        coords = _coords(_polylines(svg)["1"]["points"])
        assert all(math.isfinite(a) and math.isfinite(b) for a, b in coords)
        assert all(MARGIN_TOP < b < 200 - MARGIN_BOTTOM for _, b in coords)


def test_an_empty_chart_says_no_data_yet_but_keeps_its_traces() -> None:
    svg = line_chart("loss", [Trace("0", np.empty(0), np.empty(0), 0)], title="loss", x_label="step")
    assert "no data yet" in svg
    assert _polylines(svg)["0"]["points"] == ""
    assert "last -</title>" in svg


def test_names_and_titles_are_escaped() -> None:
    svg = line_chart('a"<b>', [_trace("0", [1, 2])], title="<i>&", x_label="step & <s>")
    assert 'data-metric="a&quot;&lt;b&gt;"' in svg
    assert ">&lt;i&gt;&amp;</text>" in svg and "step &amp; &lt;s&gt;</text>" in svg
    assert "<i>" not in svg


def test_the_legend_names_every_trace() -> None:
    svg = line_chart(
        "m", [_trace("0", [1, 2]), _trace("1", [2, 3]), _trace("mean", [1.5, 2.5])], title="t", x_label="step"
    )
    labels = re.findall(r'fill="#444">([^<]*)</text>', svg)
    assert sorted(labels) == ["mean", "rank 0", "rank 1"]
