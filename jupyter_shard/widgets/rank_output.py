"""Rank output in the kernel: complete lines labelled ``[rank k]``, progress bars as one live line.

Ranks send output in coalesced chunks. A :class:`LineAssembler` per rank and stream turns chunks
into whole lines and a "live" partial line (text after a ``\\r``, as tqdm writes). A sink then shows
them: :class:`ConsoleSink` writes to this process's stdout/stderr (scripts, tests);
:class:`NotebookSink` writes lines to the cell's streams and shows each live line as one display
that is updated in place (at most 10 times a second), so a progress bar is one line, not thousands.
Once the JupyterLab extension announced itself (it opened the ``jupyter_shard`` comm), a cell's
lines go instead into one display of :data:`RANK_OUTPUT_MIME` (rendered as rank tabs) with the same
``[rank k] …`` lines as its ``text/plain`` fallback, updated in place at most 10 times a second.
"""

from __future__ import annotations

import html
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

LIVE_INTERVAL = 0.1
RANK_OUTPUT_MIME = "application/vnd.jupyter-shard.rank-output+json"
MAX_LINES_SHOWN = 5000
MAX_BYTES_SHOWN = 2 * 1024 * 1024


def visible_text(segment: str) -> str:
    """What a terminal shows for a line written with carriage returns."""
    parts = [p for p in segment.split("\r") if p]
    return parts[-1] if parts else ""


@dataclass
class LineAssembler:
    partial: str = ""

    def feed(self, text: str) -> tuple[list[tuple[str, bool]], str | None]:
        """Complete lines as ``(visible text, was a live line)``, and the live text if any."""
        data = self.partial + text
        *complete, self.partial = data.split("\n")
        complete = [line.removesuffix("\r") for line in complete]  # CRLF, as from a pty (`!cmd`)
        lines = [(visible_text(line), "\r" in line) for line in complete]
        live = visible_text(self.partial) if "\r" in self.partial else None
        return lines, live

    def finish(self) -> list[tuple[str, bool]]:
        if not self.partial:
            return []
        line, self.partial = self.partial, ""
        return [(visible_text(line), "\r" in line)]


@dataclass
class _Budget:
    lines: int = 0
    size: int = 0
    exhausted: bool = False


class RankSink(ABC):
    """Shows rank output; subclasses say where. Caps what is shown per cell (the log keeps all)."""

    def __init__(self) -> None:
        self._assemblers: dict[tuple[int, str], LineAssembler] = {}
        self._budgets: dict[int, _Budget] = {}
        self.log_paths: dict[int, str] = {}

    def begin_cell(self) -> None:
        self._assemblers.clear()
        self._budgets.clear()

    def stream(self, rank: int, name: str, text: str) -> None:
        assembler = self._assemblers.setdefault((rank, name), LineAssembler())
        budget = self._budgets.get(rank)
        if budget is not None and budget.exhausted and "\r" not in text and "\r" not in assembler.partial:
            # Nothing more of this rank's plain lines is shown this cell: skip the per-line work
            # (a flood is millions of lines); only live lines (carriage returns) still are.
            cut = text.rfind("\n")  # only what follows the last newline is kept: no copy of the rest
            assembler.partial = text[cut + 1 :] if cut >= 0 else assembler.partial + text
            return
        lines, live = assembler.feed(text)
        self._emit(rank, name, lines)
        if live is not None:
            self.live_line(rank, name, live, final=False)

    def end_cell(self, failed: Sequence[int] = ()) -> None:
        """Show what is left of the cell's output; ``failed``: ranks whose cell did not succeed."""
        for (rank, name), assembler in self._assemblers.items():
            self._emit(rank, name, assembler.finish())
        self.flush_at_end()

    def flush_at_end(self) -> None:
        """The end of a cell's flush (a sink may skip what the cell left untouched)."""
        self.flush()

    def _emit(self, rank: int, name: str, lines: list[tuple[str, bool]]) -> None:
        budget = self._budgets.setdefault(rank, _Budget())
        plain: list[str] = []
        for text, was_live in lines:
            if was_live:
                self._write_lines(rank, name, plain)
                plain = []
                self.live_line(rank, name, text, final=True)
                continue
            if budget.exhausted:
                continue
            budget.lines += 1
            budget.size += len(text)
            if budget.lines > MAX_LINES_SHOWN or budget.size > MAX_BYTES_SHOWN:
                budget.exhausted = True
                where = self.log_paths.get(rank, "the rank's log file")
                plain.append(f"… more output not shown here; the full log is in {where}")
                continue
            plain.append(text)
        self._write_lines(rank, name, plain)

    def _write_lines(self, rank: int, name: str, lines: list[str]) -> None:
        if lines:
            self.write(name, "".join(f"[rank {rank}] {line}\n" for line in lines))

    @abstractmethod
    def write(self, name: str, text: str) -> None:
        """Show it."""

    @abstractmethod
    def live_line(self, rank: int, name: str, text: str, final: bool) -> None:
        """Show it."""

    @abstractmethod
    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Show it."""

    def notice(self, text: str) -> None:
        self.write("stderr", text.rstrip("\n") + "\n")

    def flush(self) -> None:  # noqa: B027 - a hook: sinks that hold nothing back need not override it
        """Push out anything held back (called at the end of a cell and before displays)."""


class ConsoleSink(RankSink):
    """For scripts and tests: labelled lines on this process's own streams."""

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        super().__init__()
        self._out = stdout
        self._err = stderr

    def write(self, name: str, text: str) -> None:
        target = (self._err or sys.stderr) if name == "stderr" else (self._out or sys.stdout)
        target.write(text)

    def live_line(self, rank: int, name: str, text: str, final: bool) -> None:
        if final:
            self.write(name, f"[rank {rank}] {text}\n")

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.write("stdout", f"[rank {rank}] {data.get('text/plain', '<display>')}\n")

    def flush(self) -> None:
        for stream in (self._out or sys.stdout, self._err or sys.stderr):
            stream.flush()


