"""The live dashboard: per-rank status, every ``shard.log`` scalar by rank and their mean, memory.

The dashboard is one output whose content is one Plotly figure (:mod:`jupyter_shard.notebook.figure`).
A redraw is one ``update_display_data`` message carrying the figure under
:data:`LIVE_MIME`, which the JupyterLab extension draws in place with ``Plotly.react``: zoom, hidden
ranks and the log switch stay as the user left them. Redraws are coalesced to at most
:data:`MIN_INTERVAL` apart, happen only when something changed, and space out further when drawing
and sending are slow (:data:`RENDER_SHARE`). The pool calls :meth:`Dashboard.refresh` from whichever
thread is receiving: the cell's own thread in the foreground, the watcher thread for background runs
and between cells.

When a cell ends (``final``) the output becomes the static bundle: the figure as
``application/vnd.plotly.v1+json`` (interactive without a kernel in JupyterLab and Notebook 7), the
same dashboard as HTML with SVG charts for renderers without Plotly (GitHub, nbconvert), and a text
twin for nbval and consoles. :class:`CellDashboard` is the compact one a ``%%distributed`` cell
shows when it logs. :class:`StatusTable` is ``%dist_status``'s table (where each rank runs, and why
one needs attention).
"""

from __future__ import annotations

import html
import time
from typing import TYPE_CHECKING, Any

import ipywidgets
from IPython.display import DisplayHandle, display

from jupyter_shard.notebook.charts import Trace, fmt, line_chart
from jupyter_shard.notebook.figure import (
    BAND_FROM,
    COMPACT_METRICS,
    ROW_COLORS,
    dashboard_figure,
    status_rows,
)
from jupyter_shard.notebook.panel import frontend_attached
from jupyter_shard.pool.figures import band_across, binned, encode, mean_across
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankSnapshot, RankState

if TYPE_CHECKING:
    from jupyter_shard.pool.pool import Pool

LIVE_MIME = "application/vnd.jupyter-shard.figure+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
MIN_INTERVAL = 0.2  # seconds between redraws of one dashboard: at most 5 a second
RENDER_SHARE = 0.02  # and longer apart when drawing is slow: drawing and sending take at most 2% of a core
BUSY_INTERVAL = 1.0  # while ranks run, status and memory move even when no metric does
IDLE_INTERVAL = 5.0  # between cells, only heartbeats move
SVG_BINS = 300  # points per series in the HTML fallback's SVG charts
SVG_SAMPLE = 16 * SVG_BINS

COLUMNS = ("rank", "state", "step", "steps/s", "memory", "heartbeat", "cell", "last line")
_CELL = ' style="padding: 1px 8px; text-align: left"'


def svg_metric_chart(history: History, name: str, width: int, height: int) -> str:
    sampled = {rank: history.sampled(rank, name, SVG_SAMPLE) for rank in history.ranks}
    raw = {rank: (x, y) for rank, (x, y, _) in sampled.items() if len(x)}
    if not raw:
        return line_chart(name, [], title=name, x_label="step", width=width, height=height)
    lo = min(float(x.min()) for x, _ in raw.values())
    hi = max(float(x.max()) for x, _ in raw.values())
    if len(raw) >= BAND_FROM:  # the lowest and highest of all ranks, not a line per rank
        bx, low, high = band_across(list(raw.values()), lo, hi, SVG_BINS)
        traces = [Trace("min", bx, low, points=len(bx)), Trace("max", bx, high, points=len(bx))]
    else:
        traces = [
            Trace(str(k), *binned(x, y, lo, hi, SVG_BINS), points=sampled[k][2]) for k, (x, y) in raw.items()
        ]
    title = name
    if len(raw) > 1:
        mx, my = mean_across(list(raw.values()), lo, hi, SVG_BINS)
        traces.append(Trace("mean", mx, my, points=len(mx)))
        title += f" (mean of {len(raw)} ranks: {my[-1]:.4g})"
    else:
        title += f" ({traces[0].y[-1]:.4g})"
    return line_chart(name, traces, title=title, x_label="step", width=width, height=height)


