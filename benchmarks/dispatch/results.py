"""What one dispatch run measured, kept so that ``--replot`` can redraw the report without measuring:
the systems' labels, round-trip samples per rank count, and start-up samples split into start and
first cell."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any

NOOP = "pass"
POOL_IN_KERNEL = "_bench_pool"  # the magic's pool, as a name in the kernel
IDLE = 0.010  # `shard-paced`: how long the ranks sit idle before each run, as between notebook cells
FIRST_CELL = "import torch; x = 1"
ENGINE_TIMEOUT = 120.0
CELL_TIMEOUT = 180.0

ROUND_TRIP = {
    "floor": "pyzmq floor",
    "kernel": "ipykernel `pass`, no ranks (kernel)",
    "shard": "jupyter_shard `Pool.run`",
    "shard-paced": f"jupyter_shard `Pool.run`, ranks idle {IDLE * 1e3:g} ms before each",
    "shard-nb": "jupyter_shard `%%distributed --nproc N --device cpu` (kernel)",
    "shard-nb-bare": "jupyter_shard bare `%%distributed` (kernel)",
    "shard-nb-run": "jupyter_shard `Pool.run` called in a cell (kernel)",
    "ipp": "ipyparallel `view.execute`",
    "ipp-nb": "ipyparallel `%%px` (kernel)",
    "jd": "jupyter-distributed `group.execute`",
    "jd-nb": "jupyter-distributed kernel",
    "shard-tree": "jupyter_shard `Pool.run`, this tree (A/B driver)",
    "shard-base": "jupyter_shard `Pool.run`, `--baseline` tree (A/B driver)",
}
COLD = {
    "shard": "jupyter_shard, zygote",
    "shard-spawn": "jupyter_shard, spawn (`JUPYTER_SHARD_ZYGOTE=0`)",
    "ipp": "ipyparallel",
    "jd": "jupyter-distributed",
}
WARM = {
    "shard": "jupyter_shard `Pool.restart`, zygote",
    "shard-spawn": "jupyter_shard `Pool.restart`, spawn",
    "shard-nb": "jupyter_shard `%dist_restart` (kernel)",
    "ipp": "ipyparallel `restart_engines`",
    "jd": "jupyter-distributed `group.restart`",
}


@dataclass
class Starts:
    """Start-up samples in seconds: until the system answers, then the first cell."""

    startup: list[float] = field(default_factory=list)
    first_cell: list[float] = field(default_factory=list)

    def add(self, startup: float, first_cell: float) -> None:
        self.startup.append(startup)
        self.first_cell.append(first_cell)

    @property
    def total(self) -> list[float]:
        return [a + b for a, b in zip(self.startup, self.first_cell, strict=True)]

    @property
    def median(self) -> float:
        return statistics.median(self.total)


@dataclass
class Results:
    """Everything one run measured, with what is needed to redraw its report (``--replot``)."""

    command: str = ""
    settings: dict[str, int] = field(default_factory=dict)  # repeats, warmup, cold/warm repeats
    machine: list[str] = field(default_factory=list)
    trips: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    cold: dict[int, dict[str, Starts]] = field(default_factory=dict)
    warm: dict[int, dict[str, Starts]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # system -> why it has no numbers
    leftovers: list[str] = field(default_factory=list)  # processes a system left behind

    def to_json(self) -> str:
        def starts(table: dict[int, dict[str, Starts]]) -> dict[str, Any]:
            return {
                str(n): {k: {"startup": v.startup, "first_cell": v.first_cell} for k, v in rows.items()}
                for n, rows in table.items()
            }

        return json.dumps(
            {
                "command": self.command,
                "settings": self.settings,
                "machine": self.machine,
                "trips": {str(n): rows for n, rows in self.trips.items()},
                "cold": starts(self.cold),
                "warm": starts(self.warm),
                "skipped": self.skipped,
                "leftovers": self.leftovers,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Results:
        raw = json.loads(text)

        def starts(table: dict[str, Any]) -> dict[int, dict[str, Starts]]:
            return {
                int(n): {k: Starts(v["startup"], v["first_cell"]) for k, v in rows.items()}
                for n, rows in table.items()
            }

        return cls(
            raw["command"],
            raw["settings"],
            raw["machine"],
            {int(n): rows for n, rows in raw["trips"].items()},
            starts(raw["cold"]),
            starts(raw["warm"]),
            raw["skipped"],
            raw["leftovers"],
        )
