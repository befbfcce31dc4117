"""jupyter_shard.rank.integrations.metrics: which logged values are dashboard scalars."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from jupyter_shard.rank.integrations import metrics
from jupyter_shard.rank.integrations.metrics import scalars, to_dashboard


def test_numbers_of_every_kind_are_kept_and_the_rest_dropped() -> None:
    logged = {
        "loss": torch.tensor(0.5),
        "lr": 1e-3,
        "count": 3,
        "np": np.float32(2.5),
        "grad_norm": np.float64(0.25),
        "flag": True,
        "name": "run-1",
        "vector": torch.ones(3),
        "epoch": 1.5,
        "step": 10,
        "global_step": 10,
    }
    assert scalars(logged) == {"loss": 0.5, "lr": 1e-3, "count": 3.0, "np": 2.5, "grad_norm": 0.25}


class _Unreadable:
    """A value that fails the moment anything reads it as a number."""

    def __float__(self) -> float:
        raise AssertionError("read outside a rank")


def test_outside_a_rank_nothing_is_sent() -> None:
    """No shard helper in this process: nothing is read (a value that fails when read passes
    through), nothing sent, no error."""
    from jupyter_shard.rank.shard import current

    assert current() is None
    assert to_dashboard({"loss": _Unreadable()}, 3) is None


class _Helper:
    def __init__(self) -> None:
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    def log(self, step: int | None = None, **scalars: float) -> None:
        self.logged.append((step, scalars))


def test_a_wrapped_log_method_runs_and_forwards_once(monkeypatch: pytest.MonkeyPatch) -> None:
    helper = _Helper()
    monkeypatch.setattr(metrics, "current", lambda: helper)

    class Tracker:
        def __init__(self) -> None:
            self.calls: list[tuple[dict[str, object], int | None]] = []

        def log_dict(self, metrics: dict[str, object], step: int | None = None) -> str:
            self.calls.append((metrics, step))
            return "theirs"

    metrics.also_to_dashboard(Tracker, "log_dict", "metrics")
    metrics.also_to_dashboard(Tracker, "log_dict", "metrics")  # a second install changes nothing
    tracker = Tracker()
    assert tracker.log_dict({"loss": torch.tensor(2.0), "name": "x"}, 3) == "theirs"
    tracker.log_dict(metrics={"loss": 1.0}, step=4)
    tracker.log_dict({"acc": 0.5})
    assert [step for _, step in tracker.calls] == [3, 4, None]  # the framework's own method ran
    assert helper.logged == [(3, {"loss": 2.0}), (4, {"loss": 1.0}), (None, {"acc": 0.5})]


def test_a_method_whose_decorator_hides_its_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    helper = _Helper()
    monkeypatch.setattr(metrics, "current", lambda: helper)

    def main_process_only(function: Any) -> Any:  # as Accelerate's on_main_process: no functools.wraps
        def inner(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        return inner

    class Accelerator:
        @main_process_only
        def log(self, values: dict[str, float], step: int | None = None, log_kwargs: Any = None) -> None:
            pass

    metrics.also_to_dashboard(Accelerator, "log", "values")
    Accelerator().log({"loss": 1.5}, step=2)
    Accelerator().log(values={"loss": 0.5})
    assert helper.logged == [(2, {"loss": 1.5}), (None, {"loss": 0.5})]
