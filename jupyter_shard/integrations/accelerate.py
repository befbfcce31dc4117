"""Accelerate in a rank: ``accelerator.log(values, step=...)`` also reaches the dashboard, with no
tracker to configure. Its own trackers (``log_with=...``) are called as before."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from jupyter_shard.integrations.metrics import to_dashboard


def forward_log(module: ModuleType) -> None:
    """Wrap ``accelerate.accelerator.Accelerator.log`` (once)."""
    cls = module.Accelerator
    original = cls.log
    if getattr(original, "_to_dashboard", False):
        return

    @functools.wraps(original)
    def log(
        self: Any, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None
    ) -> None:
        original(self, values, step=step, log_kwargs=log_kwargs)
        to_dashboard(values, step)

    log._to_dashboard = True  # type: ignore[attr-defined]
    cls.log = log
