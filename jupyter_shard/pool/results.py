"""What a run gives back: per-rank results, and the error raised when any rank fails.

Vocabulary as in torch.distributed.elastic: a :class:`RunResult` holds one :class:`RankResult` per
rank; a failure is summarised root cause first (the first rank that failed, then the rest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from jupyter_shard.errors import PoolError, ShardError
from jupyter_shard.spec import format_ranks

__all__ = [
    "DistributedError",
    "PoolError",
    "RankResult",
    "RunResult",
]


@dataclass
class RankResult:
    rank: int
    status: str = "pending"  # ok | error | interrupted | dead
    stdout: str = ""
    stderr: str = ""
    result: dict[str, Any] | None = None
    ename: str = ""
    evalue: str = ""
    traceback: list[str] = field(default_factory=list)
    duration: float = 0.0
    failed_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class RunResult:
    cell_id: str
    ranks: dict[int, RankResult]
    notes: list[str] = field(default_factory=list)
    timed_out: float | None = None  # the --timeout (s) that stopped the cell, if one did

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks.values())

    @property
    def value_rank(self) -> int | None:
        """The rank whose last-expression value is the cell's value: the lowest rank that produced one
        (None when every rank's cell ended in a statement)."""
        return next((k for k in sorted(self.ranks) if self.ranks[k].result is not None), None)

    @property
    def value(self) -> dict[str, Any] | None:
        """The cell's value (its ``Out[n]``): the display bundle of :attr:`value_rank`'s last expression."""
        rank = self.value_rank
        return None if rank is None else self.ranks[rank].result

    def valued_ranks(self) -> list[int]:
        """The ranks whose cell ended with a value (a last expression that is not None)."""
        return [k for k in sorted(self.ranks) if self.ranks[k].result is not None]

    def failures(self) -> list[RankResult]:
        """Failed ranks, the first to fail first; when a rank died, after it its peers' collectives
        that failed because its connection closed, even if they reported first."""
        failed = [r for r in self.ranks.values() if not r.ok]
        died = any(r.status == "dead" for r in failed)
        return sorted(failed, key=lambda r: (died and _peer_gone(r), r.failed_at or float("inf"), r.rank))


class DistributedError(ShardError):
    """A cell failed on one or more ranks; the first failing rank is named first."""

    def __init__(self, result: RunResult, headline: str | None = None) -> None:
        self.result = result
        self.failures = result.failures()
        first = self.failures[0] if self.failures else None
        self.rank = first.rank if first else -1
        self.tracebacks = {f.rank: list(f.traceback) for f in self.failures}
        self.headline = headline or _headline(self.failures, result.timed_out)
        super().__init__(self.headline)

    def render(self) -> list[str]:
        """The failed ranks' tracebacks for showing in a notebook, grouped by where they were raised:
        one block per traceback (the same frames and exception type), root cause first, with the
        ranks that raised it and, where their messages differ, each message under it in rank order
        (folded past :data:`MESSAGES_SHOWN`)."""
        lines = [self.headline, *self.result.notes, *hints(self.failures)]
        groups: dict[tuple[str, str, tuple[str, ...]], list[RankResult]] = {}  # by first failure
        for failure in self.failures:
            groups.setdefault(_place(failure), []).append(failure)
        for (_, ename, frames), members in groups.items():
            members = sorted(members, key=lambda f: f.rank)
            ranks = format_ranks([f.rank for f in members])
            by_message: dict[str, tuple[str, list[int]]] = {}  # by its text without colours, in rank order
            for failure in members:
                line = _message_line(failure)
                by_message.setdefault(_ANSI.sub("", line), (line, []))[1].append(failure.rank)
            if len(by_message) == 1:
                lines.append(f"──── rank {ranks}: {_summary(members[0])} ────")
                lines.extend(members[0].traceback)
                continue
            lines.append(f"──── rank {ranks}: {ename or 'failed'}, {len(by_message)} different messages ────")
            lines.extend(frames)
            lines.extend(_messages(by_message))
        return lines

    def __str__(self) -> str:
        return "\n".join(self.render())


MESSAGES_SHOWN = 5  # of a group's different messages: the first ones and the last, the rest counted

#: errors whose own message does not say what to do: (pattern in ``ename: evalue``, the line to add)
HINTS = (
    (
        # oneDNN on a CPU without bfloat16 instructions (an AMD EPYC without AVX-512) has no LSTM
        # kernel in autocast's low precision (GRU and RNN run); torch raises this in a plain process too
        re.compile(r"could not create a primitive descriptor for the LSTM"),
        "hint: this CPU's oneDNN has no LSTM kernel in autocast's low precision: run with --precision 32, "
        "or call the LSTM under torch.autocast('cpu', enabled=False) with a float32 input",
    ),
)


def hints(failures: list[RankResult]) -> list[str]:
    """One line per known error among ``failures`` that says what to do, once each, in HINTS' order."""
    texts = [_summary(f) for f in failures]
    return [line for pattern, line in HINTS if any(pattern.search(text) for text in texts)]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _ends_in_its_exception(failure: RankResult) -> bool:
    """Whether the traceback's last entry is its exception line (``ValueError: bad 5``)."""
    return bool(failure.traceback) and _ANSI.sub("", failure.traceback[-1]).startswith(failure.ename or "\0")


def _place(failure: RankResult) -> tuple[str, str, tuple[str, ...]]:
    """Where a failure was raised: its status, exception type, and traceback without the closing
    exception line (which carries the message, rank-specific in most real errors); a traceback that
    does not end in its exception line is grouped only with identical ones."""
    if _ends_in_its_exception(failure):
        return failure.status, failure.ename, tuple(failure.traceback[:-1])
    return failure.status, failure.ename, (*failure.traceback, _summary(failure))


def _message_line(failure: RankResult) -> str:
    """The exception line as the traceback shows it (colours kept), else the summary."""
    return failure.traceback[-1] if _ends_in_its_exception(failure) else _summary(failure)


def _messages(by_message: dict[str, tuple[str, list[int]]]) -> list[str]:
    """``[rank k] message`` per different message, in rank order; past MESSAGES_SHOWN, the first
    ones, a line counting the middle ones with their ranks, and the last."""
    items = [(f"[rank {format_ranks(ranks)}] {line}", ranks) for line, ranks in by_message.values()]
    if len(items) <= MESSAGES_SHOWN:
        return [text for text, _ in items]
    head, middle, last = items[: MESSAGES_SHOWN - 2], items[MESSAGES_SHOWN - 2 : -1], items[-1]
    folded = format_ranks([rank for _, ranks in middle for rank in ranks])
    return [
        *(text for text, _ in head),
        f"… {len(middle)} more different messages, on rank {folded} (each rank's log has its own)",
        last[0],
    ]


def _summary(failure: RankResult) -> str:
    if failure.status == "dead":
        return failure.evalue
    return f"{failure.ename}: {failure.evalue}" if failure.evalue else failure.ename


def _headline(failures: list[RankResult], timed_out: float | None = None) -> str:
    if not failures:
        return "the cell failed"
    if all(f.status == "interrupted" for f in failures):
        stopped = f"timed out after {timed_out:g} s" if timed_out is not None else "interrupted"
        return f"{stopped}: KeyboardInterrupt on rank {format_ranks([f.rank for f in failures])}"
    first = failures[0]
    others = [f.rank for f in failures[1:]]
    also = f" (also failed: rank {format_ranks(others)})" if others else ""
    return f"rank {first.rank} failed first: {_summary(first)}{also}"


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def _peer_gone(failure: RankResult) -> bool:
    """A collective failed because another rank's connection went away (gloo says so)."""
    return failure.status == "error" and any(text in failure.evalue for text in _PEER_GONE)
