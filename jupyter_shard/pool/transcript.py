"""What a pool ran since it started: cells and pushes in order, the record ``%dist_export`` writes out.

A pool keeps one :class:`Transcript` per start (a restart loses rank state, so it starts a new one).
Only what the user asked for is recorded: cells run with ``%%distributed`` or :meth:`Pool.run`, and
values pushed with ``%dist_push`` or :meth:`Pool.push`, each with the ranks it went to. Values are kept
as the exact bytes the ranks received (cloudpickle), so an export holds what the ranks got; a large
value is kept by reference instead (:class:`Held`) and pickled when an export asks for it, since a
second copy of a 1 GiB tensor would double what a push costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CellEntry", "Held", "PushEntry", "Transcript"]


@dataclass(frozen=True)
class CellEntry:
    """One cell: its code, the ranks it ran on (None: all) and how it ended (``ok``/``error``)."""

    code: str
    ranks: tuple[int, ...] | None
    status: str
    exec_count: int = 0


@dataclass(frozen=True)
class Held:
    """A large pushed value, kept by reference: an export writes what it holds then."""

    value: Any

    def pickled(self) -> bytes:
        import cloudpickle

        return bytes(cloudpickle.dumps(self.value))


@dataclass(frozen=True)
class PushEntry:
    """Values pushed to ``ranks`` (None: all): name -> cloudpickle bytes (or :class:`Held`), in
    the order given."""

    values: tuple[tuple[str, bytes | Held], ...]
    ranks: tuple[int, ...] | None

    def pickled(self) -> list[tuple[str, bytes]]:
        """Each value's name and cloudpickle bytes."""
        return [(n, v.pickled() if isinstance(v, Held) else v) for n, v in self.values]


Entry = CellEntry | PushEntry


@dataclass
class Transcript:
    """The entries since the pool's last start, oldest first."""

    entries: list[Entry] = field(default_factory=list)

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)

    def cells(self) -> list[CellEntry]:
        return [e for e in self.entries if isinstance(e, CellEntry)]

    def __len__(self) -> int:
        return len(self.entries)
