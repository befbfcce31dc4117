"""A cell's rank output, summarised: a line printed by several ranks is shown once, with their ranks.

Each line is split into a *template* (its text with every number replaced) and its numbers. The
k-th line of a template that a rank prints on a stream joins the k-th line of that template from
every other rank: ``step 5 loss 0.31`` from 64 ranks is one entry. An entry whose ranks printed the
same text shows that text (``[rank 0-63] epoch 1 done``); one whose ranks differ only in numbers
shows the lowest rank's line and, for each number that differs, its name (the word before it) and
its range over the ranks (``[rank 0-63] step 5 loss 0.31 (rank 0; loss 0.29–0.34)``). Lines whose
words differ are different entries. Entries keep the order in which their first line arrived.

Nothing is dropped from what ranks print: the rank logs keep every line and the per-rank views
(the JupyterLab extension's rank tabs) show them. What a summary shows is bounded: past
:data:`MAX_ENTRIES`, its first entries and its last ones, with a count of those in between.
Pure: no IPython; the notebook layer shows :meth:`OutputSummary.lines`.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from jupyter_shard.spec import format_ranks

__all__ = ["MAX_ENTRIES", "OutputSummary", "SummaryLine", "float_or_nan", "split_numbers"]

MAX_ENTRIES = 2000  # shown per cell: the first HEAD_ENTRIES and the last ones
HEAD_ENTRIES = 1000
SPREAD_SHOWN = 3  # numbers whose range is named on one line; more are counted

# A number standing alone (not part of a word such as ``cuda0`` or ``v2``): 5, -3, 0.31, 1e-4, 2.5E+3.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])|(?<!\w)(?:nan|inf)(?!\w)")
_NAME = re.compile(r"([A-Za-z_][\w.]*)\W*$")
_SLOT = "\x00"


def split_numbers(line: str) -> tuple[str, list[str]]:
    """``line``'s template (each number replaced by NUL) and its numbers, as written."""
    numbers: list[str] = []

    def take(match: re.Match[str]) -> str:
        numbers.append(match.group(0))
        return _SLOT

    return _NUMBER.sub(take, line), numbers


@dataclass(frozen=True)
class SummaryLine:
    """One line of the summary: the ranks that printed it, on which stream, and the text shown."""

    ranks: tuple[int, ...]
    name: str
    text: str

    @property
    def label(self) -> str:
        return f"[rank {format_ranks(list(self.ranks))}]"

    def __str__(self) -> str:
        return f"{self.label} {self.text}"


@dataclass
class _Entry:
    key: tuple[str, str, int]  # (stream, template, k): the k-th line of that template of each rank
    name: str
    template: str
    lines: dict[int, tuple[str, list[str]]] = field(default_factory=dict)  # rank: (line, numbers)
    shown: SummaryLine | None = None  # rendered, until a rank's line changes it

    def add(self, rank: int, line: str, numbers: list[str]) -> None:
        self.lines[rank] = (line, numbers)
        self.shown = None

    def render(self) -> SummaryLine:
        if self.shown is None:
            ranks = tuple(sorted(self.lines))
            first, numbers = self.lines[ranks[0]]
            text = first
            if len(ranks) > 1 and any(line != first for line, _ in self.lines.values()):
                text = f"{first} ({_spread(self.template, ranks[0], numbers, self.lines)})"
            self.shown = SummaryLine(ranks, self.name, text)
        return self.shown


def _spread(template: str, lowest: int, numbers: list[str], lines: dict[int, tuple[str, list[str]]]) -> str:
    """``rank 0; loss 0.29–0.34``: whose line is shown, and the range of each number that differs."""
    parts = template.split(_SLOT)
    named: list[str] = []
    for i, shown in enumerate(numbers):
        values = [nums[i] for _, nums in lines.values()]
        if all(v == shown for v in values):
            continue
        name_match = _NAME.search(parts[i])
        name = name_match.group(1) if name_match else f"number {i + 1}"
        numeric = [v for v in values if not math.isnan(float_or_nan(v))]
        lo = min(numeric, key=float_or_nan) if numeric else "nan"
        hi = max(numeric, key=float_or_nan) if numeric else "nan"
        nan = len(values) - len(numeric)
        text = f"{name} {lo}–{hi}" if lo != hi else f"{name} {lo}"
        named.append(text + (f", nan on {nan}" if nan else ""))
    shown_names = named[:SPREAD_SHOWN]
    more = len(named) - len(shown_names)
    tail = f"; {more} more numbers differ" if more else ""
    return f"rank {lowest}; " + ", ".join(shown_names) + tail if named else f"rank {lowest}"


def float_or_nan(text: str) -> float:
    """A number as :func:`split_numbers` found it, as a float (NaN where it is not one)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


class OutputSummary:
    """One cell's rank lines, summarised as they arrive (see the module's docstring)."""

    def __init__(self) -> None:
        self._head: list[_Entry] = []
        self._tail: deque[_Entry] = deque(maxlen=MAX_ENTRIES - HEAD_ENTRIES)
        self._open: dict[tuple[str, str, int], _Entry] = {}
        self._seen: dict[tuple[int, str, str], int] = {}  # (rank, stream, template): lines so far
        self.hidden = 0  # entries between the head and the tail, no longer shown
        self.lines_in = 0

    def add(self, rank: int, name: str, lines: list[str]) -> None:
        """Lines ``rank`` printed on stream ``name``, in order."""
        for line in lines:
            self.lines_in += 1
            template, numbers = split_numbers(line)
            count_key = (rank, name, template)
            k = self._seen.get(count_key, 0)
            self._seen[count_key] = k + 1
            key = (name, template, k)
            entry = self._open.get(key)
            if entry is None or rank in entry.lines:
                entry = self._open[key] = _Entry(key, name, template)
                self._append(entry)
            entry.add(rank, line, numbers)

    def _append(self, entry: _Entry) -> None:
        if len(self._head) < HEAD_ENTRIES:
            self._head.append(entry)
            return
        if len(self._tail) == self._tail.maxlen:
            gone = self._tail[0]
            self.hidden += 1
            if self._open.get(gone.key) is gone:
                del self._open[gone.key]
        self._tail.append(entry)

    def entries(self) -> Iterator[SummaryLine]:
        for entry in self._head:
            yield entry.render()
        for entry in self._tail:
            yield entry.render()

    def lines(self, where: str = "the rank logs") -> list[str]:
        """The summary as text lines (``[rank 0-63] …``), with a line counting any not shown."""
        head = [str(e.render()) for e in self._head]
        tail = [str(e.render()) for e in self._tail]
        if self.hidden:
            head.append(f"… {self.hidden:,} more lines not shown here ({where} have every line)")
        return head + tail

    def rows(self) -> list[list[str]]:
        """The summary for the JupyterLab extension: ``[ranks, stream name, text]`` per line, the
        ranks written as ``format_ranks`` writes them ("0-1023": at 1,024 ranks a list of numbers
        would be 5 KB a line); "" for a note."""
        rows = [[format_ranks(list(s.ranks)), s.name, s.text] for s in self.entries()]
        if self.hidden:
            rows.insert(len(self._head), ["", "stdout", f"… {self.hidden:,} more lines not shown here"])
        return rows
