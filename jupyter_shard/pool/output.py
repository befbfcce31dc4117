"""Where rank output goes in the kernel: the :class:`RankSink` interface and the console sink.

Ranks send output in coalesced chunks. A :class:`LineAssembler` per rank and stream turns chunks
into whole lines and a "live" partial line (text after a ``\\r``, as tqdm writes). A sink shows them:
:class:`ConsoleSink` writes to this process's stdout/stderr (scripts, tests, benchmarks); the notebook
layer plugs in its own (:mod:`jupyter_shard.notebook.display`) through :func:`set_default_sink`, so
nothing here imports UI code. What a sink shows per cell is capped: each rank's first lines and, when
the cell ends, its last ones, with a count of those in between; a line longer than ``LINE_CHARS`` is
cut. The rank's log keeps everything.
"""

from __future__ import annotations

import re
import sys
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

MAX_LINES_SHOWN = 5000  # per rank and cell, the last TAIL_LINES of them from the cell's end
MAX_BYTES_SHOWN = 2 * 1024 * 1024
TAIL_LINES = 1000
TAIL_BYTES = 256 * 1024
LINE_CHARS = 10_000  # a longer line is shown cut to this many characters


# Terminal control sequences other than colours (SGR, ``ESC[...m``, which Jupyter renders): cursor
# moves, line erases, cursor show/hide, as Rich's live displays write them around each redraw.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-ln-z]")


def visible_text(segment: str) -> str:
    """What a terminal shows for a line written with carriage returns (control sequences dropped)."""
    if "\x1b" in segment:
        segment = _CONTROL.sub("", segment)
    parts = [p for p in segment.split("\r") if p]
    return parts[-1] if parts else ""


def cut_line(text: str, length: int) -> str:
    """``text`` as shown: cut to ``LINE_CHARS`` when the line had ``length`` > ``LINE_CHARS``."""
    if length <= LINE_CHARS:
        return text
    return f"{text[:LINE_CHARS]} … (a line of {length:,} characters, cut; the rank's log has all of it)"


@dataclass
class LineAssembler:
    partial: str = ""
    dropped: int = 0  # characters of a long partial line not kept (the line is shown cut anyway)

    def feed(self, text: str) -> tuple[list[tuple[str, bool]], str | None]:
        """Complete lines as ``(visible text, was a live line)``, and the live text if any."""
        data = self.partial + text
        *complete, partial = data.split("\n")
        lines = []
        for line in complete:
            line = line.removesuffix("\r")  # CRLF, as from a pty (`!cmd`)
            shown = visible_text(line)
            lines.append((cut_line(shown, len(shown) + self.dropped), "\r" in line))
            self.dropped = 0
        self._keep(partial)
        live = visible_text(self.partial) if "\r" in self.partial else None
        return lines, live

    def feed_last(self, text: str) -> tuple[str, int, int]:
        """For plain text (no carriage returns) once only a cell's last lines are shown: its complete
        lines as one block (joined by newlines), how many there are, and the characters the first
        of them lost to :meth:`_keep` (it continued a cut line). No per-line work: a flood is
        millions of lines, and only the last few are split out, once, when the cell ends."""
        data = self.partial + text
        complete = data.count("\n")
        if not complete:
            self._keep(data)
            return "", 0, 0
        cut = data.rfind("\n")
        extra, self.dropped = self.dropped, 0
        self._keep(data[cut + 1 :])
        return data[:cut], complete, extra

    def finish(self) -> list[tuple[str, bool]]:
        if not self.partial:
            return []
        line, self.partial = self.partial, ""
        shown = visible_text(line)
        dropped, self.dropped = self.dropped, 0
        return [(cut_line(shown, len(shown) + dropped), "\r" in line)]

    def _keep(self, partial: str) -> None:
        """A long unfinished plain line keeps only what will be shown of it (a 10 MB line arrives in
        many chunks, and joining each to all before it would copy it over and over)."""
        if len(partial) > LINE_CHARS + 1 and "\r" not in partial:
            self.dropped += len(partial) - LINE_CHARS - 1
            partial = partial[: LINE_CHARS + 1]
        self.partial = partial


@dataclass
class _Block:
    """Complete lines of one stream as they came, joined by newlines (see :meth:`_Budget.keep`)."""

    name: str
    text: str
    lines: int
    extra: int = 0  # characters its first line lost before it was complete (it is shown cut)

    def split(self) -> list[str]:
        lines = self.text.split("\n")
        if self.extra or len(self.text) > LINE_CHARS:  # some line may be too long to show whole
            lines = [
                cut_line(line, len(line) + (self.extra if i == 0 else 0)) for i, line in enumerate(lines)
            ]
        return lines


