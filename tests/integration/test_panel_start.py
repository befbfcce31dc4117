"""The side panel while a pool starts: the kernel is busy in the cell, yet the panel hears how many
ranks are ready (real ranks, a fake comm standing for the open panel)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from jupyter_shard import Pool
from jupyter_shard.notebook import panel

pytestmark = pytest.mark.timeout(120)


class _Comm:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, data: dict[str, Any]) -> None:
        self.sent.append(data)


def test_a_starting_pool_tells_the_panel_how_many_ranks_are_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = _Comm()
    monkeypatch.setattr(panel, "_open", [SimpleNamespace(comm=comm)])
    pool = Pool(nproc=3, device="cpu", log_dir=tmp_path)
    pool.observers.append(panel.PromptNotice())
    try:
        pool.start()
        states = [m["state"] for m in comm.sent]
        assert states, "nothing was sent while the ranks started"
        assert all(s.startswith("starting: ") and s.split()[3:5] == ["3", "ranks"] for s in states), states
        assert all(m["pool"] == "3 CPU ranks · none" for m in comm.sent)
        assert panel.status_reply(pool)["state"] == "idle"  # once started, the usual status
    finally:
        pool.shutdown()
