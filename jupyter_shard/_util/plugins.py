"""Plugins by name (:class:`Registry`), and the entry points of one group, scanned once per state of
``sys.path``.

A registry holds one kind of plugin: launchers, strategies. A name is looked up among what this
process registered, then the built-ins, then the entry points of the registry's group; a name none
of them has is one error that lists every available name. Built-ins may be given as
``"module:attr"`` targets, imported when first asked for, so that declaring a registry imports none
of its plugins.

Scanning every installed distribution's metadata takes tens of milliseconds, and a ``%%distributed``
line with options checks its launcher and strategy names on every cell. The scan is kept until
``sys.path`` or the modification time of one of its directories changes (a package installed or
removed there), so a plugin installed mid-session is still found. That state itself is looked at
most once a second (:data:`RECHECK`): a ``stat`` of every ``sys.path`` entry cost a ``%%distributed``
cell about 1 ms here, a fifth of what the magic added to the pool's own round trip.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

RECHECK = 1.0  # seconds between looks at sys.path's state

F = TypeVar("F")  # what a registry gives for a name: a class, or another factory
Registration = tuple[F, dict[str, Any]]  # a factory registered in this process, with its defaults

PathState = tuple[tuple[str, "int | None"], ...]

_cache: dict[str, tuple[PathState, dict[str, EntryPoint]]] = {}
_lock = threading.Lock()
_seen: tuple[float, PathState] = (-RECHECK, ())


def _path_state() -> PathState:
    """``sys.path`` and its directories' modification times, as seen at most :data:`RECHECK` ago."""
    global _seen
    now = time.monotonic()
    when, state = _seen
    if now - when < RECHECK and [entry for entry, _ in state] == sys.path:
        return state
    _seen = (now, _stat_path())
    return _seen[1]


def _stat_path() -> PathState:
    state: list[tuple[str, int | None]] = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def entry_point_map(group: str) -> dict[str, EntryPoint]:
    """``name -> EntryPoint`` for ``group`` (the first of a duplicated name wins)."""
    state = _path_state()
    with _lock:
        cached = _cache.get(group)
        if cached is not None and cached[0] == state:
            return cached[1]
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        found.setdefault(ep.name, ep)
    with _lock:
        _cache[group] = (state, found)
    return found


class Registry(Generic[F]):
    """Plugins of one kind, by name: registered in this process, built in, or installed as entry
    points of ``group`` (the first of those that has a name wins).

    ``unknown`` is the error for a name none of them has: a ``str.format`` template of ``name`` and
    ``available`` (the sorted names, comma-separated), raised as ``error``. ``registered`` gives the
    dict of what this process registered, looked up on each use (by default the registry's own).
    """

    def __init__(
        self,
        group: str,
        builtin: Mapping[str, F | str],
        unknown: str,
        error: type[Exception] = ValueError,
        registered: Callable[[], dict[str, Registration[F]]] | None = None,
    ) -> None:
        self.group = group
        self.builtin = dict(builtin)
        self._unknown, self._error = unknown, error
        own: dict[str, Registration[F]] = {}
        self._registered = registered or (lambda: own)

    def register(self, name: str, factory: F, **defaults: Any) -> None:
        """Make ``name`` give ``factory`` (and its ``defaults``) in this process, before any other."""
        self._registered()[name] = (factory, defaults)

    def registration(self, name: str) -> Registration[F] | None:
        """``(factory, defaults)`` if ``name`` was registered in this process."""
        return self._registered().get(name)

    def available(self) -> list[str]:
        """Every name, sorted; nothing is imported."""
        return sorted({*self.builtin, *entry_point_map(self.group), *self._registered()})

    def unknown(self, name: str) -> Exception:
        """The error for a name that is not available, listing those that are."""
        return self._error(self._unknown.format(name=name, available=", ".join(self.available())))

    def get(self, name: str) -> F:
        """The factory for ``name``, imported if it must be; the registry's error for a name it lacks."""
        entry = self._registered().get(name)
        if entry is not None:
            return entry[0]
        target = self.builtin.get(name)
        if target is None:
            ep = entry_point_map(self.group).get(name)
            if ep is None:
                raise self.unknown(name)
            installed: F = ep.load()
            return installed
        if isinstance(target, str):
            builtin: F = _load(target)
            return builtin
        return target

    def defaults(self, name: str) -> dict[str, Any]:
        """The options ``name`` was registered with in this process ({} for a built-in or entry point)."""
        entry = self._registered().get(name)
        return dict(entry[1]) if entry is not None else {}

    def loaded(self) -> dict[str, F]:
        """Every name -> its factory, each imported (built-ins first, in their order)."""
        names = [*self.builtin, *entry_point_map(self.group), *self._registered()]
        return {name: self.get(name) for name in dict.fromkeys(names)}


def _load(target: str) -> Any:
    """The object a ``"module:attr"`` target names."""
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)