@dataclass
class _Budget:
    """What of one rank's output a cell shows: its first lines, then (``exhausted``) its last ones.

    The last lines are kept in blocks as they came (a flood's chunk holds hundreds of lines), a
    block dropped whole once the blocks after it hold enough, and split and trimmed exactly only
    when the cell ends.
    """

    lines: int = 0
    size: int = 0
    exhausted: bool = False
    skipped: int = 0  # lines between the first and the last shown
    tail: deque[_Block] = field(default_factory=deque)
    tail_lines: int = 0
    tail_size: int = 0

    def keep(self, block: _Block) -> None:
        if not block.lines:
            return
        self.tail.append(block)
        self.tail_lines += block.lines
        self.tail_size += len(block.text)
        while len(self.tail) > 1:
            first = self.tail[0]
            if self.tail_lines - first.lines < TAIL_LINES and self.tail_size - len(first.text) < TAIL_BYTES:
                break
            self.tail.popleft()
            self.tail_lines -= first.lines
            self.tail_size -= len(first.text)
            self.skipped += first.lines

    def last_lines(self) -> list[tuple[str, str]]:
        """The last ``TAIL_LINES`` lines (``TAIL_BYTES`` at most), as (stream, line); the others are
        counted as skipped."""
        flat = [(block.name, line) for block in self.tail for line in block.split()]
        keep, size = 0, 0
        for _, line in reversed(flat):
            if keep == TAIL_LINES or size + len(line) > TAIL_BYTES:
                break
            keep, size = keep + 1, size + len(line)
        self.skipped += len(flat) - keep
        self.tail.clear()
        return flat[len(flat) - keep :]


class RankSink(ABC):
    """Shows rank output; subclasses say where. Caps what is shown per cell (the log keeps all)."""

    def __init__(self) -> None:
        self._assemblers: dict[tuple[int, str], LineAssembler] = {}
        self._budgets: dict[int, _Budget] = {}
        self.log_paths: dict[int, str] = {}

    def begin_cell(self, ranks: int = 0) -> None:
        """A cell starts on ``ranks`` ranks (0: not known)."""
        self._assemblers.clear()
        self._budgets.clear()

    def stream(self, rank: int, name: str, text: str) -> None:
        assembler = self._assemblers.setdefault((rank, name), LineAssembler())
        budget = self._budgets.get(rank)
        if budget is not None and budget.exhausted and "\r" not in text and "\r" not in assembler.partial:
            # Only this rank's last lines are shown from now on: make just those (a flood is millions
            # of lines) and count the rest; live lines (carriage returns) still go the usual way.
            block, count, extra = assembler.feed_last(text)
            budget.keep(_Block(name, block, count, extra))
            return
        lines, live = assembler.feed(text)
        self._emit(rank, name, lines)
        if live is not None:
            self.live_line(rank, name, live, final=False)

    def end_cell(self, failed: Sequence[int] = ()) -> None:
        """Show what is left of the cell's output; ``failed``: ranks whose cell did not succeed."""
        for (rank, name), assembler in self._assemblers.items():
            self._emit(rank, name, assembler.finish())
        for rank, budget in sorted(self._budgets.items()):
            if budget.exhausted:
                self._show_tail(rank, budget)
        self.flush_at_end()

    def _show_tail(self, rank: int, budget: _Budget) -> None:
        where = self.log_paths.get(rank, "the rank's log file")
        last = budget.last_lines()
        if budget.skipped:
            lines = "line" if budget.skipped == 1 else "lines"
            self.write_lines(rank, "stdout", [f"… {budget.skipped:,} {lines} not shown (full log: {where})"])
        run: list[str] = []
        for i, (name, line) in enumerate(last):
            run.append(line)
            if i + 1 == len(last) or last[i + 1][0] != name:
                self.write_lines(rank, name, run)
                run = []

    def flush_at_end(self) -> None:
        """The end of a cell's flush (a sink may skip what the cell left untouched)."""
        self.flush()

    def _emit(self, rank: int, name: str, lines: list[tuple[str, bool]]) -> None:
        budget = self._budgets.setdefault(rank, _Budget())
        plain: list[str] = []
        for text, was_live in lines:
            if was_live:
                self.write_lines(rank, name, plain)
                plain = []
                self.live_line(rank, name, text, final=True)
                continue
            if budget.exhausted:
                budget.keep(_Block(name, text, 1))
                continue
            budget.lines += 1
            budget.size += len(text)
            if budget.lines > MAX_LINES_SHOWN - TAIL_LINES or budget.size > MAX_BYTES_SHOWN - TAIL_BYTES:
                budget.exhausted = True
                where = self.log_paths.get(rank, "the rank's log file")
                plain.append(
                    "… more output not shown while the cell runs; its last lines follow when it ends "
                    f"(full log: {where})"
                )
                budget.keep(_Block(name, text, 1))
                continue
            plain.append(text)
        self.write_lines(rank, name, plain)

    def write_lines(self, rank: int, name: str, lines: list[str]) -> None:
        """Show whole lines of a rank's stream (a sink may gather them, as the notebook's rank tabs do)."""
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


_default_factory: Callable[[], RankSink | None] | None = None


def set_default_sink(factory: Callable[[], RankSink | None] | None) -> None:
    """Let a frontend choose the sink of pools created without one (``None`` from it: the console)."""
    global _default_factory
    _default_factory = factory


def default_sink() -> RankSink:
    """The registered frontend's sink where it gives one, else a :class:`ConsoleSink`."""
    sink = _default_factory() if _default_factory is not None else None
    return sink if sink is not None else ConsoleSink()
