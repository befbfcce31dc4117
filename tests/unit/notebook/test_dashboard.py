"""The dashboard's figure, its fallbacks and its update rate, with a stand-in pool (no ranks) and a
stand-in for IPython's display (what each redraw sends is kept); ``%dist_status``'s table."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import plotly
import pytest

from jupyter_shard.notebook import dashboard as dash
from jupyter_shard.notebook.charts import line_chart, nice_ticks
from jupyter_shard.notebook.figure import BINS, ROW_COLORS, status_trace
from jupyter_shard.pool.figures import decode
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankSnapshot, RankState


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
    observers: list[Any] = field(default_factory=list)

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


class _Handle:
    """Stands in for IPython's display handle: keeps what each update sent; sending takes ``cost``
    seconds of the stand-in clock (serialising and sending a redraw is part of its cost)."""

    def __init__(self, bundle: dict[str, Any], clock: list[float], cost: float) -> None:
        self.bundles = [bundle]
        self._clock, self._cost = clock, cost

    def update(self, bundle: dict[str, Any], raw: bool = False) -> None:
        assert raw
        self._clock[0] += self._cost
        self.bundles.append(bundle)


@dataclass
class _Screen:
    """What ``display`` showed, in order: widgets and raw bundles (with their handles)."""

    clock: list[float] = field(default_factory=lambda: [1000.0])
    cost: float = 0.0
    shown: list[Any] = field(default_factory=list)

    def display(self, obj: Any, raw: bool = False, display_id: bool = False) -> _Handle | None:
        if not raw:
            self.shown.append(obj)
            return None
        handle = _Handle(obj, self.clock, self.cost)
        self.shown.append(handle)
        return handle


@pytest.fixture
def screen(monkeypatch: pytest.MonkeyPatch) -> _Screen:
    shown = _Screen()
    monkeypatch.setattr(dash, "display", shown.display)
    monkeypatch.setattr(dash.time, "monotonic", lambda: shown.clock[0])
    return shown


def _traces(bundle: dict[str, Any]) -> list[dict[str, Any]]:
    figure = bundle[dash.LIVE_MIME]["figure"]
    if isinstance(figure, str):
        figure = bundle[figure]
    traces: list[dict[str, Any]] = decode(figure)["data"]
    return traces


def test_eight_ranks_of_100k_points_draw_a_thousand_points_each_and_count_all(screen: _Screen) -> None:
    pool = _big_pool()
    board = dash.Dashboard(pool)  # type: ignore[arg-type]
    bundle = board.live_bundle()
    traces = _traces(bundle)
    loss = [t for t in traces if t.get("uid", "").startswith("loss-")]
    assert [t["meta"]["points"] for t in loss if t["meta"]["rank"] != "mean"] == [100_000] * 8
    assert all(len(t["x"]) == len(t["y"]) <= BINS for t in loss)
    assert loss[-1]["name"] == "mean" and loss[-1]["line"]["dash"] == "dash"
    # the mean of ranks k: 1/s + k, binned, ends near 3.5 (the mean of 0..7)
    assert abs(loss[-1]["y"][-1] - 3.5) < 1e-3
    assert [t["legendgroup"] for t in loss[:8]] == [f"rank {k}" for k in range(8)]
    memory = [t for t in traces if t.get("uid", "").startswith("memory-")]
    assert [t["y"] for t in memory[:1]] == [[256.0, 512.0]]  # MiB
    (table,) = [t for t in traces if t["type"] == "table"]
    assert table["cells"]["values"][0] == [str(k) for k in range(8)]
    assert decode(bundle[dash.LIVE_MIME]["figure"])["layout"]["uirevision"] == "jupyter_shard"
    assert len(json.dumps(bundle)) < 400_000
    assert bundle["text/plain"].startswith("jupyter_shard dashboard · 8 CPU ranks · ddp\n")


def test_problem_ranks_stand_out_in_the_status_table() -> None:
    pool = _Pool(
        rows=[_row(0), _row(1, "dead: was killed by SIGKILL", RankState.DEAD), _row(2, "stuck: no heartbeat")]
    )
    table = dash.status_table(pool.rows)
    assert '<tr data-rank="1" data-state="dead" style="background:#fde2e1">' in table
    assert '<tr data-rank="2" data-state="stuck" style="background:#fff3cd">' in table
    assert '<tr data-rank="0" data-state="running">' in table
    assert "dead: was killed by SIGKILL" in table
    trace = status_trace(pool.rows)
    assert trace["cells"]["fill"]["color"][0] == ["#ffffff", "#fde2e1", "#fff3cd"]
    assert trace["cells"]["values"][1][1] == "dead: was killed by SIGKILL"


def test_a_broken_rank_has_its_own_red_and_its_problem_shown() -> None:
    problem = (
        "broken: CUDA context lost (CUDA error: device-side assert triggered); %dist_restart for fresh ranks"
    )
    rows = [_row(0, "dead: exited with code 1", RankState.DEAD), _row(1, problem, RankState.BROKEN)]
    broken = ROW_COLORS["broken"]
    assert broken not in (ROW_COLORS["dead"], ROW_COLORS["stuck"], "#ffffff")
    table = dash.status_table(rows)
    assert f'<tr data-rank="1" data-state="broken" style="background:{broken}">' in table
    assert "CUDA context lost (CUDA error: device-side assert triggered)" in table
    trace = status_trace(rows)
    assert trace["cells"]["fill"]["color"][0] == [ROW_COLORS["dead"], broken]
    assert trace["cells"]["values"][1][1] == problem
    bare = _row(2, state=RankState.BROKEN)  # the state alone is enough
    assert status_trace([bare])["cells"]["fill"]["color"][0] == [broken]
    assert f'data-state="broken" style="background:{broken}"' in dash.status_table([bare])


def test_status_table_text_and_html() -> None:
    rows = [
        RankSnapshot(
            rank=0,
            pid=101,
            host="host-a",
            device="cpu",
            state=RankState.IDLE,
            memory={"rss": 200 * 2**20},
            cell="",
            log_path="/logs/rank-0.log",
        ),
        RankSnapshot(
            rank=1,
            pid=102,
            host="host-a",
            device="cuda:1",
            state=RankState.DEAD,
            memory={"rss": 0, "cuda_allocated": 3 * 2**20},
            cell="c<1>",
            log_path="/logs/rank-1.log",
            exit="exited with code 3",
        ),
    ]
    table = dash.StatusTable("2 CPU ranks · none", rows)
    text = repr(table).splitlines()
    assert text[0] == "2 CPU ranks · none"
    assert text[1] == "2 ranks: 1 idle, 1 dead"
    assert text[2].split() == ["rank", "pid", "host", "device", "state", "memory", "cell"]
    assert text[3].split() == ["0", "101", "host-a", "cpu", "idle", "200", "MiB", "-"]
    assert "dead (exited with code 3)" in text[4]
    assert "- · cuda 3 MiB" in text[4]
    assert text[5] == "logs: /logs/rank-<k>.log"  # one footer line, not a column
    html = table._repr_html_()
    assert ">rank</th>" in html and "logs: /logs/rank-&lt;k&gt;.log" in html
    assert "c&lt;1&gt;" in html and "c<1>" not in html


def test_status_at_64_ranks_is_a_summary_and_a_line_per_rank() -> None:
    cell = "for step in range(300): loss = train_one_step(model, batch, optimizer, scheduler)"
    rows = [
        RankSnapshot(
            rank=k,
            pid=1000 + k,
            host="node-a",
            device="cpu",
            state=RankState.RUNNING if k != 5 else RankState.DEAD,
            memory={"rss": 210 * 2**20},
            cell=cell if k != 5 else "",
            log_path=f"/home/me/project/logs/jupyter_shard/2026-11-29/rank-{k}.log",
            problem="stuck: no heartbeat for 9 s"
            if k == 7
            else ("dead: exited with code 1" if k == 5 else ""),
        )
        for k in range(64)
    ]
    text = repr(dash.StatusTable("64 CPU ranks · ddp", rows)).splitlines()
    assert text[1] == "64 ranks: 63 running, 1 dead · needs attention: rank 5 (dead), rank 7 (stuck)"
    table = text[2 : 2 + 65]
    assert len(table) == 65 and table[-1].split()[0] == "63"
    assert max(map(len, table)) <= 110, max(table, key=len)  # a rank's row fits one line
    assert text[67] == "logs: /home/me/project/logs/jupyter_shard/2026-11-29/rank-<k>.log"
    assert text[68:] == ["rank 5: dead: exited with code 1", "rank 7: stuck: no heartbeat for 9 s"]
    assert len(text) == 70  # against 3.3 screens of wrapped rows


def test_status_shows_how_the_ranks_came_above_the_table() -> None:
    row = RankSnapshot(
        rank=0, pid=7, host="h", device="cuda:0", state=RankState.IDLE, memory={}, cell="", log_path="/l"
    )
    path = "zygote (fork server, pid 4242) · CUDA_VISIBLE_DEVICES=4,6"
    table = dash.StatusTable("2 GPU ranks (GPUs 0,2) · ddp", [row], path)
    text = repr(table).splitlines()
    assert text[:3] == ["2 GPU ranks (GPUs 0,2) · ddp", f"ranks: {path}", "1 rank: 1 idle"]
    assert text[3].split()[0] == "rank"
    assert f"<i>ranks: {path}</i>" in table._repr_html_()


def test_status_names_each_ranks_problem_under_the_table() -> None:
    problem = (
        "broken: CUDA context lost (CUDA error: device-side assert triggered); %dist_restart for fresh ranks"
    )
    rows = [
        RankSnapshot(rank=0, pid=7, host="h", device="cuda:0", state=RankState.IDLE, log_path="/l0"),
        RankSnapshot(
            rank=1, pid=8, host="h", device="cuda:1", state=RankState.BROKEN, log_path="/l1", problem=problem
        ),
    ]
    table = dash.StatusTable("2 GPU ranks · ddp", rows)
    text = repr(table).splitlines()
    assert text[1] == "2 ranks: 1 idle, 1 broken · needs attention: rank 1 (broken)"
    assert text[4].split()[:5] == ["1", "8", "h", "cuda:1", "broken"]
    assert text[5:] == ["logs:", "  rank 0: /l0", "  rank 1: /l1", f"rank 1: {problem}"]
    assert table._repr_html_().endswith(f"<div>rank 1: {problem}</div></div>")
    assert not any(line.startswith("rank 0:") for line in text)  # rank 0 has no problem
    assert "<div>rank 0:" not in table._repr_html_()


def test_text_from_ranks_is_escaped() -> None:
    row = dataclasses.replace(_row(0), last_line="<script>alert(1)</script>")
    assert "<script>" not in dash.status_table([row]) and "&lt;script&gt;" in dash.status_table([row])
    assert status_trace([row])["cells"]["values"][-1] == ["&lt;script&gt;alert(1)&lt;/script&gt;"]
    assert 'data-metric="a&quot;b"' in line_chart('a"b', [], title="t", x_label="step")


def test_redraws_are_coalesced_to_at_most_five_a_second(screen: _Screen) -> None:
    pool = _Pool(rows=[_row(0)])
    board = dash.Dashboard(pool, compact=True)  # type: ignore[arg-type]
    handle = board.show()
    for i in range(1, 2001):  # 2000 metric batches over 2 seconds, a refresh after each
        screen.clock[0] += 0.001
        pool.history.extend(0, [{"step": i, "ts": screen.clock[0], "values": {"loss": 1.0 / i}}])
        board.refresh(pool, False)  # type: ignore[arg-type]
    assert 8 <= board.redraws <= 10
    assert len(handle.bundles) == board.redraws + 1, "one message per redraw"
    assert set(handle.bundles[-1]) == {dash.LIVE_MIME, "text/html", "text/plain"}
    assert "<svg" not in handle.bundles[-1]["text/html"], "the SVG charts come only with the saved form"
    drawn = board.redraws
    board.refresh(pool, True)  # type: ignore[arg-type]
    assert board.redraws == drawn + 1, "the final refresh draws at once"
    screen.clock[0] += 5
    board.refresh(pool, False)  # type: ignore[arg-type]
    assert board.redraws == drawn + 1, "nothing changed: no redraw"


def test_sending_a_redraw_counts_towards_the_render_share(screen: _Screen) -> None:
    """Drawing is free here but sending each redraw takes 50 ms: at most 2% of a core for both
    means a redraw every 2.5 s, not every 0.2 s."""
    screen.cost = 0.05
    pool = _Pool(rows=[_row(0)])
    board = dash.Dashboard(pool, compact=True)  # type: ignore[arg-type]
    board.show()
    for i in range(1, 10_001):  # 10 s of metric batches, a refresh every millisecond
        screen.clock[0] += 0.001
        pool.history.extend(0, [{"step": i, "ts": screen.clock[0], "values": {"loss": 1.0 / i}}])
        board.refresh(pool, False)  # type: ignore[arg-type]
    assert 4 <= board.redraws <= 5, board.redraws


def test_a_cell_dashboard_ends_as_the_static_bundle(screen: _Screen) -> None:
    pool = _big_pool(ranks=2, points=50)
    cell = dash.CellDashboard(pool, show_now=True)  # type: ignore[arg-type]
    pool.observers.append(cell)
    (handle,) = screen.shown
    first = handle.bundles[0]
    assert set(first) == {dash.LIVE_MIME, "text/html", "text/plain"}, "nbval compares the first draw"
    cell.refresh(pool, final=True)  # type: ignore[arg-type]
    final = handle.bundles[-1]
    assert len(handle.bundles) == 2 and pool.observers == []
    assert final[dash.LIVE_MIME] == {"figure": dash.PLOTLY_MIME}
    assert final["text/html"].startswith('<div class="jshard-dashboard"')
    assert final["text/plain"].splitlines() == [
        "jupyter_shard dashboard · 8 CPU ranks · ddp",
        "rank 0: running, step 10, loss 0.02",
        "rank 1: running, step 10, loss 1.02",
    ]
    loss = [t for t in _traces(final) if t.get("uid", "").startswith("loss-")]
    assert [t["x"] for t in loss] == [list(map(float, range(1, 51)))] * 3, "every step while short"
    assert loss[2]["y"][0] == pytest.approx(1.5)  # the mean of 1.0 and 2.0 at step 1


def test_the_full_dashboard_has_an_interrupt_button_and_closes_static(screen: _Screen) -> None:
    pool = _big_pool(ranks=2, points=50)
    board = dash.Dashboard(pool)  # type: ignore[arg-type]
    board._ipython_display_()  # what display(board) in %dist_dashboard calls
    button, handle = screen.shown
    button.click()
    assert pool.interrupted == 1
    board.close()
    assert dash.PLOTLY_MIME in handle.bundles[-1]
    board.close()
    assert len(handle.bundles) == 2, "closing twice sends nothing more"


def test_nice_ticks_are_round_and_cover_the_range() -> None:
    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    ticks = nice_ticks(3.7, 981.2)
    assert ticks[0] >= 3.7 and ticks[-1] <= 981.2 and len(ticks) >= 3
    assert nice_ticks(5, 5) == [5]


def test_plotlys_jupyterlab_renderer_ships_prebuilt_with_the_plotly_package() -> None:
    """The saved figure needs no Node and nothing fetched: plotly's wheel brings its mime renderer."""
    found = Path(sys.prefix, "share", "jupyter", "labextensions", "jupyterlab-plotly", "package.json")
    meta = json.loads(found.read_text())
    assert meta["version"] == plotly.__version__
    assert meta["jupyterlab"]["mimeExtension"] is True and "load" in meta["jupyterlab"]["_build"]
    assert list(found.parent.glob("static/remoteEntry.*.js")), "no prebuilt bundle"


