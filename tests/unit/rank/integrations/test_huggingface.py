"""jupyter_shard.rank.integrations.huggingface: what a ``Trainer`` logs reaches the dashboard.

A stand-in ``transformers`` (its ``TrainerCallback`` base only) keeps this fast: importing the real
``transformers.trainer`` takes seconds.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from jupyter_shard.rank.integrations import huggingface
from jupyter_shard.rank.integrations.huggingface import add_default_callback, callback_class


class TrainerCallback:
    """transformers' base: every event is a no-op unless overridden."""

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def fake_transformers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[dict[str, Any], int | None]]]:
    module = types.ModuleType("transformers")
    module.TrainerCallback = TrainerCallback  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", module)
    sent: list[tuple[dict[str, Any], int | None]] = []
    monkeypatch.setattr(
        huggingface, "to_dashboard", lambda values, step=None: sent.append((dict(values), step))
    )
    callback_class.cache_clear()
    yield sent
    callback_class.cache_clear()


def _trainer_module(defaults: Any) -> types.ModuleType:
    module = types.ModuleType("transformers.trainer")
    module.DEFAULT_CALLBACKS = defaults  # type: ignore[attr-defined]
    return module


def test_the_dashboard_callback_joins_the_default_callbacks_once() -> None:
    class DefaultFlowCallback(TrainerCallback):
        pass

    trainer = _trainer_module([DefaultFlowCallback])
    add_default_callback(trainer)
    add_default_callback(trainer)
    cls = callback_class()
    assert [DefaultFlowCallback, cls] == trainer.DEFAULT_CALLBACKS
    assert issubclass(cls, TrainerCallback) and cls.__name__ == "DashboardCallback"
    assert callback_class() is cls, "one class, so the check for it holds"


@pytest.mark.parametrize("defaults", [None, ("flow",)])
def test_a_trainer_module_without_a_list_of_defaults_is_left_alone(defaults: Any) -> None:
    trainer = _trainer_module(defaults)
    add_default_callback(trainer)
    assert defaults == trainer.DEFAULT_CALLBACKS


def test_each_log_record_is_sent_at_the_trainers_global_step(
    fake_transformers: list[tuple[dict[str, Any], int | None]],
) -> None:
    callback = callback_class()()
    state = types.SimpleNamespace(global_step=40)
    callback.on_log(None, state, None, logs={"loss": 0.25, "learning_rate": 1e-4, "epoch": 0.5})
    callback.on_log(None, state, None, logs={})
    callback.on_log(None, state, None)
    assert fake_transformers == [({"loss": 0.25, "learning_rate": 1e-4, "epoch": 0.5}, 40)]
