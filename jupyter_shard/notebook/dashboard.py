"""The live dashboard: per-rank status, every ``shard.log`` scalar by rank and their mean, memory.

One ``ipywidgets.HTML`` carries the whole view, so a redraw is one comm message however many
ranks and charts; redraws are coalesced to at most :data:`MIN_INTERVAL` apart, happen only when
something changed, and space out further when drawing is slow (long series), so the kernel stays
responsive. The pool calls :meth:`Dashboard.refresh` from whichever thread is receiving:
the cell's own thread in the foreground, the watcher thread for background runs and between cells.

:class:`CellDashboard` is the compact one a ``%%distributed`` cell shows when it logs: once the
cell ends it is replaced by the same HTML as a plain ``text/html`` output, so a saved notebook
shows the final charts without a kernel.
"""

from __future__ import annotations

import html
import time
from typing import TYPE_CHECKING, Any

import ipywidgets
from IPython.display import DisplayHandle, display

from jupyter_shard.kernel.history import History, binned, mean_across
from jupyter_shard.kernel.ranks import RankSnapshot, RankState
from jupyter_shard.notebook.charts import Trace, fmt, line_chart

if TYPE_CHECKING:
    from jupyter_shard.kernel.pool import Pool

MIN_INTERVAL = 0.2  # seconds between redraws of one dashboard: at most 5 a second
RENDER_SHARE = 0.02  # and longer apart when drawing is slow: drawing and sending take at most 2% of a core
BUSY_INTERVAL = 1.0  # while ranks run, status and memory move even when no metric does
IDLE_INTERVAL = 5.0  # between cells, only heartbeats move
BINS = 300  # points drawn per series, however long it is
SAMPLE = 16 * BINS  # records read per series for a redraw: evenly spaced, the last one always
COMPACT_METRICS = 2

COLUMNS = ("rank", "state", "step", "steps/s", "memory", "heartbeat", "cell", "last line")
_CELL = ' style="padding: 1px 8px; text-align: left"'
_STATE_COLORS = {"dead": "#fde2e1", "stuck": "#fff3cd"}


def metric_chart(history: History, name: str, width: int, height: int) -> str:
    sampled = {rank: history.sampled(rank, name, SAMPLE) for rank in history.ranks}
    raw = {rank: (x, y) for rank, (x, y, _) in sampled.items() if len(x)}
    if not raw:
        return line_chart(name, [], title=name, x_label="step", width=width, height=height)
    lo = min(float(x.min()) for x, _ in raw.values())
    hi = max(float(x.max()) for x, _ in raw.values())
    traces = [Trace(str(k), *binned(x, y, lo, hi, BINS), points=sampled[k][2]) for k, (x, y) in raw.items()]
    title = name
    if len(raw) > 1:
        mx, my = mean_across(list(raw.values()), lo, hi, BINS)
        traces.append(Trace("mean", mx, my, points=len(mx)))
        title += f" (mean of {len(raw)} ranks: {my[-1]:.4g})"
    else:
        title += f" ({traces[0].y[-1]:.4g})"
    return line_chart(name, traces, title=title, x_label="step", width=width, height=height)


def memory_chart(history: History, width: int, height: int) -> str:
    series = {rank: history.memory(rank) for rank in history.memory_ranks}
    cuda = any(bool((c == c).any()) for _, _, c in series.values())  # any non-NaN CUDA sample
    what = "CUDA allocated" if cuda else "host RSS"
    start = min((float(t[0]) for t, _, _ in series.values() if len(t)), default=0.0)
    traces = []
    for rank, (t, rss, alloc) in series.items():
        y = (alloc if cuda else rss) / 2**20
        x, y = binned(t - start, y, 0.0, float(t[-1] - start) if len(t) else 0.0, BINS)
        traces.append(Trace(str(rank), x, y, points=len(t)))
    return line_chart(
        "memory", traces, title=f"memory per rank: {what}, MiB", x_label="seconds", width=width, height=height
    )


def status_table(rows: list[RankSnapshot]) -> str:
    head = "".join(
        f"<th>{c}</th>"
        for c in ("rank", "state", "step", "steps/s", "memory", "heartbeat", "cell", "last line")
    )
    body = []
    for row in rows:
        kind = row.problem.split(":", 1)[0]
        state = row.problem or row.state.value
        style = f' style="background:{_STATE_COLORS[kind]}"' if kind in _STATE_COLORS else ""
        cells = [
            str(row.rank),
            state,
            fmt(row.step) if row.step is not None else "-",
            f"{row.steps_per_s:.1f}" if row.steps_per_s is not None else "-",
            _memory(row.memory),
            f"{row.heartbeat_age:.0f} s ago" if row.heartbeat_age is not None else "-",
            row.cell or "-",
            row.last_line or "",
        ]
        tds = "".join(f"<td{_CELL}>{html.escape(c)}</td>" for c in cells)
        body.append(f'<tr data-rank="{row.rank}" data-state="{kind or row.state.value}"{style}>{tds}</tr>')
    return (
        '<table class="jshard-status" style="font-size: 12px; border-collapse: collapse">'
        f"<tr>{head}</tr>{''.join(body)}</table>"
    )


