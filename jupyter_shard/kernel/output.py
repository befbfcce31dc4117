"""Where rank output goes in the kernel: the :class:`RankSink` interface and the console sink.

Ranks send output in coalesced chunks. A :class:`LineAssembler` per rank and stream turns chunks
into whole lines and a "live" partial line (text after a ``\\r``, as tqdm writes). A sink shows them:
:class:`ConsoleSink` writes to this process's stdout/stderr (scripts, tests, benchmarks); the notebook
layer plugs in its own (:mod:`jupyter_shard.notebook.display`) through :func:`set_default_sink`, so
nothing here imports UI code. What a sink shows per cell is capped; the rank's log keeps everything.
"""

from __future__ import annotations

import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

MAX_LINES_SHOWN = 5000
MAX_BYTES_SHOWN = 2 * 1024 * 1024


# Terminal control sequences other than colours (SGR, ``ESC[...m``, which Jupyter renders): cursor
# moves, line erases, cursor show/hide, as Rich's live displays write them around each redraw.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-ln-z]")


def visible_text(segment: str) -> str:
    """What a terminal shows for a line written with carriage returns (control sequences dropped)."""
    if "\x1b" in segment:
        segment = _CONTROL.sub("", segment)
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


_default_factory: Callable[[], RankSink | None] | None = None


def set_default_sink(factory: Callable[[], RankSink | None] | None) -> None:
    """Let a frontend choose the sink of pools created without one (``None`` from it: the console)."""
    global _default_factory
    _default_factory = factory


def default_sink() -> RankSink:
    """The registered frontend's sink where it gives one, else a :class:`ConsoleSink`."""
    sink = _default_factory() if _default_factory is not None else None
    return sink if sink is not None else ConsoleSink()
