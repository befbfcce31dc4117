"""jupyter_shard.rank.integrations.accelerate: ``accelerator.log`` also reaches the dashboard."""

from __future__ import annotations

import types
from typing import Any

import pytest

from jupyter_shard.rank.integrations import metrics
from jupyter_shard.rank.integrations.accelerate import forward_log


class Helper:
    def __init__(self) -> None:
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    def log(self, step: int | None = None, **scalars: float) -> None:
        self.logged.append((step, scalars))


def _accelerate_module() -> types.ModuleType:
    class Accelerator:
        """Accelerate's own ``log`` (its trackers), as its signature has it."""

        def __init__(self) -> None:
            self.tracked: list[tuple[dict[str, Any], int | None]] = []

        def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: Any = None) -> str:
            self.tracked.append((values, step))
            return "tracked"

    module = types.ModuleType("accelerate.accelerator")
    module.Accelerator = Accelerator  # type: ignore[attr-defined]
    return module


@pytest.fixture
def helper(monkeypatch: pytest.MonkeyPatch) -> Helper:
    found = Helper()
    monkeypatch.setattr(metrics, "current", lambda: found)
    return found


def test_accelerator_log_reaches_the_trackers_and_the_dashboard(helper: Helper) -> None:
    module = _accelerate_module()
    forward_log(module)
    accelerator = module.Accelerator()
    assert accelerator.log({"loss": 0.5, "name": "x"}, step=3) == "tracked"
    accelerator.log(values={"acc": 0.9}, step=4)
    accelerator.log({"loss": 0.25}, 5)
    assert accelerator.tracked == [({"loss": 0.5, "name": "x"}, 3), ({"acc": 0.9}, 4), ({"loss": 0.25}, 5)]
    assert helper.logged == [(3, {"loss": 0.5}), (4, {"acc": 0.9}), (5, {"loss": 0.25})]


def test_forwarding_is_set_up_once(helper: Helper) -> None:
    module = _accelerate_module()
    forward_log(module)
    forward_log(module)
    module.Accelerator().log({"loss": 1.0})
    assert helper.logged == [(None, {"loss": 1.0})]