def svg_memory_chart(history: History, width: int, height: int) -> str:
    series = {rank: history.memory(rank) for rank in history.memory_ranks}
    cuda = any(bool((c == c).any()) for _, _, c in series.values())  # any non-NaN CUDA sample
    what = "CUDA allocated" if cuda else "host RSS"
    start = min((float(t[0]) for t, _, _ in series.values() if len(t)), default=0.0)
    traces = []
    for rank, (t, rss, alloc) in series.items():
        y = (alloc if cuda else rss) / 2**20
        x, y = binned(t - start, y, 0.0, float(t[-1] - start) if len(t) else 0.0, SVG_BINS)
        traces.append(Trace(str(rank), x, y, points=len(t)))
    if len(traces) >= BAND_FROM:  # the lowest and highest of all ranks, and their mean
        kept = [(t.x, t.y) for t in traces if len(t.x)]
        end = max((float(x[-1]) for x, _ in kept), default=0.0)
        bx, low, high = band_across(kept, 0.0, end, SVG_BINS, always_bin=True)
        mx, my = mean_across(kept, 0.0, end, SVG_BINS, always_bin=True)
        traces = [Trace("min", bx, low, points=len(bx)), Trace("max", bx, high, points=len(bx))]
        traces.append(Trace("mean", mx, my, points=len(mx)))
    return line_chart(
        "memory", traces, title=f"memory per rank: {what}, MiB", x_label="seconds", width=width, height=height
    )


def status_table(rows: list[RankSnapshot]) -> str:
    head = "".join(
        f"<th>{c}</th>"
        for c in ("rank", "state", "step", "steps/s", "memory", "heartbeat", "cell", "last line")
    )
    body = []
    for cells, kind in status_rows(
        rows, cut=False
    ):  # from 9 ranks: the ranks in trouble, then a row per state
        style = f' style="background:{ROW_COLORS[kind]}"' if kind in ROW_COLORS else ""
        tds = "".join(f"<td{_CELL}>{html.escape(c)}</td>" for c in cells)
        body.append(f'<tr data-rank="{html.escape(cells[0])}" data-state="{kind}"{style}>{tds}</tr>')
    return (
        '<table class="jshard-status" style="font-size: 12px; border-collapse: collapse">'
        f"<tr>{head}</tr>{''.join(body)}</table>"
    )


def render(pool: Pool, *, compact: bool, charts: bool = True) -> str:
    """The dashboard as HTML with SVG charts: the fallback for renderers without Plotly. Without
    ``charts``, the status table only (what live redraws carry for frontends without the extension)."""
    history = pool.history
    names = history.metrics
    width, height = (380, 170) if compact else (460, 210)
    svg = (
        [svg_metric_chart(history, n, width, height) for n in (names[:COMPACT_METRICS] if compact else names)]
        if charts
        else []
    )
    if charts:
        svg.append(svg_memory_chart(history, width, height))
    title = pool.spec.describe()
    run = pool.background
    if run is not None and run.running:
        title += f" · {run.describe()}"
    note = " · older points thinned 2:1 to bound memory" if history.thinned else ""
    return (
        '<div class="jshard-dashboard" style="font-family: sans-serif">'
        f"<div><b>{html.escape(title)}</b>{note}</div>"
        f"{status_table(pool.activity())}"
        f'<div style="display: flex; flex-wrap: wrap; gap: 8px">{"".join(svg)}</div></div>'
    )


def text_summary(pool: Pool) -> str:
    """Plain-text twin of the dashboard (saved notebooks viewed as text, consoles): a line per rank
    below ``BAND_FROM`` ranks; from there the status table's rows (ranks in trouble, then a line per
    state) and each metric's spread, so that every live update stays small at 1,024 ranks."""
    lines = [f"jupyter_shard dashboard · {pool.spec.describe()}"]
    rows = pool.activity()
    if len(rows) >= BAND_FROM:
        return "\n".join(lines + _text_many(pool, rows))
    for row in rows:
        values = []
        for name in pool.history.metrics:
            last = pool.history.last_value(row.rank, name)
            if last is not None:
                values.append(f"{name} {last:.4g}")
        step = fmt(row.step) if row.step is not None else "-"
        lines.append(f"rank {row.rank}: {row.problem or row.state.value}, step {step}, " + ", ".join(values))
    return "\n".join(lines)


