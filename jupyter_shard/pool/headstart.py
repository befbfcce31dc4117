"""A cell sent before its run, and gathered by the :meth:`~jupyter_shard.pool.pool.Pool.run` with
the same arguments that follows.

The notebook sends a repeated ``%%distributed`` cell when the kernel takes its request, so the ranks
run it while the kernel still prepares the cell (``jupyter_shard.notebook.headstart`` says when and
why). Only a cell that the run would send without a word first goes ahead: not before a start,
restart or regroup, a note on the last cell, beside a background run, or to a rank that is dead or
busy. A cell that no run takes is interrupted on the ranks, as a cell is when the kernel is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jupyter_shard.pool.background import Watcher
from jupyter_shard.pool.cell import CellGathering, Gathering
from jupyter_shard.pool.escalation import Escalation
from jupyter_shard.pool.ranks import RankState, RankTable

__all__ = ["Ahead", "SentCell"]

_READY = (RankState.IDLE, RankState.FAILED, RankState.INTERRUPTED)  # ranks a cell may go ahead to

Begin = Callable[[str, Sequence[int] | None, float | None, int, bool], Gathering]


@dataclass
class SentCell:
    """The run's arguments, the watcher's flag before the send, and what the send gave."""

    code: str
    ranks: Sequence[int] | None
    timeout: float | None
    foreground: bool  # restored once the cell has ended
    sent: Gathering | Exception | None = None

    def taken(self) -> Gathering:
        """The cell in flight; where the send failed, the run fails as it would have itself."""
        if isinstance(self.sent, Exception):
            raise self.sent
        assert self.sent is not None
        return self.sent


class Ahead:
    """At most one cell sent before its run, for a pool's parts."""

    def __init__(
        self,
        cells: CellGathering,
        ranks: RankTable,
        escalation: Escalation,
        watcher: Watcher,
        begin: Begin,
        end: Callable[[Gathering], None],
    ) -> None:
        self.cells, self.ranks, self.escalation, self.watcher = cells, ranks, escalation, watcher
        self._begin, self._end = begin, end
        self.cell: SentCell | None = None

    def send(self, code: str, ranks: Sequence[int] | None, timeout: float | None, exec_count: int) -> bool:
        """Start now the cell that the next :meth:`Pool.run` with these arguments gathers, if that
        run would send it without a word first; whether it went."""
        if (
            not self.watcher.settled()
            or self.cell is not None
            or self.cells.current is not None
            or self.escalation.restart_reason is not None
            or self.escalation.regroup_needed
            or self.cells.out_of_step
            or any(r.dead or r.state not in _READY for r in self.ranks)
        ):
            return False
        cell = self.cell = SentCell(code, ranks, timeout, self.watcher.foreground)
        self.watcher.foreground = True  # the run that takes the cell receives it
        try:
            cell.sent = self._begin(code, ranks, timeout, exec_count, True)  # recorded, as a run's
        except Exception as exc:  # raised by the run that takes it
            cell.sent = exc
        return True

    def take(self, code: str, ranks: Sequence[int] | None, timeout: float | None) -> SentCell | None:
        """The cell sent for this run; one sent for another run is ended first."""
        cell = self.cell
        if cell is None:
            return None
        if (cell.code, cell.ranks, cell.timeout) == (code, ranks, timeout):
            self.cell = None
            return cell
        self.settle()
        return None

    def settle(self) -> None:
        """End a cell that no run took: what the ranks sent is received, the rest interrupted."""
        cell, self.cell = self.cell, None
        if cell is None:
            return
        try:
            if isinstance(cell.sent, Gathering):
                try:
                    if not self.cells.step(cell.sent, 0.0):
                        self.cells.interrupted(cell.sent, "interrupted")
                finally:
                    self._end(cell.sent)
        finally:
            self.watcher.foreground = cell.foreground
