"""jupyter_shard: interactive distributed training from a notebook.

``%load_ext jupyter_shard`` adds the ``%%distributed`` family of magics; :class:`Pool` is the same
machinery for scripts. Names are imported lazily so that loading the extension stays cheap and
never imports torch into the kernel.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from jupyter_shard.errors import PoolError, ShardError, SpecError
    from jupyter_shard.pool.checkpoint import consolidate
    from jupyter_shard.pool.history import History
    from jupyter_shard.pool.keep import attach
    from jupyter_shard.pool.pool import Pool
    from jupyter_shard.pool.results import DistributedError, RunResult
    from jupyter_shard.pool.suspend import resume, suspend
    from jupyter_shard.rank.shard import Shard
    from jupyter_shard.spec import LaunchSpec
    from jupyter_shard.strategies import register_strategy

    shard: Shard

__all__ = [
    "DistributedError",
    "LaunchSpec",
    "Pool",
    "PoolError",
    "RunResult",
    "ShardError",
    "SpecError",
    "__version__",
    "attach",
    "consolidate",
    "history",
    "last_values",
    "load_ipython_extension",
    "register_strategy",
    "resume",
    "shard",
    "suspend",
    "unload_ipython_extension",
]

_LAZY = {
    "Pool": "jupyter_shard.pool.pool",
    "DistributedError": "jupyter_shard.pool.results",
    "PoolError": "jupyter_shard.errors",
    "ShardError": "jupyter_shard.errors",
    "RunResult": "jupyter_shard.pool.results",
    "LaunchSpec": "jupyter_shard.spec",
    "SpecError": "jupyter_shard.errors",
    "register_strategy": "jupyter_shard.strategies",
    "consolidate": "jupyter_shard.pool.checkpoint",
    "suspend": "jupyter_shard.pool.suspend",
    "attach": "jupyter_shard.pool.keep",
    "resume": "jupyter_shard.pool.suspend",
}


def __getattr__(name: str) -> Any:
    if name == "shard":
        from jupyter_shard.rank.shard import current

        helper = current()
        if helper is None:
            raise ImportError(
                "`shard` exists only inside rank processes: use it in a %%distributed cell "
                "(or code run by jupyter_shard.Pool.run)"
            )
        return helper
    if name == "Pool" and "ipykernel" in sys.modules:
        from jupyter_shard.notebook import display  # noqa: F401 (in a Jupyter kernel: the notebook's sink)
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jupyter_shard' has no attribute {name!r}")


def history() -> History:
    """Every scalar logged with ``shard.log`` by the most recently started pool (also after it stopped).

    Iterate for records ``{"rank", "step", "time", <metric>: value}``, ``.to_csv(path)``, or
    ``.plot("loss", smooth=0.9)`` for a Plotly figure (a line per rank and their mean).
    """
    from jupyter_shard.errors import PoolError
    from jupyter_shard.pool.pool import latest_pool

    pool = latest_pool()
    if pool is None:
        raise PoolError("no pool has run in this process yet; start one with a %%distributed cell")
    return pool.history


def last_values() -> dict[int, Any]:
    """Every rank's value of the last ``%%distributed`` cell (its last expression), by rank: copies,
    tensors on the CPU. ``Out[n]`` and ``_`` hold the lowest rank's alone; ranks whose cell ended in
    a statement are left out."""
    from jupyter_shard.errors import PoolError
    from jupyter_shard.pool.pool import latest_pool

    pool = latest_pool()
    if pool is None:
        raise PoolError("no pool has run in this process yet; start one with a %%distributed cell")
    return pool.last_values()


def load_ipython_extension(ipython: InteractiveShell) -> None:
    from jupyter_shard.notebook.magics import load

    load(ipython)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    from jupyter_shard.notebook.magics import unload

    unload(ipython)
