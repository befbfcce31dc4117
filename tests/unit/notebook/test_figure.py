"""The dashboard's Plotly figure, built from a real ``History`` and a stand-in pool: the metric and
memory charts, the status table and what the whole figure says."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest

from jupyter_shard.notebook import figure as fig
from jupyter_shard.notebook.figure import (
    ROW_COLORS,
    dashboard_figure,
    memory_chart,
    memory_text,
    metric_chart,
    row_kind,
    status_trace,
)
from jupyter_shard.pool import figures as fig_module
from jupyter_shard.pool.history import History
from jupyter_shard.pool.pool import Pool
from jupyter_shard.pool.ranks import RankSnapshot, RankState

MIB = 2**20


def _log(history: History, rank: int, steps: range, value: float, name: str = "loss") -> None:
    history.extend(rank, [{"step": s, "ts": 100.0 + s, "values": {name: value}} for s in steps])


def test_a_metric_nobody_logged_yet_says_so() -> None:
    chart = metric_chart(History(), "loss", 1, True)
    assert chart.title == "loss (no data yet)" and chart.traces == [] and chart.x_label == "step"


def test_one_ranks_metric_is_titled_by_its_last_value() -> None:
    history = History()
    history.extend(0, [{"step": s, "ts": float(s), "values": {"loss": 1.0 / s}} for s in range(1, 9)])
    chart = metric_chart(history, "loss", 1, True)
    assert chart.title == "loss · 0.125"
    assert [t["uid"] for t in chart.traces] == ["loss-0"]  # no mean of one rank


def test_the_mean_covers_only_the_steps_every_rank_reached() -> None:
    history = History()
    _log(history, 0, range(1, 11), 0.0)
    _log(history, 1, range(1, 6), 2.0)  # behind: the mean ends where it is
    chart = metric_chart(history, "loss", 2, False)
    mean = chart.traces[-1]
    assert mean["uid"] == "loss-mean" and list(mean["x"]) == [1, 2, 3, 4, 5]
    assert np.allclose(mean["y"], 1.0)
    assert chart.title == "loss · mean of 2 ranks 1"
    assert {t["xaxis"] for t in chart.traces} == {"x2"} and {t["yaxis"] for t in chart.traces} == {"y2"}
    assert not any(t["showlegend"] for t in chart.traces)
    assert [t["meta"]["points"] for t in chart.traces[:2]] == [10, 5]


def test_a_long_series_is_drawn_as_at_most_bins_points(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fig, "BINS", 50)
    monkeypatch.setattr(fig, "SAMPLE", 200)
    history = History()
    _log(history, 0, range(1, 1001), 3.0)
    [trace] = metric_chart(history, "loss", 1, True).traces
    assert len(trace["x"]) <= 50 and trace["meta"]["points"] == 1000


def test_on_cpu_memory_is_host_rss_in_mib_from_the_first_sample() -> None:
    history = History()
    for rank in (0, 1):
        history.add_memory(rank, 50.0, {"rss": 100 * MIB})
        history.add_memory(rank, 52.0, {"rss": 300 * MIB})
    chart = memory_chart(history, 3, True)
    assert chart.title == "memory per rank: host RSS, MiB" and chart.x_label == "seconds"
    assert [t["uid"] for t in chart.traces] == ["memory-0-rss", "memory-1-rss"]
    first = chart.traces[0]
    assert list(first["x"]) == [0.0, 2.0] and list(first["y"]) == [100.0, 300.0]
    assert (first["xaxis"], first["yaxis"], first["mode"]) == ("x3", "y3", "lines")
    assert all(t["showlegend"] for t in chart.traces)


def test_one_memory_sample_is_a_marker_on_the_first_axes() -> None:
    history = History()
    history.add_memory(0, 5.0, {"rss": MIB})
    [trace] = memory_chart(history, 1, False).traces
    assert (trace["mode"], trace["xaxis"], trace["yaxis"], trace["showlegend"]) == (
        "markers",
        "x",
        "y",
        False,
    )


def _row(rank: int, **kwargs: Any) -> RankSnapshot:
    kwargs.setdefault("state", RankState.RUNNING)
    return RankSnapshot(rank=rank, **kwargs)


def test_a_status_row_shows_each_field_and_dashes_for_what_is_unknown() -> None:
    full = _row(
        0,
        step=12500.0,
        steps_per_s=3.14159,
        memory={"rss": 512 * MIB},
        heartbeat_age=2.4,
        cell="for step in range(10):",
        last_line="epoch 3 <done> & saved",
    )
    trace = status_trace([full, _row(1, state=RankState.IDLE)])
    columns = trace["cells"]["values"]
    assert [column[0] for column in columns] == [
        "0", "running", "12.5k", "3.1", "512 MiB", "2 s ago", "for step in range(10):",
        "epoch 3 &lt;done&gt; &amp; saved",
    ]  # fmt: skip
    assert [column[1] for column in columns] == ["1", "idle", "-", "-", "-", "-", "-", ""]
    assert trace["type"] == "table" and trace["uid"] == "status"
    assert len(trace["header"]["values"]) == len(columns) == len(trace["columnwidth"])


def test_long_cells_and_lines_are_cut_with_an_ellipsis() -> None:
    columns = status_trace([_row(0, cell="c" * 100, last_line="l" * 100)])["cells"]["values"]
    assert columns[6][0] == "c" * 39 + "…" and columns[7][0] == "l" * 79 + "…"
    assert status_trace([_row(0, cell="c" * 40)])["cells"]["values"][6][0] == "c" * 40


@pytest.mark.parametrize(
    ("problem", "state", "kind"),
    [
        ("stuck: no heartbeat for 60 s", RankState.RUNNING, "stuck"),
        ("dead: exited with code 1", RankState.DEAD, "dead"),
        ("", RankState.BROKEN, "broken"),
        ("", RankState.IDLE, "idle"),
    ],
)
def test_a_row_is_tinted_by_its_problem_or_else_its_state(problem: str, state: RankState, kind: str) -> None:
    row = _row(0, problem=problem, state=state)
    assert row_kind(row) == kind
    assert status_trace([row])["cells"]["fill"]["color"][0] == [ROW_COLORS.get(kind, "#ffffff")]
    assert status_trace([row])["cells"]["values"][1] == [problem or state.value]


def test_memory_text_names_host_and_cuda_memory() -> None:
    assert memory_text({}) == "-"
    assert memory_text({"rss": 1536 * MIB}) == "1536 MiB"
    gpu = {"rss": 100 * MIB, "cuda_allocated": 10 * MIB, "cuda_reserved": 20 * MIB, "cuda_peak": 30 * MIB}
    assert memory_text(gpu) == "100 MiB · cuda 10 / 20 / peak 30 MiB"


@dataclass
class _Spec:
    def describe(self) -> str:
        return "2 CPU ranks · ddp"


@dataclass
class _Run:
    running: bool

    def describe(self) -> str:
        return "the background run of cell [4] (running for 3.0 s)"


@dataclass
class _Pool:
    history: History = field(default_factory=History)
    spec: _Spec = field(default_factory=_Spec)
    background: _Run | None = None
    rows: list[RankSnapshot] = field(default_factory=list)

    def activity(self) -> list[RankSnapshot]:
        return self.rows


def _figure(pool: _Pool, compact: bool = False) -> dict[str, Any]:
    return dashboard_figure(cast(Pool, pool), compact=compact)


def test_the_dashboard_is_the_table_then_a_chart_per_metric_then_memory() -> None:
    pool = _Pool(rows=[_row(0), _row(1)])
    for name in ("loss", "lr", "acc"):
        _log(pool.history, 0, range(1, 4), 1.0, name)
    pool.history.add_memory(0, 1.0, {"rss": MIB})
    figure = _figure(pool)
    uids = [t["uid"] for t in figure["data"]]
    assert uids == ["status", "loss-0", "lr-0", "acc-0", "memory-0-rss"]
    assert [t["xaxis"] for t in figure["data"][1:]] == ["x", "x2", "x3", "x4"]
    assert figure["layout"]["meta"] == {"jupyter_shard": "dashboard", "metrics": ["loss", "lr", "acc"]}
    assert figure["layout"]["title"]["text"] == "2 CPU ranks · ddp"
    legends = [t["showlegend"] for t in figure["data"][1:]]
    assert legends == [True, False, False, False]  # one legend, on the first chart
    compact = _figure(pool, compact=True)
    assert compact["layout"]["meta"]["metrics"] == ["loss", "lr"]
    assert [t["uid"] for t in compact["data"]] == ["status", "loss-0", "lr-0", "memory-0-rss"]


def test_memory_alone_carries_the_legend() -> None:
    pool = _Pool(rows=[_row(0)])
    pool.history.add_memory(0, 1.0, {"rss": MIB})
    memory = _figure(pool)["data"][-1]
    assert memory["uid"] == "memory-0-rss" and memory["showlegend"] and memory["xaxis"] == "x"


def test_the_title_says_a_background_run_goes_on_and_that_points_were_thinned() -> None:
    pool = _Pool(background=_Run(running=True))
    assert _figure(pool)["layout"]["title"]["text"] == (
        "2 CPU ranks · ddp · the background run of cell [4] (running for 3.0 s)"
    )
    pool.background = _Run(running=False)
    pool.history.thinned = True
    assert _figure(pool)["layout"]["title"]["text"] == (
        "2 CPU ranks · ddp · older points thinned 2:1 to bound memory"
    )


def test_the_table_grows_with_the_ranks_up_to_a_limit() -> None:
    def height_for(ranks: int) -> float:
        figure = _figure(_Pool(rows=[_row(k) for k in range(ranks)]))
        return float(figure["layout"]["height"])

    assert height_for(1) == height_for(0)  # room for one row even before any rank reports
    assert height_for(1) < height_for(4) < height_for(fig.MAX_ROWS)
    assert fig.MAX_ROWS < fig.BAND_FROM
    assert height_for(fig.BAND_FROM - 1) == height_for(fig.MAX_ROWS)  # a row each, up to the limit
    assert height_for(64) == height_for(1)  # 64 ranks running alike: one summary row


# -- many ranks: a summary, a band, the strays -----------------------------------------------------------


def _many(ranks: int = 64, steps: int = 300) -> History:
    rng = np.random.default_rng(1)
    history = History()
    for rank in range(ranks):
        last = steps - 40 if rank == 9 else steps  # rank 9 lags behind
        values = 2.0 / np.arange(1, last + 1) + rng.normal(0, 0.01, last)
        if rank == 50:
            values[-1] += 5.0  # far above the rest at the end
        history.extend(
            rank,
            [{"step": s + 1, "ts": 100.0 + s, "values": {"loss": float(v)}} for s, v in enumerate(values)],
        )
        for t in range(20):
            history.add_memory(rank, 100.0 + t, {"rss": (200 + rank + (400 if rank == 17 else 0)) * MIB})
    return history


def test_at_64_ranks_a_chart_is_a_mean_a_band_and_the_strays() -> None:
    chart = metric_chart(_many(), "loss", 1, True)
    names = [t["name"] for t in chart.traces if t.get("showlegend")]
    assert names[:3] == ["min–max of 64 ranks", "rank 9 (slowest)", "rank 50 (highest)"]
    assert names[3].endswith("(lowest)") and names[4] == "mean"
    assert len(chart.traces) == 6  # against 65 lines over 8 colours
    assert chart.title.startswith("loss · mean of 64 ranks ")
    upper, lower = chart.traces[0], chart.traces[1]
    assert lower["fill"] == "tonexty" and len(upper["x"]) == len(lower["x"]) == 300
    assert bool(np.all(np.asarray(upper["y"]) >= np.asarray(lower["y"])))
    assert float(np.asarray(upper["y"])[-1]) > 5.0  # rank 50's jump is inside the band's top


def test_strays_are_a_nan_then_the_slowest_then_the_furthest_from_the_mean() -> None:
    last = {k: (100.0, 1.0 + (k / 1000) ** 2) for k in range(20)}
    assert fig.strays(last) == {19: "highest", 18: "high", 17: "high"}  # one highest, the next high
    last[4] = (60.0, 1.0)
    last[7] = (100.0, float("inf"))
    assert fig.strays(last) == {7: "inf", 4: "slowest", 19: "highest"}
    assert fig.strays({k: (1.0, 0.5) for k in range(12)}) == {}  # all alike: none stands out
    spread = {k: (39.0, 1 / 40 + k / 100) for k in range(64)}  # the browser test's loss at 64 ranks
    assert fig.strays(spread) == {0: "lowest", 63: "highest", 1: "low"}


def test_at_64_ranks_memory_is_a_band_and_the_rank_using_most() -> None:
    chart = fig.memory_chart(_many(), 2, False)
    assert [t["name"] for t in chart.traces] == [
        "min–max of 64 ranks",
        "min–max of 64 ranks",
        "rank 17 (most)",
        "mean",
    ]
    assert chart.title == "host RSS, MiB · 64 ranks"


def test_at_64_ranks_the_status_is_the_ranks_in_trouble_then_a_row_per_state() -> None:
    rows = [
        _row(
            k,
            step=float(100 + k % 3),
            steps_per_s=2.0,
            memory={"rss": (200 + k) * MIB},
            heartbeat_age=0.5,
            cell="train()",
        )
        for k in range(64)
    ]
    rows[5] = _row(5, state=RankState.DEAD, problem="dead: was killed by SIGKILL")
    rows[7] = _row(7, problem="stuck: no heartbeat for 9 s", heartbeat_age=9.0)
    trace = status_trace(rows)
    columns = trace["cells"]["values"]
    assert columns[0] == ["5", "7", "0-4,6,8-63"]
    assert columns[1] == ["dead: was killed by SIGKILL", "stuck: no heartbeat for 9 s", "running (62)"]
    assert [c[2] for c in columns] == [
        "0-4,6,8-63",
        "running (62)",
        "100–102",
        "2.0",
        "≤ 263 MiB",
        "≤ 0 s ago",
        "train()",
        "",
    ]


def test_a_64_rank_dashboard_update_is_small() -> None:
    pool = _Pool(history=_many(), rows=[_row(k) for k in range(64)])
    size = len(json.dumps(fig_module.encode(_figure(pool))))
    assert size < 80_000, size  # 64 lines of 300 points each would be ~10 times this


def test_at_1024_ranks_that_all_failed_the_status_is_a_row_per_kind_of_trouble() -> None:
    """Past TROUBLE_ROWS ranks in trouble, the table has a row per kind of trouble (1,024 failed
    ranks once made a 2.2 MB live update of 1,024 rows)."""
    rows = [_row(k, state=RankState.FAILED, problem=f"failed: ValueError: bad {k}") for k in range(1020)]
    rows += [_row(k, state=RankState.DEAD, problem="dead: was killed by SIGKILL") for k in range(1020, 1023)]
    rows.append(_row(1023))
    columns = status_trace(rows)["cells"]["values"]
    assert columns[0] == ["0-1019", "1020-1022", "1023"]
    assert columns[1] == [
        "failed: ValueError: bad 0 (and 1019 more)",
        "dead: was killed by SIGKILL (and 2 more)",
        "running (1)",
    ]
    from jupyter_shard.notebook.figure import TROUBLE_ROWS

    few = [_row(k, problem="stuck: no heartbeat for 9 s") for k in range(TROUBLE_ROWS)] + [
        _row(k) for k in range(TROUBLE_ROWS, 64)
    ]
    assert len(status_trace(few)["cells"]["values"][0]) == TROUBLE_ROWS + 1  # each on its own
