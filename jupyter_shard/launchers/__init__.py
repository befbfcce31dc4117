"""Launchers start and signal rank processes; nothing else in the package does.

A launcher is a plugin: the built-in ``local`` one spawns ranks on this host, and a site can add its
own (Kubernetes, MPI, ...) through the ``jupyter_shard.launchers`` entry-point group. Each gives back
one :class:`RankHandle` per rank, a Popen-shaped object the pool polls and signals.
"""

from __future__ import annotations

from jupyter_shard._plugins import entry_point_map
from jupyter_shard.launchers.base import Launcher, RankHandle, RankLaunch
from jupyter_shard.spec import SpecError

__all__ = ["Launcher", "RankHandle", "RankLaunch", "available_launchers", "get_launcher"]

ENTRY_POINT_GROUP = "jupyter_shard.launchers"


def _registry() -> dict[str, type[Launcher]]:
    from jupyter_shard.launchers.local import LocalLauncher
    from jupyter_shard.launchers.slurm import SlurmLauncher
    from jupyter_shard.launchers.torchrun import TorchrunLauncher

    found: dict[str, type[Launcher]] = {
        "local": LocalLauncher,
        "torchrun": TorchrunLauncher,
        "slurm": SlurmLauncher,
    }
    for name, ep in entry_point_map(ENTRY_POINT_GROUP).items():
        if name not in found:
            found[name] = ep.load()
    return found


def available_launchers() -> list[str]:
    return sorted(_registry())


def get_launcher(name: str) -> Launcher:
    registry = _registry()
    if name not in registry:
        raise SpecError(f"--launcher {name!r} is not installed; available: {', '.join(sorted(registry))}")
    return registry[name]()
