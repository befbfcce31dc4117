"""Launchers start and signal rank processes; nothing else in the package does.

A launcher is a plugin: the built-in ``local`` one spawns ranks on this host, and a site can add its
own (Kubernetes, MPI, ...) through the ``jupyter_shard.launchers`` entry-point group, found by the
registry strategies use too (:class:`~jupyter_shard._util.plugins.Registry`). Each gives back one
:class:`RankHandle` per rank, a Popen-shaped object the pool polls and signals.

Each launcher owns its options (``--hosts``, ``--partition``...): :func:`resolve_spec` builds a
spec from everything the user typed, handing each launcher what is its own, and
:func:`merge_spec` is :meth:`LaunchSpec.merged <jupyter_shard.spec.LaunchSpec.merged>` for a
later cell's options, launcher options included. The magics and scripts build specs through them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from jupyter_shard._util.plugins import Registry
from jupyter_shard.launchers.base import Launcher, RankHandle, RankLaunch
from jupyter_shard.launchers.local import LocalLauncher
from jupyter_shard.launchers.slurm import SlurmLauncher
from jupyter_shard.launchers.torchrun import TorchrunLauncher
from jupyter_shard.spec import LAUNCHER_GROUP, UNKNOWN_LAUNCHER, LauncherOptions, LaunchSpec, SpecError

__all__ = ["Launcher", "RankHandle", "RankLaunch", "get_launcher", "merge_spec", "resolve_spec"]

ENTRY_POINT_GROUP = LAUNCHER_GROUP

_launchers: Registry[type[Launcher]] = Registry(
    ENTRY_POINT_GROUP,
    {"local": LocalLauncher, "torchrun": TorchrunLauncher, "slurm": SlurmLauncher},
    unknown=UNKNOWN_LAUNCHER,
    error=SpecError,
)


def get_launcher(name: str) -> Launcher:
    return _launchers.get(name)()


def resolve_spec(launcher: str = "local", nodes: int = 1, **options: Any) -> LaunchSpec:
    """:meth:`LaunchSpec.create` that also takes the launchers' own options by name (``hosts=``,
    ``interface=``, ``partition=``, ``time_limit=``, ``account=``) and has the launcher check them."""
    registry = _launchers.loaded()
    owned = _owners(registry)
    given = {k: options.pop(k) for k in list(options) if k in owned and options[k] is not None}
    if nodes < 1:
        raise SpecError(f"--nodes {nodes} is not valid; use 1 or more")
    parsed, nodes = _parse(registry.get(launcher), given, nodes, owned)
    return LaunchSpec.create(launcher=launcher, nodes=nodes, launcher_options=parsed, **options)


_last_merge: tuple[LaunchSpec, dict[str, object], LaunchSpec] | None = None


def merge_spec(spec: LaunchSpec, changes: Mapping[str, object]) -> LaunchSpec:
    """A later cell's spec: what ``changes`` names changes (launcher options one by one), the rest
    keeps its value; another launcher starts from its own defaults (see :meth:`LaunchSpec.merged`).

    The same changes to the very spec merged last give the last result again: a notebook's cells
    repeat one magic line on a pool that keeps its spec, and merging costs up to half a millisecond
    of each cell (the spec is rebuilt and its devices looked up)."""
    global _last_merge
    last = _last_merge
    if last is not None and last[0] is spec and last[1] == changes:
        return last[2]
    merged = _merge(spec, changes)
    _last_merge = (spec, dict(changes), merged)
    return merged


def _merge(spec: LaunchSpec, changes: Mapping[str, object]) -> LaunchSpec:
    registry = _launchers.loaded()
    owned = _owners(registry)
    given = {k: v for k, v in changes.items() if k in owned and v is not None}
    rest = {k: v for k, v in changes.items() if k not in owned}
    launcher = str(rest.get("launcher", spec.launcher))
    same = launcher == spec.launcher
    if not given and same:
        return spec.merged(rest)
    current = {k: v for k, v in spec.launcher_options.items() if v not in (None, ())} if same else {}
    nodes = int(rest.get("nodes", spec.nodes if same else 1))  # type: ignore[call-overload]
    parsed, nodes = _parse(registry.get(launcher), {**current, **given}, nodes, owned)
    return spec.merged({**rest, "launcher_options": parsed, "nodes": nodes})


def _owners(registry: Mapping[str, type[Launcher]]) -> dict[str, list[str]]:
    """Each launcher option's name -> the launchers that take it."""
    owners: dict[str, list[str]] = {}
    for name, cls in registry.items():
        for f in fields(cls.options_type):
            owners.setdefault(f.name, []).append(name)
    return owners


def _parse(
    cls: type[Launcher] | None, given: dict[str, object], nodes: int, owners: Mapping[str, list[str]]
) -> tuple[LauncherOptions, int]:
    """``cls.parse_options`` for the options it owns; the first option it does not is refused (an
    unknown launcher owns none: :meth:`LaunchSpec.create` names the installed ones)."""
    own = {f.name for f in fields(cls.options_type)} if cls is not None else set()
    foreign = sorted(
        (k for k in given if k not in own), key=lambda k: (len(owners[k]), list(owners).index(k))
    )
    if foreign:
        raise SpecError(_not_here(foreign[0], owners[foreign[0]]))
    return cls.parse_options(given, nodes) if cls is not None else (LauncherOptions(), nodes)


def _not_here(name: str, launchers: list[str]) -> str:
    """``--hosts applies only to --launcher torchrun (one host per node)``."""
    for cls in _launchers.loaded().values():
        for f in fields(cls.options_type):
            if f.name == name:
                option = f.metadata.get("option", "--" + name.replace("_", "-"))
                hint = f" ({f.metadata['hint']})" if "hint" in f.metadata else ""
                return f"{option} applies only to --launcher {' or '.join(launchers)}{hint}"
    return f"--{name} is not an option of this launcher"
