"""jupyter_shard.rank.integrations.hooks: adjustments run once, right after their module is imported."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from jupyter_shard.rank.integrations import hooks


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    root = tmp_path / "fake_framework"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "trainer.py").write_text("DEFAULTS = ['flow']\nimported = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield_name = "fake_framework"
    monkeypatch.setattr(hooks, "_finder", hooks._Finder())
    for name in ("fake_framework", "fake_framework.trainer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return yield_name


def test_the_adjustment_runs_after_the_module_executes(package: str) -> None:
    seen: list[list[str]] = []

    def adjust(module: ModuleType) -> None:
        seen.append(list(module.DEFAULTS))
        module.DEFAULTS.append("dashboard")

    hooks.after_import(f"{package}.trainer", adjust)
    assert not seen  # nothing is imported by registering
    module = importlib.import_module(f"{package}.trainer")
    assert seen == [["flow"]] and module.DEFAULTS == ["flow", "dashboard"]
    assert module.__spec__ is not None and module.__spec__.origin is not None  # loaded as usual
    importlib.reload(module)  # once: a reload is the module's own business
    assert seen == [["flow"]]
    sys.meta_path.remove(hooks._finder)


def test_a_module_already_imported_is_adjusted_at_once(package: str) -> None:
    module = importlib.import_module(f"{package}.trainer")
    hooks.after_import(f"{package}.trainer", lambda m: m.DEFAULTS.append("now"))
    assert module.DEFAULTS == ["flow", "now"]
    assert hooks._finder not in sys.meta_path
