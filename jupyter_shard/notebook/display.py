"""Rank output in the kernel: complete lines labelled ``[rank k]``, progress bars as one live line.

:class:`NotebookSink` is the :class:`~jupyter_shard.pool.output.RankSink` of a pool driven from a
Jupyter kernel (registered as the default sink when this module is imported in one). What a cell's
ranks print is shown one of two ways (:func:`set_output_mode`, ``%dist_output``):

- **summary** (by default from :data:`SUMMARY_FROM` ranks up): one display, updated in place at most
  10 times a second, where a line several ranks printed shows once with their ranks
  (:mod:`jupyter_shard.pool.summary`);
- **all**: every line as it comes, ``[rank k] …``, on the cell's streams.

Once the JupyterLab extension announced itself (it opened the ``jupyter_shard`` comm), a cell's
lines go instead into one display of :data:`RANK_OUTPUT_MIME`, rendered as tabs (the summary, all
ranks, one per group of ranks with the same output, a diff), whose ``text/plain`` fallback is the
summary or every line by the same choice. The display carries the first and the last
:data:`BUNDLE_LINES` // 2 lines and the count of those between, so that a cell at 1,024 ranks is
neither a megabyte in the saved notebook nor a megabyte sent ten times a second; the summary counts
every line, and each rank's log holds them all. Each live line (a progress bar) is one display updated in
place, so a progress bar is one line, not thousands.
"""

from __future__ import annotations

import collections
import html
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jupyter_shard.notebook.panel import frontend_attached
from jupyter_shard.pool.output import RankSink, set_default_sink
from jupyter_shard.pool.summary import OutputSummary, float_or_nan, split_numbers
from jupyter_shard.spec import format_ranks

LIVE_INTERVAL = 0.1
RANK_OUTPUT_MIME = "application/vnd.jupyter-shard.rank-output+json"
SUMMARY_FROM = 9  # ranks from which "auto" shows the summary (below, every line as it comes)
OUTPUT_MODES = ("auto", "summary", "all")
OUTPUT_VAR = "JUPYTER_SHARD_OUTPUT"
BUNDLE_LINES = 2000  # rank lines one cell's display carries at most: the first and the last half


def omitted_note(count: int) -> str:
    """The line that stands for the rank lines a cell's display leaves out."""
    return f"… {count:,} lines left out here; each rank's log has every line (%dist_status lists the logs)"


def _initial_mode() -> str:
    mode = os.environ.get(OUTPUT_VAR, "auto")
    return mode if mode in OUTPUT_MODES else "auto"


_mode = _initial_mode()


def set_output_mode(mode: str) -> None:
    """How later cells show rank lines: ``summary``, ``all`` or ``auto`` (summary from SUMMARY_FROM ranks)."""
    global _mode
    if mode not in OUTPUT_MODES:
        raise ValueError(f"output mode {mode!r} is not one of {', '.join(OUTPUT_MODES)}")
    _mode = mode


def output_mode() -> str:
    return _mode


def summarises(ranks: int) -> bool:
    """Whether a cell on ``ranks`` ranks shows the summary first, as the output mode says."""
    return _mode == "summary" or (_mode == "auto" and ranks >= SUMMARY_FROM)


@dataclass
class _Live:
    handle: Any
    text: str = ""
    shown_at: float = 0.0
    shown: str = field(default="")


@dataclass
class _LiveGroup:
    """The k-th live line (progress bar) of every rank on one stream, shown as one line: the lowest
    rank's text, and how many ranks and the range of their first number (``41–48%``)."""

    texts: dict[int, str] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def label(self) -> str:
        ranks = sorted(self.texts)
        first = self.texts[ranks[0]]
        label = f"[rank {format_ranks(ranks)}] {first}"
        if len(ranks) == 1:
            return label
        firsts = [nums[0] for nums in (split_numbers(t)[1] for t in self.texts.values()) if nums]
        spread = ""
        if len(firsts) == len(ranks):
            lo, hi = min(firsts, key=float_or_nan), max(firsts, key=float_or_nan)
            spread = f" from {lo} to {hi}" if lo != hi else ""
        finished = f", {len(self.done)} done" if self.done and len(self.done) < len(ranks) else ""
        return f"{label} ({len(ranks)} ranks{spread}{finished})"


