"""Run a function on a module right after it is first imported (a post-import hook).

A finder placed first on ``sys.meta_path`` answers only for the registered names: it asks the other
finders for the real spec and wraps its loader, so the module loads exactly as it would, and the
function runs on it once it has executed. A module already imported gets the function at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Adjust = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, adjust: list[Adjust]) -> None:
        self._loader = loader
        self._adjust = adjust

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for adjust in self._adjust:
            adjust(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: dict[str, list[Adjust]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        adjust = self.pending.pop(fullname, None)
        if adjust is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, adjust)
                return spec
        return None


_finder = _Finder()


def after_import(name: str, adjust: Adjust) -> None:
    """Call ``adjust(module)`` once ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        adjust(module)
        return
    _finder.pending.setdefault(name, []).append(adjust)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