def test_on_gpu_the_memory_chart_has_allocated_reserved_and_peak_per_rank() -> None:
    pool = _Pool(rows=[_row(0), _row(1)])
    for rank in (0, 1):
        for t in (1.0, 2.0):
            pool.history.add_memory(
                rank,
                t,
                {"rss": 2**30, "cuda_allocated": 2**20, "cuda_reserved": 2**21, "cuda_peak": 3 * 2**20},
            )
    board = dash.Dashboard(pool)  # type: ignore[arg-type]
    figure = decode(board.live_bundle()[dash.LIVE_MIME]["figure"])
    memory = [t for t in figure["data"] if t.get("uid", "").startswith("memory-")]
    assert [(t["uid"], t["line"]["dash"], t["y"]) for t in memory[:3]] == [
        ("memory-0-cuda_allocated", "solid", [1.0, 1.0]),
        ("memory-0-cuda_reserved", "dash", [2.0, 2.0]),
        ("memory-0-cuda_peak", "dot", [3.0, 3.0]),
    ]
    assert [t["showlegend"] for t in memory] == [True, False, False] * 2
    assert any(
        "CUDA allocated, reserved (dashed), peak (dotted)" in a["text"]
        for a in figure["layout"]["annotations"]
    )


def test_with_the_extension_a_64_rank_update_leaves_the_html_out_and_is_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extension draws the figure; the HTML table was most of each 64-rank update before."""
    from jupyter_shard.notebook import panel
    from tests.unit.notebook.test_figure import _many

    pool = _Pool(history=_many(), rows=[_row(k) for k in range(64)])
    board = dash.Dashboard(pool, compact=True)  # type: ignore[arg-type]
    plain = board.live_bundle()
    assert "text/html" in plain  # no extension: other frontends show the HTML table
    monkeypatch.setattr(panel, "_open", [object()])
    bundle = board.live_bundle()
    assert set(bundle) == {dash.LIVE_MIME, "text/plain"}
    size = len(json.dumps(bundle))
    assert size < 50_000, size
    assert plain["text/html"].count("<tr data-rank=") == 1  # 64 ranks alike: one row (33 KB before)
    assert len(plain["text/html"]) < 2_000


def test_the_saved_html_of_1024_ranks_draws_their_band_not_a_line_each() -> None:
    """The HTML/SVG fallback a saved notebook keeps: from 9 ranks each chart is the lowest, highest
    and mean of all ranks (1,024 lines each once made it 2 MB)."""
    pool = _big_pool(ranks=1024, points=40)
    page = dash.render(pool, compact=True)  # type: ignore[arg-type]
    assert page.count('class="jshard-trace"') == 2 * 3  # loss and memory: min, max, mean
    assert 'data-rank="min"' in page and 'data-rank="max"' in page and 'data-rank="17"' not in page
    assert len(page) < 60_000, len(page)
    few = dash.render(_big_pool(ranks=4, points=40), compact=True)  # type: ignore[arg-type]
    assert few.count('class="jshard-trace"') == 2 * 4 + 1  # below 9 ranks: a line each, the loss's mean


def test_the_text_twin_of_1024_ranks_is_a_summary_not_a_line_per_rank() -> None:
    """The dashboard's text/plain (what a saved notebook read as text, a console and every live
    update carry): from 9 ranks a line per state and per rank in trouble, and each metric's spread
    with the ranks at its ends; 1,024 lines made it 47 KB of every 1,024-rank update."""
    pool = _big_pool(ranks=1024, points=40)
    pool.rows[5] = _row(5, "dead: was killed by SIGKILL", RankState.DEAD)
    text = dash.text_summary(pool)  # type: ignore[arg-type]
    assert text.splitlines() == [
        "jupyter_shard dashboard · 8 CPU ranks · ddp",
        "rank 5: dead: was killed by SIGKILL, step 10",
        "ranks 0-4,6-1023: running (1023), step 10",
        "loss: mean 511.5, lowest 0.025 (rank 0), highest 1023 (rank 1023)",
    ]
    few = dash.text_summary(_big_pool(ranks=2, points=40))  # type: ignore[arg-type]
    assert few.splitlines()[1:] == [
        "rank 0: running, step 10, loss 0.025",
        "rank 1: running, step 10, loss 1.025",
    ]
