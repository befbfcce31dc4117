"""Strategy registry: how ``shard.prepare`` wraps a model, and how backward and step run.

Built-ins register by name; third-party strategies register through the
``jupyter_shard.strategies`` entry-point group or :func:`register_strategy`. Imports are lazy so
that the kernel never imports torch through this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jupyter_shard._util.plugins import Registration, Registry

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
# What register_strategy registered in this process. The registry reads this module's dict on each
# use (registered=): an exported script registers into it, and tests put their own in its place.
_registered: dict[str, Registration[type[StrategyBase]]] = {}
_strategies: Registry[type[StrategyBase]] = Registry(
    ENTRY_POINT_GROUP,
    _BUILTIN,
    unknown="strategy {name!r} is not installed in this version of jupyter_shard; available: {available}",
    registered=lambda: _registered,
)


def register_strategy(name: str, cls: type[StrategyBase], **defaults: Any) -> None:
    """Make ``--strategy name`` build ``cls(**defaults, **options)`` on every rank."""
    _strategies.register(name, cls, **defaults)


def registered(name: str) -> tuple[type[StrategyBase], dict[str, Any]] | None:
    """``(class, defaults)`` if ``name`` was registered with :func:`register_strategy` in this process."""
    return _strategies.registration(name)


def available_strategies() -> list[str]:
    return _strategies.available()


def strategy_class(name: str) -> type[StrategyBase]:
    """The class (or factory) registered for ``name``; a clear error listing what is installed."""
    return _strategies.get(name)


def create_strategy(name: str, **options: Any) -> StrategyBase:
    return strategy_class(name)(**{**_strategies.defaults(name), **options})