@dataclass
class _Live:
    handle: Any
    text: str = ""
    shown_at: float = 0.0
    shown: str = field(default="")


class RankOutputDisplay:
    """One cell's rank lines as one display, updated in place at most every ``LIVE_INTERVAL`` s.

    The first lines show at once; lines arriving sooner than that after an update are shown by a
    timer thread (display updates go by display id, so they reach the cell from any thread).
    """

    def __init__(self) -> None:
        self.lines: list[tuple[int, str, str]] = []
        self.failed: list[int] = []
        self._handle: Any = None
        self._shown_at = 0.0
        self._dirty = False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def data(self) -> dict[str, Any]:
        text = "".join(f"[rank {rank}] {line}\n" for rank, _, line in self.lines)
        bundle = {"version": 1, "lines": [list(entry) for entry in self.lines], "failed": self.failed}
        return {RANK_OUTPUT_MIME: bundle, "text/plain": text}

    def add(self, rank: int, name: str, lines: list[str]) -> None:
        with self._lock:
            self.lines.extend((rank, name, line) for line in lines)
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


def _frontend_attached() -> bool:
    from jupyter_shard.widgets.panel import frontend_attached

    return frontend_attached()


class NotebookSink(RankSink):
    """Inside a Jupyter kernel: streams to the cell, live lines and rich output as displays."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple[int, str], _Live] = {}
        self._lines: RankOutputDisplay | None = None
        self._wrote = False  # text went to the cell's streams since they were last flushed

    def begin_cell(self) -> None:
        super().begin_cell()
        self._live.clear()
        self._lines = RankOutputDisplay() if _frontend_attached() else None

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

    def _write_lines(self, rank: int, name: str, lines: list[str]) -> None:
        if self._lines is None:
            super()._write_lines(rank, name, lines)
        elif lines:
            self._lines.add(rank, name, lines)

    def write(self, name: str, text: str) -> None:
        (sys.stderr if name == "stderr" else sys.stdout).write(text)
        self._wrote = True

    def live_line(self, rank: int, name: str, text: str, final: bool) -> None:
        from IPython.display import DisplayHandle

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

    def flush(self, streams: bool = True) -> None:
        if streams:
            sys.stdout.flush()
            sys.stderr.flush()
            self._wrote = False
        if self._lines is not None:
            self._lines.flush()
        for live in self._live.values():
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
