"""Accelerate in a rank: ``accelerator.log(values, step=...)`` also reaches the dashboard, with no
tracker to configure. Its own trackers (``log_with=...``) are called as before."""

from __future__ import annotations

from types import ModuleType

from jupyter_shard.rank.integrations.metrics import also_to_dashboard


def forward_log(module: ModuleType) -> None:
    """Wrap ``accelerate.accelerator.Accelerator.log`` (once)."""
    also_to_dashboard(module.Accelerator, "log", "values")
