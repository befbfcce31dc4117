"""The Hugging Face ``Trainer`` in a rank: what it logs (loss, learning rate, grad norm, eval
metrics) reaches the dashboard with no change to the user's code.

Once ``transformers.trainer`` is imported, a callback class joins its ``DEFAULT_CALLBACKS``, which
every ``Trainer`` instantiates next to its own ``DefaultFlowCallback``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from jupyter_shard.rank.integrations.metrics import to_dashboard


def add_default_callback(module: ModuleType) -> None:
    """Append the dashboard callback to ``transformers.trainer.DEFAULT_CALLBACKS`` (once)."""
    defaults = getattr(module, "DEFAULT_CALLBACKS", None)
    callback = callback_class()
    if isinstance(defaults, list) and callback not in defaults:
        defaults.append(callback)


@functools.cache
def callback_class() -> type:
    from transformers import TrainerCallback

    class DashboardCallback(TrainerCallback):
        """Sends each ``Trainer.log`` record to ``shard.log`` at the trainer's global step."""

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
        ) -> None:
            if logs:
                to_dashboard(logs, state.global_step)

    return DashboardCallback