def _text_many(pool: Pool, rows: list[RankSnapshot]) -> list[str]:
    lines = [
        f"{'rank' if values[0].isdigit() else 'ranks'} {values[0]}: {values[1]}, step {values[2]}"
        for values, _ in status_rows(rows)
    ]
    for name in pool.history.metrics:
        last = {r.rank: v for r in rows if (v := pool.history.last_value(r.rank, name)) is not None}
        if last:
            low, high = min(last, key=last.__getitem__), max(last, key=last.__getitem__)
            mean = sum(last.values()) / len(last)
            lines.append(
                f"{name}: mean {mean:.4g}, lowest {last[low]:.4g} (rank {low}), "
                f"highest {last[high]:.4g} (rank {high})"
            )
    return lines


class StatusTable:
    """``%dist_status`` output: an HTML table with a plain-text twin, under the pool's shape, how its
    ranks came (forked by the zygote, or spawned and why) and a summary line (ranks per state, the
    ranks in trouble); a row per rank on one line (a long cell cut), the log files in a footer, and
    each rank's problem in full under it (why a rank is broken, and what to do about it)."""

    COLUMNS = ("rank", "pid", "host", "device", "state", "memory", "cell")
    CELL_CHARS = 48  # of a running cell's first line, in the text table

    def __init__(self, title: str, rows: list[RankSnapshot], path: str = "") -> None:
        self.title = title
        self.rows = rows
        self.path = f"ranks: {path}" if path else ""

    def _cells(self, row: RankSnapshot, cut: bool = True) -> list[str]:
        rss = row.memory.get("rss")
        memory = f"{rss / 2**20:.0f} MiB" if rss else "-"
        if "cuda_allocated" in row.memory:
            memory += f" · cuda {row.memory['cuda_allocated'] / 2**20:.0f} MiB"
        state = row.state.value + (f" ({row.exit})" if row.exit else "")
        cell = row.cell or "-"
        if cut and len(cell) > self.CELL_CHARS:  # the code is cut; what it is in (· at a prompt) kept
            code, sep, notes = cell.partition(" · ")
            room = max(16, self.CELL_CHARS - len(sep + notes))
            cell = (code if len(code) <= room else code[: room - 1] + "…") + sep + notes
        return [str(row.rank), str(row.pid), row.host, row.device, state, memory, cell]

    def summary(self) -> str:
        """``64 ranks: 62 idle, 1 running, 1 dead · needs attention: rank 5 (dead), rank 7 (stuck)``."""
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row.state.value] = counts.get(row.state.value, 0) + 1
        states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        trouble = [f"rank {r.rank} ({r.problem.split(':', 1)[0]})" for r in self.rows if r.problem]
        shown = ", ".join(trouble[:8]) + (f" and {len(trouble) - 8} more" if len(trouble) > 8 else "")
        ranks = "rank" if len(self.rows) == 1 else "ranks"
        return f"{len(self.rows)} {ranks}: {states}" + (f" · needs attention: {shown}" if trouble else "")

    def logs(self) -> list[str]:
        """The log files: one line where they follow ``<dir>/rank-<k>.log``, else one per rank."""
        paths = {r.rank: r.log_path for r in self.rows if r.log_path}
        if not paths:
            return []
        first = next(iter(paths.values()))
        folder = first.rsplit("/", 1)[0] if "/" in first else ""
        if all(p == f"{folder}/rank-{k}.log" for k, p in paths.items()):
            return [f"logs: {folder}/rank-<k>.log"]
        return ["logs:", *(f"  rank {k}: {p}" for k, p in sorted(paths.items()))]

    def _problems(self) -> list[str]:
        return [f"rank {r.rank}: {r.problem}" for r in self.rows if r.problem]

    def __repr__(self) -> str:
        table = [list(self.COLUMNS), *[self._cells(r) for r in self.rows]]
        widths = [max(len(r[i]) for r in table) for i in range(len(self.COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
        head = [self.title, *([self.path] if self.path else []), self.summary()]
        return "\n".join([*head, *lines, *self.logs(), *self._problems()])

    def _repr_html_(self) -> str:
        sticky = ' style="position:sticky;top:0;background:var(--jp-layout-color1,#fff)"'
        head = "".join(f"<th{sticky}>{c}</th>" for c in self.COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r, cut=False)) + "</tr>"
            for r in self.rows
        )
        path = f"<br><i>{html.escape(self.path)}</i>" if self.path else ""
        summary = f"<div>{html.escape(self.summary())}</div>"
        logs = "".join(f"<div><small>{html.escape(line)}</small></div>" for line in self.logs())
        problems = "".join(f"<div>{html.escape(p)}</div>" for p in self._problems())
        scroll = ' style="max-height:24em;overflow:auto"' if len(self.rows) > 16 else ""
        table = f"<div{scroll}><table><thead><tr>{head}</tr></thead>{body}</table></div>"
        return f"<div><b>{html.escape(self.title)}</b>{path}{summary}{table}{logs}{problems}</div>"


class Dashboard:
    """A live view of one pool; ``refresh`` is called by the pool and redraws at most 5 times a second.

    :meth:`show` displays it (with an Interrupt button unless ``compact``) and returns the handle.
    """

    def __init__(self, pool: Pool, *, compact: bool = False) -> None:
        self.compact = compact
        self.redraws = 0
        self._pool = pool
        self._handle: DisplayHandle | None = None
        self._button: ipywidgets.Button | None = None
        self._drawn_at = time.monotonic()
        self._drawn_version = pool.history.version
        self._interval = MIN_INTERVAL
        self._sent: dict[str, Any] = {}  # the bundle the output holds
        self._live: dict[str, Any] = {}  # the live bundle it was drawn from

    def show(self) -> DisplayHandle:
        """Display the dashboard under the running cell; updates go to this output."""
        if not self.compact:
            self._button = ipywidgets.Button(description="Interrupt", icon="stop", tooltip="%dist_interrupt")
            self._button.on_click(lambda _: self._pool.interrupt())
            display(self._button)
        bundle = self.live_bundle()
        handle: DisplayHandle | None = display(bundle, raw=True, display_id=True)
        assert handle is not None
        self._handle, self._sent, self._live = handle, bundle, bundle
        return handle

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
        live = self.live_bundle()
        if (final or live != self._live) and self._handle is not None:
            bundle = self._static(live) if final else live
            self._handle.update(bundle, raw=True)  # serialised and sent here: part of the cost
            self._sent, self._live = bundle, live
            self.redraws += 1
        self._interval = max(MIN_INTERVAL, (time.monotonic() - now) / RENDER_SHARE)

    def figure(self) -> dict[str, Any]:
        """The dashboard's Plotly figure now, as JSON-ready dicts."""
        figure: dict[str, Any] = encode(dashboard_figure(self._pool, compact=self.compact))
        return figure

    def live_bundle(self) -> dict[str, Any]:
        """What a redraw sends: the figure for the extension's renderer, and for other frontends the
        status table as HTML (the SVG charts only come with the saved form) and the text twin. Where
        the extension is known to draw it, the HTML is left out: at 64 ranks it is most of each
        update, and JupyterLab re-reads every HTML output it receives."""
        bundle = {LIVE_MIME: {"figure": self.figure()}, "text/plain": text_summary(self._pool)}
        if not frontend_attached():
            bundle["text/html"] = render(self._pool, compact=self.compact, charts=False)
        return bundle

    def static_bundle(self) -> dict[str, Any]:
        """The saved form: the Plotly figure (drawn by the extension's renderer where it is installed,
        else by Plotly's own), the HTML/SVG fallback and the text twin."""
        return self._static(self.live_bundle())

    def _static(self, live: dict[str, Any]) -> dict[str, Any]:
        return {
            LIVE_MIME: {"figure": PLOTLY_MIME},
            PLOTLY_MIME: live[LIVE_MIME]["figure"],
            "text/html": render(self._pool, compact=self.compact),
            "text/plain": live["text/plain"],
        }

    def _ipython_display_(self) -> None:
        """``display(dashboard)`` shows it through :meth:`show`, whose output the redraws update."""
        self.show()

    def close(self) -> None:
        """Leave the output as the static bundle and close the Interrupt button's widget."""
        if self._handle is not None and LIVE_MIME in self._sent and PLOTLY_MIME not in self._sent:
            self._sent = self.static_bundle()
            self._handle.update(self._sent, raw=True)
        if self._button is not None:
            self._button.close()


class CellDashboard:
    """Shows a compact :class:`Dashboard` under the running cell once it logs; static when it ends."""

    def __init__(self, pool: Pool, *, show_now: bool = False) -> None:
        self._pool = pool
        self._baseline = len(pool.history)
        self.dashboard: Dashboard | None = None
        if show_now:
            self._show()

    def _show(self) -> None:
        self.dashboard = Dashboard(self._pool, compact=True)
        self.dashboard.show()

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
        if self.dashboard is not None:
            self.dashboard.close()
