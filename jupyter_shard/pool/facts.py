"""What a pool says about itself and its ranks: where it lives, how it started, their status and stacks.

The read-only side of :class:`~jupyter_shard.pool.pool.Pool`, kept apart so that the facade's own
module holds what a pool *does* (start, run, move values, stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jupyter_shard.launchers import Launcher
from jupyter_shard.pool.cell import CellGathering
from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.lifecycle import Lifecycle
from jupyter_shard.pool.ranks import RankSnapshot, RankTable
from jupyter_shard.spec import LaunchSpec
from jupyter_shard.wire.curve import CurveServer
from jupyter_shard.wire.messages import STACKS, STATUS

__all__ = ["PoolFacts"]


class PoolFacts:
    """The facts; the pool that mixes them in has these parts."""

    lifecycle: Lifecycle
    connection: Connection
    ranks: RankTable
    cells: CellGathering
    spec: LaunchSpec

    @property
    def started(self) -> bool:
        return self.connection.open

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def log_dir(self) -> Path | None:
        """This start's rank logs (``rank-<k>.log``); kept after shutdown."""
        return self.lifecycle.log_dir

    @property
    def address(self) -> str:
        """Where ranks connect: ``ipc://`` here, ``tcp://`` for a multi-node pool."""
        return self.lifecycle.address

    @property
    def directory(self) -> Path | None:
        """The pool's private 0700 directory (socket, stores, record) while it runs."""
        return self.lifecycle.directory

    @property
    def launcher(self) -> Launcher | None:
        return self.lifecycle.launcher

    @property
    def launch_path(self) -> str:
        """How the ranks came: ``zygote (fork server, pid N)`` or ``spawned: <why>`` (%dist_status)."""
        return self.launcher.launch_path() if self.launcher is not None else "not started"

    @property
    def curve(self) -> CurveServer | None:
        """The encryption of a multi-node pool's TCP socket (None for a local pool)."""
        return self.lifecycle.curve

    @property
    def dropped(self) -> int:
        """Messages rejected: unknown peer, bad signature, replay, or a body of the wrong shape."""
        return self.connection.dropped + self.ranks.dropped

    def status(self) -> list[RankSnapshot]:
        """Every rank now: pid, host, device, state, fresh memory, the cell it runs (and where)."""
        live = self.ranks.live() if self.started else []
        replies = self.connection.request(*STATUS({}), live, timeout=1.0) if live else {}
        self.cells.check_exits()
        return self.ranks.status(replies)

    def activity(self) -> list[RankSnapshot]:
        """Each rank's state, step, throughput, memory and heartbeat age; problems named."""
        return self.ranks.activity()

    def stacks(self, timeout: float = 2.0, ranks: Sequence[int] | None = None) -> dict[int, str]:
        """Every rank's current Python stacks, even mid-cell (safe to call from another thread)."""
        chosen = sorted(r.rank for r in self.ranks) if ranks is None else sorted(ranks)
        live = [r for r in self.ranks.live() if r.rank in chosen]
        replies = self.connection.request(*STACKS({}), live, timeout=timeout) if live else {}
        return self.ranks.stacks(chosen, replies, timeout)