def _memory(memory: dict[str, int]) -> str:
    if not memory:
        return "-"
    text = f"{memory.get('rss', 0) / 2**20:.0f} MiB"
    if "cuda_allocated" in memory:
        text += (
            f" · cuda {memory['cuda_allocated'] / 2**20:.0f} / {memory.get('cuda_reserved', 0) / 2**20:.0f}"
            f" / peak {memory.get('cuda_peak', 0) / 2**20:.0f} MiB"
        )
    return text


def render(pool: Pool, *, compact: bool) -> str:
    """The dashboard's HTML for the pool's current state."""
    history = pool.history
    names = history.metrics
    width, height = (380, 170) if compact else (460, 210)
    charts = [
        metric_chart(history, n, width, height) for n in (names[:COMPACT_METRICS] if compact else names)
    ]
    charts.append(memory_chart(history, width, height))
    title = pool.spec.describe()
    run = pool.background
    if run is not None and run.running:
        title += f" · {run.describe()}"
    note = " · older points thinned 2:1 to bound memory" if history.thinned else ""
    return (
        '<div class="jshard-dashboard" style="font-family: sans-serif">'
        f"<div><b>{html.escape(title)}</b>{note}</div>"
        f"{status_table(pool.activity())}"
        f'<div style="display: flex; flex-wrap: wrap; gap: 8px">{"".join(charts)}</div></div>'
    )


def text_summary(pool: Pool) -> str:
    """Plain-text twin of the dashboard (saved notebooks viewed as text, consoles)."""
    lines = [f"jupyter_shard dashboard · {pool.spec.describe()}"]
    for row in pool.activity():
        values = []
        for name in pool.history.metrics:
            _, y = pool.history.series(row.rank, name)
            if len(y):
                values.append(f"{name} {y[-1]:.4g}")
        step = fmt(row.step) if row.step is not None else "-"
        lines.append(f"rank {row.rank}: {row.problem or row.state.value}, step {step}, " + ", ".join(values))
    return "\n".join(lines)


class Dashboard(ipywidgets.VBox):  # type: ignore[misc]
    """A live view of one pool; ``refresh`` is called by the pool and redraws at most 5 times a second."""

    def __init__(self, pool: Pool, *, compact: bool = False) -> None:
        self._view = ipywidgets.HTML(render(pool, compact=compact))
        stop = ipywidgets.Button(description="Interrupt", icon="stop", tooltip="%dist_interrupt")
        stop.on_click(lambda _: pool.interrupt())
        super().__init__([self._view, stop] if not compact else [self._view])
        self.compact = compact
        self.redraws = 0
        self._pool = pool
        self._drawn_at = time.monotonic()
        self._drawn_version = pool.history.version
        self._interval = MIN_INTERVAL

    def refresh(self, pool: Pool, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._drawn_at < self._interval:
            return
        if not final and pool.history.version == self._drawn_version:
            if now - self._drawn_at < BUSY_INTERVAL:
                return
            running = any(row.state is RankState.RUNNING for row in pool.activity())
            if not running and now - self._drawn_at < IDLE_INTERVAL:
                return
        self._drawn_at, self._drawn_version = now, pool.history.version
        markup = render(pool, compact=self.compact)
        if markup != self._view.value:
            self._view.value = markup  # serialised and sent to the front end here: part of the cost
            self.redraws += 1
        self._interval = max(MIN_INTERVAL, (time.monotonic() - now) / RENDER_SHARE)

    @property
    def html(self) -> str:
        return str(self._view.value)

    def close(self) -> None:
        """Close the widget and its parts (each holds a comm in the kernel and the front end)."""
        for child in self.children:
            child.close()
        self._view.close()
        super().close()

    def static_bundle(self) -> dict[str, Any]:
        return {"text/html": self.html, "text/plain": text_summary(self._pool)}

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle: dict[str, Any] = super()._repr_mimebundle_(**kwargs) or {}
        return {**bundle, **self.static_bundle()}


class CellDashboard:
    """Shows a compact :class:`Dashboard` under the running cell once it logs; static when it ends."""

    def __init__(self, pool: Pool, *, show_now: bool = False) -> None:
        self._pool = pool
        self._baseline = len(pool.history)
        self.dashboard: Dashboard | None = None
        self._handle: DisplayHandle | None = None
        if show_now:
            self._show()

    def _show(self) -> None:
        self.dashboard = Dashboard(self._pool, compact=True)
        self._handle = display(self.dashboard, display_id=True)

    def refresh(self, pool: Pool, final: bool) -> None:
        if self.dashboard is None and len(pool.history) > self._baseline:
            self._show()
        if self.dashboard is not None:
            self.dashboard.refresh(pool, final)
        if final:
            self.close()

    def close(self) -> None:
        if self in self._pool.observers:
            self._pool.observers.remove(self)
        if self.dashboard is not None and self._handle is not None:
            self._handle.update(self.dashboard.static_bundle(), raw=True)
            self.dashboard.close()
