"""What a framework logs, sent to the pool's dashboard and history through the rank's ``shard.log``."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from jupyter_shard.rank.shard import current

# Counters frameworks add to every record; the step is the record's own, the rest are not metrics.
NOT_METRICS = frozenset({"step", "epoch", "global_step"})


def scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """The numbers among ``values`` (plain, NumPy, one-element tensors), as floats."""
    found: dict[str, float] = {}
    for name, value in values.items():
        if name in NOT_METRICS or isinstance(value, bool):
            continue
        if isinstance(value, numbers.Real):
            found[name] = float(value)
        elif hasattr(value, "numel") and value.numel() == 1:
            found[name] = float(value.item())
    return found


def to_dashboard(values: Mapping[str, Any], step: int | None = None) -> None:
    """Log the numbers among ``values`` at ``step``; nothing outside a rank or without numbers."""
    helper = current()
    found = scalars(values) if helper is not None else {}
    if helper is not None and found:
        helper.log(step=None if step is None else int(step), **found)
