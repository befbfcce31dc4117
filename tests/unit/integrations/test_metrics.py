"""jupyter_shard.integrations.metrics: which logged values are dashboard scalars."""

from __future__ import annotations

import numpy as np
import torch

from jupyter_shard.integrations.metrics import scalars, to_dashboard


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


def test_outside_a_rank_nothing_is_sent() -> None:
    to_dashboard({"loss": 1.0}, 3)  # no shard helper in this process: a no-op, no error
