"""Plotly figures as plain dicts: a line per rank and the mean, the grid of charts, smoothing, and the
typed arrays a figure travels as."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from jupyter_shard.pool.figures import (
    BOTTOM,
    CHART_HEIGHT,
    GAP_Y,
    MEAN_COLOR,
    PALETTE,
    Chart,
    RankSeries,
    bin_means,
    color,
    decode,
    encode,
    grid_figure,
    line_traces,
    smoothed,
    typed,
)


def _series(rank: int, n: int, points: int | None = None) -> RankSeries:
    x = np.arange(n, dtype=float)
    return RankSeries(rank, x, x * 2, points if points is not None else n)


def test_each_rank_keeps_its_color_in_every_chart() -> None:
    assert color(0) == PALETTE[0] and color(len(PALETTE) + 3) == PALETTE[3]


def test_a_line_per_rank_then_the_dashed_mean_on_the_charts_axes() -> None:
    mean = (np.array([0.0, 1.0]), np.array([5.0, 6.0]))
    traces = line_traces("loss", [_series(0, 3, 300), _series(2, 1)], mean, axis=3, legend=False)
    assert [t["uid"] for t in traces] == ["loss-0", "loss-2", "loss-mean"]
    assert [t["legendgroup"] for t in traces] == ["rank 0", "rank 2", "mean"]
    assert {(t["xaxis"], t["yaxis"]) for t in traces} == {("x3", "y3")}
    assert [t["mode"] for t in traces] == ["lines", "markers", "lines"]  # one point: a marker
    assert [t["meta"] for t in traces] == [
        {"rank": 0, "points": 300},
        {"rank": 2, "points": 1},
        {"rank": "mean", "points": 2},
    ]
    assert traces[1]["line"]["color"] == PALETTE[2]
    assert traces[2]["line"] == {"color": MEAN_COLOR, "width": 2.2, "dash": "dash"}
    assert not any(t["showlegend"] for t in traces)
    assert "loss" in traces[0]["hovertemplate"] and "step" in traces[0]["hovertemplate"]


def test_no_mean_trace_without_mean_points_and_axis_one_is_plain() -> None:
    traces = line_traces("acc", [_series(1, 4)], (np.empty(0), np.empty(0)), x_label="seconds")
    assert [t["uid"] for t in traces] == ["acc-1"]
    assert (traces[0]["xaxis"], traces[0]["yaxis"]) == ("x", "y")
    assert "seconds" in traces[0]["hovertemplate"] and traces[0]["showlegend"]
    assert [t["uid"] for t in line_traces("acc", [_series(1, 4)], None)] == ["acc-1"]


def test_the_grid_places_charts_by_row_and_column_under_the_table() -> None:
    charts = [Chart(f"m{i} <&>", "step", [{"uid": f"m{i}"}]) for i in range(3)]
    table = {"type": "table", "uid": "status"}
    figure = grid_figure(charts, columns=2, title="pool", table=table, table_height=100)
    layout = figure["layout"]
    assert [t["uid"] for t in figure["data"]] == ["status", "m0", "m1", "m2"]
    assert layout["height"] == 60 + (100 + GAP_Y) + 2 * CHART_HEIGHT + GAP_Y + BOTTOM
    first, second, third = (layout["xaxis"], layout["xaxis2"], layout["xaxis3"])
    assert first["domain"][1] < second["domain"][0]  # side by side, apart
    assert third["domain"] == first["domain"]  # the next row starts at the left
    y1, y3 = layout["yaxis"]["domain"], layout["yaxis3"]["domain"]
    assert y3[1] < y1[0] and layout["yaxis2"]["domain"] == y1
    table_y = figure["data"][0]["domain"]["y"]
    assert table_y[1] == 1 and table_y[0] > y1[1]  # the table is above the charts
    assert [a["text"] for a in layout["annotations"]] == [f"<b>m{i} &lt;&amp;&gt;</b>" for i in range(3)]
    assert [m["buttons"][1]["args"] for m in layout["updatemenus"]] == [
        [{"yaxis.type": "log"}],
        [{"yaxis2.type": "log"}],
        [{"yaxis3.type": "log"}],
    ]
    assert layout["uirevision"] == "jupyter_shard" and layout["title"]["text"] == "pool"
    assert layout["xaxis2"]["anchor"] == "y2" and layout["yaxis2"]["anchor"] == "x2"


def test_a_grid_without_title_or_table_or_charts_still_has_a_row() -> None:
    layout = grid_figure([], columns=1)["layout"]
    assert layout["height"] == 30 + CHART_HEIGHT + BOTTOM and "title" not in layout


def test_bin_means_averages_each_bin_however_few_the_points() -> None:
    x = np.array([0.0, 1.0, 9.0, 10.0])
    xs, ys = bin_means(x, x * 10, 0.0, 10.0, 2)
    assert xs.tolist() == [0.5, 9.5] and ys.tolist() == [5.0, 95.0]
    same = np.array([3.0])
    assert bin_means(same, same, 3.0, 3.0, 5)[0] is same  # an empty range: as given


def test_smoothing_is_bias_corrected_and_zero_weight_is_raw() -> None:
    y = np.array([1.0, 0.0, 1.0, 0.0])
    assert smoothed(y, 0.0) is y
    s = smoothed(y, 0.5)
    assert s[0] == 1.0  # starts at the first value, not pulled towards 0
    assert s[1] == pytest.approx(1 / 3)
    assert np.allclose(smoothed(np.full(5, 7.0), 0.9), 7.0)


def test_arrays_travel_as_little_endian_float64_and_come_back() -> None:
    data = typed(np.array([1, 2], dtype=np.int32))
    assert data["dtype"] == "f8"
    assert np.frombuffer(base64.b64decode(data["bdata"]), "<f8").tolist() == [1.0, 2.0]
    figure = {"data": [{"x": np.arange(3.0), "name": "rank 0", "pair": (np.ones(1), 2)}], "n": 1}
    encoded = encode(figure)
    json.dumps(encoded)  # every array is JSON now
    assert decode(encoded) == {"data": [{"x": [0.0, 1.0, 2.0], "name": "rank 0", "pair": [[1.0], 2]}], "n": 1}


def test_trace_uids_are_css_names_and_never_the_same_for_different_traces() -> None:
    """Plotly finds a removed trace's colorbar with the selector ``.cb<uid>``: a uid such as
    ``loss:12`` threw in the browser as the ranks drawn on their own changed, and the live figure
    stopped updating. Metric names are the user's (``train/loss``, ``val loss``, ``a-b``, ``_x``)."""
    from jupyter_shard.pool.figures import band_traces, trace_uid

    css = re.compile(r"[A-Za-z0-9_-]+")
    names = ["loss", "train/loss", "val loss", "a-b", "a", "b", "_x", "x", "ünï", "", "cuda_allocated"]
    uids = [trace_uid(name, part) for name in names for part in (0, 12, "mean", "min", "max", "b", "a-b")]
    assert all(css.fullmatch(uid) for uid in uids), [u for u in uids if not css.fullmatch(u)]
    assert len(set(uids)) == len(uids)
    assert trace_uid("loss", 12) == "loss-12" and trace_uid("memory", 3, "rss") == "memory-3-rss"
    band = band_traces(
        "train/loss", (np.arange(3.0), np.zeros(3), np.ones(3)), 9, axis=1, legend=True, x_label="step"
    )
    assert all(css.fullmatch(t["uid"]) for t in band)
