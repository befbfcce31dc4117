"""Frameworks in rank processes: what Lightning, Hugging Face and Accelerate need to run on a pool and
report to its dashboard, applied when (and only if) a cell imports them.

:func:`install` is called once by the rank runtime. It registers adjustments that run right after the
named framework module is imported (:mod:`.hooks`); nothing here imports a framework itself, and
outside a rank nothing is installed. Lightning's callback comes through its own entry point group
(``lightning.pytorch.callbacks_factory``, declared in ``pyproject.toml``), so it needs no hook.
"""

from __future__ import annotations

from jupyter_shard.rank.integrations import accelerate, huggingface, lightning
from jupyter_shard.rank.integrations.hooks import after_import

__all__ = ["install"]


def install(device_type: str) -> None:
    """Adjust each framework as it is imported in this rank (``device_type``: the pool's device)."""
    from jupyter_shard.strategies.deepspeed import deepspeed_environment
    from jupyter_shard.strategies.deepspeed_builds import guard_builds

    deepspeed_environment(device_type)
    after_import("torch.utils.cpp_extension", guard_builds)  # DeepSpeed's op builds, whoever starts them
    for module, adjust in lightning.adjustments(device_type).items():
        after_import(module, adjust)
    after_import("transformers.trainer", huggingface.add_default_callback)
    after_import("accelerate.accelerator", accelerate.forward_log)
