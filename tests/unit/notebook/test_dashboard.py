"""The dashboard's rendering and its update rate, with a stand-in pool (no ranks)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from jupyter_shard.kernel.history import History
from jupyter_shard.kernel.ranks import RankSnapshot, RankState
from jupyter_shard.notebook import dashboard as dash
from jupyter_shard.notebook.charts import line_chart, nice_ticks


@dataclass
class _Spec:
    def describe(self) -> str:
        return "8 CPU ranks · ddp"


@dataclass
class _Pool:
    history: History = field(default_factory=History)
    spec: _Spec = field(default_factory=_Spec)
    background: Any = None
    rows: list[RankSnapshot] = field(default_factory=list)
    interrupted: int = 0

    def activity(self) -> list[RankSnapshot]:
        return self.rows

    def interrupt(self) -> None:
        self.interrupted += 1


def _row(rank: int, problem: str = "", state: RankState = RankState.RUNNING) -> RankSnapshot:
    return RankSnapshot(
        rank=rank,
        state=state,
        step=10.0,
        steps_per_s=5.0,
        memory={"rss": 300 * 2**20},
        heartbeat_age=0.4,
        cell="for step in ...",
        last_line="epoch 1",
        problem=problem,
    )


def _big_pool(ranks: int = 8, points: int = 100_000) -> _Pool:
    pool = _Pool(rows=[_row(k) for k in range(ranks)])
    for k in range(ranks):
        pool.history.extend(
            k, [{"step": s, "ts": float(s), "values": {"loss": 1.0 / s + k}} for s in range(1, points + 1)]
        )
        pool.history.add_memory(k, 1.0, {"rss": 2**28})
        pool.history.add_memory(k, 2.0, {"rss": 2**29})
    return pool


def test_eight_ranks_of_100k_points_draw_a_few_hundred_points_each_and_count_all() -> None:
    pool = _big_pool()
    markup = dash.render(pool, compact=False)  # type: ignore[arg-type]
    traces = re.findall(
        r'<polyline class="jshard-trace" data-rank="(\w+)" data-points="(\d+)" points="([^"]*)"', markup
    )
    loss = [t for t in traces if t[0] != "mean"][:8]
    assert [int(n) for _, n, _ in loss] == [100_000] * 8
    assert all(len(points.split()) <= dash.BINS for _, _, points in traces)
    assert any(rank == "mean" for rank, _, _ in traces)
    assert 'data-metric="memory"' in markup
    assert len(markup) < 400_000


def test_problem_ranks_stand_out_in_the_status_table() -> None:
    pool = _Pool(
        rows=[_row(0), _row(1, "dead: was killed by SIGKILL", RankState.DEAD), _row(2, "stuck: no heartbeat")]
    )
    table = dash.status_table(pool.rows)
    assert '<tr data-rank="1" data-state="dead" style="background:#fde2e1">' in table
    assert '<tr data-rank="2" data-state="stuck" style="background:#fff3cd">' in table
    assert '<tr data-rank="0" data-state="running">' in table
    assert "dead: was killed by SIGKILL" in table


def test_text_from_ranks_is_escaped() -> None:
    row = dataclasses.replace(_row(0), last_line="<script>alert(1)</script>")
    assert "<script>" not in dash.status_table([row]) and "&lt;script&gt;" in dash.status_table([row])
    assert 'data-metric="a&quot;b"' in line_chart('a"b', [], title="t", x_label="step")


def test_redraws_are_coalesced_to_at_most_five_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(dash.time, "monotonic", lambda: clock[0])
    pool = _Pool(rows=[_row(0)])
    board = dash.Dashboard(pool, compact=True)  # type: ignore[arg-type]
    for i in range(1, 2001):  # 2000 metric batches over 2 seconds, a refresh after each
        clock[0] += 0.001
        pool.history.extend(0, [{"step": i, "ts": clock[0], "values": {"loss": 1.0 / i}}])
        board.refresh(pool, False)  # type: ignore[arg-type]
    assert 8 <= board.redraws <= 10
    drawn = board.redraws
    board.refresh(pool, True)  # type: ignore[arg-type]
    assert board.redraws == drawn + 1, "the final refresh draws at once"
    clock[0] += 5
    board.refresh(pool, False)  # type: ignore[arg-type]
    assert board.redraws == drawn + 1, "nothing changed: no redraw"


class _SlowView:
    """Stands in for the HTML widget: setting its value (serialising and sending it) takes time."""

    def __init__(self, clock: list[float], cost: float) -> None:
        self._clock, self._cost, self._value = clock, cost, ""

    @property
    def value(self) -> str:
        return self._value

    @value.setter
    def value(self, markup: str) -> None:
        self._clock[0] += self._cost
        self._value = markup


def test_sending_a_redraw_counts_towards_the_render_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing is free here but sending each redraw takes 50 ms: at most 2% of a core for both
    means a redraw every 2.5 s, not every 0.2 s."""
    clock = [1000.0]
    monkeypatch.setattr(dash.time, "monotonic", lambda: clock[0])
    pool = _Pool(rows=[_row(0)])
    board = dash.Dashboard(pool, compact=True)  # type: ignore[arg-type]
    board._view = _SlowView(clock, 0.05)  # type: ignore[assignment]
    for i in range(1, 10_001):  # 10 s of metric batches, a refresh every millisecond
        clock[0] += 0.001
        pool.history.extend(0, [{"step": i, "ts": clock[0], "values": {"loss": 1.0 / i}}])
        board.refresh(pool, False)  # type: ignore[arg-type]
    assert 4 <= board.redraws <= 5, board.redraws


def test_static_bundle_has_the_charts_and_a_text_summary() -> None:
    pool = _big_pool(ranks=2, points=50)
    board = dash.Dashboard(pool)  # type: ignore[arg-type]
    bundle = board._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"].startswith('<div class="jshard-dashboard"')
    assert bundle["text/plain"].splitlines() == [
        "jupyter_shard dashboard · 8 CPU ranks · ddp",
        "rank 0: running, step 10, loss 0.02",
        "rank 1: running, step 10, loss 1.02",
    ]
    board.children[1].click()
    assert pool.interrupted == 1


def test_nice_ticks_are_round_and_cover_the_range() -> None:
    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    ticks = nice_ticks(3.7, 981.2)
    assert ticks[0] >= 3.7 and ticks[-1] <= 981.2 and len(ticks) >= 3
    assert nice_ticks(5, 5) == [5]
