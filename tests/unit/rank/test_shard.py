"""``shard.log`` on the rank: values checked at the call, sent by the I/O thread as float64 columns."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
import torch

from jupyter_shard.rank.shard import Shard


def _shard(sent: list[tuple[dict[str, Any], list[bytes]]]) -> Shard:
    return Shard(0, 0, 1, torch.device("cpu"), "none", lambda kind, body, bufs: sent.append((body, bufs)), {})


def _columns(bufs: list[bytes]) -> list[list[float]]:
    return [array("d", b).tolist() for b in bufs]


def test_records_go_out_as_columns_grouped_by_the_names_logged() -> None:
    sent: list[tuple[dict[str, Any], list[bytes]]] = []
    shard = _shard(sent)
    shard.log(loss=torch.tensor(0.5))
    shard.log(loss=0.25, step=10)
    shard.log(acc=1, loss=torch.tensor([0.125]))
    shard.flush_metrics()
    by_names = {tuple(body["names"]): (body["count"], _columns(bufs)) for body, bufs in sent}
    assert by_names[("loss",)][0] == 2
    steps, times, loss = by_names[("loss",)][1]
    assert steps == [1.0, 10.0] and loss == [0.5, 0.25] and times[0] <= times[1]
    count, (steps, _, acc, loss) = by_names[("acc", "loss")]
    assert count == 1 and steps == [3.0] and acc == [1.0] and loss == [0.125]
    sent.clear()
    shard.flush_metrics()
    assert sent == [], "nothing new: nothing sent"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.ones(3), r"shard.log\(loss=...\) needs a scalar, got shape \(3,\)"),
        ("high", r"shard.log\(loss=...\) needs a number or a one-element tensor, got 'high'"),
        (None, r"needs a number or a one-element tensor, got None"),
    ],
)
def test_a_value_that_is_not_a_scalar_fails_at_the_call(value: Any, message: str) -> None:
    shard = _shard([])
    with pytest.raises((ValueError, TypeError), match=message):
        shard.log(loss=value)
