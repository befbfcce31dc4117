"""Choosing a strategy without starting one: per-rank memory estimates, free memory, the choice logic
the picker widget shows, and the dry run of the user's own model under fake tensors. Importing this
package does not import torch: ``dry_run``, ``find_batch`` and ``DryRunPlan`` load it when first used."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DryRunPlan", "dry_run", "find_batch"]


def __getattr__(name: str) -> Any:
    """``dry_run`` (the module, callable as the function), ``find_batch`` and ``DryRunPlan``, loaded
    with torch on first use."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module("jupyter_shard.planner.dry_run")
    return {
        "dry_run": module,
        "find_batch": module.find_batch,
        "DryRunPlan": module.Plan,
    }[name]