class RankOutputDisplay:
    """One cell's rank lines as one display, updated in place at most every ``LIVE_INTERVAL`` s:
    the extension's bundle (``rich``: the first and last lines, up to :data:`BUNDLE_LINES`, and the
    summary), or the summary as plain text.

    The first lines show at once; lines arriving sooner than that after an update are shown by a
    timer thread (display updates go by display id, so they reach the cell from any thread).
    """

    def __init__(self, rich: bool = True, summary_first: bool = False) -> None:
        self.rich, self.summary_first = rich, summary_first
        self.lines: list[tuple[int, str, str]] = []  # the first BUNDLE_LINES // 2
        self.tail: collections.deque[tuple[int, str, str]] = collections.deque(
            maxlen=BUNDLE_LINES - BUNDLE_LINES // 2
        )
        self.omitted = 0  # lines between the two that the bundle leaves out (the rank logs have them)
        self.summary = OutputSummary()
        self.failed: list[int] = []
        self._handle: Any = None
        self._shown_at = 0.0
        self._dirty = False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def data(self) -> dict[str, Any]:
        if self.summary_first or not self.rich:
            text = "".join(f"{line}\n" for line in self.summary.lines())
        else:
            text = "".join(f"[rank {rank}] {line}\n" for rank, _, line in self.lines)
            if self.omitted:
                text += omitted_note(self.omitted) + "\n"
            text += "".join(f"[rank {rank}] {line}\n" for rank, _, line in self.tail)
        if not self.rich:
            return {"text/plain": text}
        bundle: dict[str, Any] = {
            "version": 2,  # 2: the summary's ranks written "0-1023", and ``omitted``
            "lines": [list(entry) for entry in (*self.lines, *self.tail)],
            "failed": self.failed,
            "summary": self.summary.rows(),
            "view": "summary" if self.summary_first else "all",
        }
        if self.omitted:
            bundle["omitted"] = [len(self.lines), self.omitted]
        return {RANK_OUTPUT_MIME: bundle, "text/plain": text}

    def _keep(self, rank: int, name: str, lines: list[str]) -> None:
        """The first and the last lines, up to BUNDLE_LINES in all; those between are counted."""
        room = BUNDLE_LINES // 2 - len(self.lines)
        if room > 0:
            self.lines.extend((rank, name, line) for line in lines[:room])
            lines = lines[room:]
        for line in lines:
            if len(self.tail) == self.tail.maxlen:
                self.omitted += 1
            self.tail.append((rank, name, line))

    def add(self, rank: int, name: str, lines: list[str]) -> None:
        with self._lock:
            if self.rich:
                self._keep(rank, name, lines)
            self.summary.add(rank, name, lines)
            self._dirty = True
            wait = LIVE_INTERVAL - (time.monotonic() - self._shown_at)
            if wait <= 0:
                self._cancel_timer()
                self._show()
            elif self._timer is None:
                # due when the interval since the last update ends, not an interval from now
                self._timer = threading.Timer(wait, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def mark_dirty(self) -> None:
        with self._lock:
            self._dirty = self._dirty or self._handle is not None

    def flush(self) -> None:
        with self._lock:
            self._cancel_timer()
            if self._dirty:
                self._show()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _show(self) -> None:
        from IPython.display import DisplayHandle

        data = self.data()
        if self._handle is None:
            self._handle = DisplayHandle()
            self._handle.display(data, raw=True)
        else:
            self._handle.update(data, raw=True)
        self._shown_at, self._dirty = time.monotonic(), False


class NotebookSink(RankSink):
    """Inside a Jupyter kernel: streams to the cell, live lines and rich output as displays."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple[int, str], _Live] = {}
        self._groups: dict[tuple[str, int], tuple[_LiveGroup, _Live]] = {}  # by (stream, k-th bar)
        self._bars: dict[tuple[int, str], int] = {}  # (rank, stream): its live lines finished so far
        self._lines: RankOutputDisplay | None = None
        self._wrote = False  # text went to the cell's streams since they were last flushed

    def begin_cell(self, ranks: int = 0) -> None:
        super().begin_cell(ranks)
        self._live.clear()
        self._groups.clear()
        self._bars.clear()
        first = summarises(ranks)
        if frontend_attached():
            self._lines = RankOutputDisplay(rich=True, summary_first=first)
        else:
            self._lines = RankOutputDisplay(rich=False) if first else None

    def end_cell(self, failed: Sequence[int] = ()) -> None:
        if self._lines is not None:
            self._lines.failed = sorted(failed)
            self._lines.mark_dirty()
        super().end_cell(failed)
        self._lines = None

    def flush_at_end(self) -> None:
        # The kernel flushes its streams when the cell ends anyway; flushing them here orders our own
        # text, and costs a round trip to ipykernel's I/O thread (~1 ms), so only when there is some.
        self.flush(streams=self._wrote)

    def write_lines(self, rank: int, name: str, lines: list[str]) -> None:
        if self._lines is None:
            super().write_lines(rank, name, lines)
        elif lines:
            self._lines.add(rank, name, lines)

    def write(self, name: str, text: str) -> None:
        (sys.stderr if name == "stderr" else sys.stdout).write(text)
        self._wrote = True

    def notice(self, text: str) -> None:
        """The pool's own lines (starting, restarting, a group rebuilt): the product speaking, not a
        failure, so on stdout, which JupyterLab does not paint as an error; out at once, so they stand
        before the rank output that follows. Failures are the cell's error output."""
        self.write("stdout", text.rstrip("\n") + "\n")
        sys.stdout.flush()

    def live_line(self, rank: int, name: str, text: str, final: bool) -> None:
        from IPython.display import DisplayHandle

        if self._lines is not None and (self._lines.summary_first or not self._lines.rich):
            self._group_live_line(rank, name, text, final)
            return
        key = (rank, name)
        live = self._live.get(key)
        label = f"[rank {rank}] {text}"
        if live is None:
            self.flush()
            handle = DisplayHandle()
            handle.display({"text/plain": label}, raw=True)
            live = self._live[key] = _Live(handle=handle, text=label, shown_at=time.monotonic(), shown=label)
        live.text = label
        now = time.monotonic()
        if (final or now - live.shown_at >= LIVE_INTERVAL) and live.shown != label:
            live.handle.update({"text/plain": label}, raw=True)
            live.shown_at, live.shown = now, label
        if final:
            del self._live[key]

    def _group_live_line(self, rank: int, name: str, text: str, final: bool) -> None:
        """With the summary: every rank's k-th progress bar on a stream is one live line."""
        from IPython.display import DisplayHandle

        k = self._bars.get((rank, name), 0)
        entry = self._groups.get((name, k))
        if entry is None:
            self.flush()
            handle = DisplayHandle()
            group = _LiveGroup()
            group.texts[rank] = text
            live = _Live(handle=handle, text=group.label(), shown_at=time.monotonic())
            live.shown = live.text
            handle.display({"text/plain": live.text}, raw=True)
            entry = self._groups[(name, k)] = (group, live)
        group, live = entry
        group.texts[rank] = text
        if final:
            group.done.add(rank)
            self._bars[(rank, name)] = k + 1
        live.text = group.label()
        now = time.monotonic()
        if (final or now - live.shown_at >= LIVE_INTERVAL) and live.shown != live.text:
            live.handle.update({"text/plain": live.text}, raw=True)
            live.shown_at, live.shown = now, live.text

    def flush(self, streams: bool = True) -> None:
        if streams:
            sys.stdout.flush()
            sys.stderr.flush()
            self._wrote = False
        if self._lines is not None:
            self._lines.flush()
        for live in [*self._live.values(), *(entry[1] for entry in self._groups.values())]:
            if live.shown != live.text:
                live.handle.update({"text/plain": live.text}, raw=True)
                live.shown, live.shown_at = live.text, time.monotonic()

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        from IPython.display import publish_display_data

        self.flush()
        publish_display_data(label_bundle(rank, data), {**metadata, "jupyter_shard": {"rank": rank}})


def label_bundle(rank: int, data: dict[str, Any]) -> dict[str, Any]:
    """Add the rank to a display bundle, keeping a plain-text fallback for saved notebooks."""
    labelled = dict(data)
    labelled["text/plain"] = f"[rank {rank}] {data.get('text/plain', '')}"
    tag = f'<div class="jupyter-shard-rank" data-rank="{rank}"><small>[rank {rank}]</small>'
    if "text/html" in data:
        labelled["text/html"] = f"{tag}{data['text/html']}</div>"
    else:
        for mime in ("image/png", "image/jpeg"):
            if mime in data:
                src = html.escape(f"data:{mime};base64,{data[mime]}", quote=True)
                labelled["text/html"] = f'{tag}<br><img src="{src}"></div>'
                break
    return labelled


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (IPython with a kernel attached)."""
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


set_default_sink(lambda: NotebookSink() if in_kernel() else None)
