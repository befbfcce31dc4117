"""What a framework logs, sent to the pool's dashboard and history through the rank's ``shard.log``."""

from __future__ import annotations

import functools
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


def also_to_dashboard(cls: type, method: str, values_name: str) -> None:
    """Wrap ``cls.<method>(self, <values_name>, step=None, ...)`` so the values also reach the dashboard.

    The names are given, not read from the signature: framework decorators (Accelerate's
    ``on_main_process``) hide it. The framework's own method runs first, as before; applied once.
    """
    original = getattr(cls, method)
    if getattr(original, "_to_dashboard", False):
        return

    @functools.wraps(original)
    def logged(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        values = args[0] if args else kwargs.get(values_name)
        step = args[1] if len(args) > 1 else kwargs.get("step")
        if isinstance(values, Mapping):
            to_dashboard(values, step)
        return result

    logged._to_dashboard = True  # type: ignore[attr-defined]
    setattr(cls, method, logged)
