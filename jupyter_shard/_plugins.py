"""Entry points of one group, scanned once per state of ``sys.path``.

Scanning every installed distribution's metadata takes tens of milliseconds, and a ``%%distributed``
line with options checks its launcher and strategy names on every cell. The scan is kept until
``sys.path`` or the modification time of one of its directories changes (a package installed or
removed there), so a plugin installed mid-session is still found.
"""

from __future__ import annotations

import os
import sys
import threading
from importlib.metadata import EntryPoint, entry_points

_cache: dict[str, tuple[tuple[object, ...], dict[str, EntryPoint]]] = {}
_lock = threading.Lock()


def _path_state() -> tuple[object, ...]:
    state: list[object] = []
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
