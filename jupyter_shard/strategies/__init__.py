"""Strategy registry: how ``shard.prepare`` wraps a model, and how backward and step run.

Built-ins register by name; third-party strategies register through the
``jupyter_shard.strategies`` entry-point group or :func:`register_strategy`. Imports are lazy so
that the kernel never imports torch through this module.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from jupyter_shard._util.plugins import entry_point_map

if TYPE_CHECKING:
    from jupyter_shard.strategies.base import StrategyBase

__all__ = ["available_strategies", "create_strategy", "register_strategy", "strategy_class"]

ENTRY_POINT_GROUP = "jupyter_shard.strategies"

_BUILTIN: dict[str, str] = {
    "none": "jupyter_shard.strategies.base:NoStrategy",
    "ddp": "jupyter_shard.strategies.ddp:DDPStrategy",
    "fsdp": "jupyter_shard.strategies.fsdp:FSDPStrategy",
    "deepspeed": "jupyter_shard.strategies.deepspeed:DeepSpeedStrategy",
}
_registered: dict[str, tuple[type[StrategyBase], dict[str, Any]]] = {}


def register_strategy(name: str, cls: type[StrategyBase], **defaults: Any) -> None:
    """Make ``--strategy name`` build ``cls(**defaults, **options)`` on every rank."""
    _registered[name] = (cls, defaults)


def registered(name: str) -> tuple[type[StrategyBase], dict[str, Any]] | None:
    """``(class, defaults)`` if ``name`` was registered with :func:`register_strategy` in this process."""
    return _registered.get(name)


def _entry_points() -> dict[str, str]:
    return {name: ep.value for name, ep in entry_point_map(ENTRY_POINT_GROUP).items()}


def available_strategies() -> list[str]:
    return sorted({*_BUILTIN, *_entry_points(), *_registered})


def strategy_class(name: str) -> type[StrategyBase]:
    """The class (or factory) registered for ``name``; a clear error listing what is installed."""
    if name in _registered:
        return _registered[name][0]
    target = _BUILTIN.get(name) or _entry_points().get(name)
    if target is None:
        raise ValueError(
            f"strategy {name!r} is not installed in this version of jupyter_shard; "
            f"available: {', '.join(available_strategies())}"
        )
    module, _, attr = target.partition(":")
    factory: type[StrategyBase] = getattr(import_module(module), attr)
    return factory


def create_strategy(name: str, **options: Any) -> StrategyBase:
    defaults = _registered[name][1] if name in _registered else {}
    return strategy_class(name)(**{**defaults, **options})
