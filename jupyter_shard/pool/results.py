"""What a run gives back: per-rank results, and the error raised when any rank fails.

Vocabulary as in torch.distributed.elastic: a :class:`RunResult` holds one :class:`RankResult` per
rank; a failure is summarised root cause first (the first rank that failed, then the rest).
"""

from __future__ import annotations

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
        """Every failed rank's traceback, root cause first, for showing in a notebook."""
        lines = [self.headline]
        for note in self.result.notes:
            lines.append(note)
        shown: dict[tuple[str, tuple[str, ...]], list[int]] = {}  # the same error and traceback: once
        for failure in self.failures:
            shown.setdefault((_summary(failure), tuple(failure.traceback)), []).append(failure.rank)
        for (summary, traceback), ranks in shown.items():
            lines.append(f"──── rank {format_ranks(ranks)}: {summary} ────")
            lines.extend(traceback)
        return lines

    def __str__(self) -> str:
        return "\n".join(self.render())


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
