"""Every message a real pool sends, both ways, matches what the registry declares for its type.

The kernel and both ranks sign with a checking :class:`~jupyter_shard.wire.protocol.Wire`
(``JUPYTER_SHARD_CHECK_PROTOCOL``): each body signed is appended to one file and checked against
:mod:`jupyter_shard.wire.messages`. The pool is driven through every message type a local CPU pool can
send (``signal`` goes only to ranks started by an agent, ``abort`` only to the ranks of a CUDA pool,
``startup_failed`` only from a failing rank).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard import DistributedError, Pool
from jupyter_shard.env import CHECK_PROTOCOL_VAR as CHECK_ENV
from jupyter_shard.pool import debugging
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.wire.messages import HISTORY, MSG_TYPES, DebugSetup, check_body
from jupyter_shard.wire.protocol import KERNEL

pytestmark = pytest.mark.timeout(150)

NOT_DRIVEN = {"signal", "abort", "startup_failed"}

CELL = """
from IPython.display import display
display({"text/plain": "shown"}, raw=True)
shard.log(loss=1.5)
print("out")
x = 41 + shard.rank
x
"""
DESYNC = "import torch, torch.distributed as dist\nif shard.rank == 0:\n    dist.all_reduce(torch.ones(1))"


class _Frontend:
    """The notebook's debugger, as the kernel side sees it: a breakpoint on line 2 of the cell."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.events: list[tuple[int, str]] = []

    def setup(self) -> DebugSetup:
        return {"filename": self.filename, "breakpoints": {self.filename: [2]}}

    def on_event(self, rank: int, event: dict[str, Any]) -> None:
        self.events.append((rank, event["event"]))


def _debug(pool: Pool, filename: str) -> None:
    """Both ranks stop at a breakpoint, answer a request each and go on (``debug_*`` messages)."""
    frontend = _Frontend(filename)
    debugging.set_notebook_debugger(frontend)
    try:
        run = pool.run_background("a = 1\nb = a + 1\n")
        deadline = time.monotonic() + 20
        while pool.debugger.stopped != {0, 1} and time.monotonic() < deadline:
            time.sleep(0.05)
        for rank in (0, 1):
            frames = pool.debugger.request(rank, "stackTrace", {"threadId": 1})
            assert frames["success"] and frames["body"]["stackFrames"][0]["line"] == 2
            assert pool.debugger.request(rank, "continue", {"threadId": 1})["success"]
        assert run.wait(20).ok
    finally:
        debugging.set_notebook_debugger(None)
    assert sorted(frontend.events) == [(0, "continued"), (0, "stopped"), (1, "continued"), (1, "stopped")]


def _drive(pool: Pool, tmp_path: Path) -> None:
    assert pool.run(CELL).ok
    assert pool.run("typed = input('name? ')").ok  # prompt, answer
    _debug(pool, str(tmp_path / "cell.py"))
    pool.push(a=1)
    assert pool.pull("x", rank=1) == 42
    assert set(pool.stacks()) == {0, 1}
    assert len(pool.status()) == 2
    assert set(pool.connection.request(*HISTORY({}), list(pool.ranks), timeout=5.0)) == {0, 1}  # an attach
    since = time.monotonic()
    deadline = since + 10.0
    while any(r.heartbeat <= since for r in pool.ranks) and time.monotonic() < deadline:
        pool.connection.pump(0.05)  # until a heartbeat from each rank's I/O thread has come
    assert all(r.heartbeat > since for r in pool.ranks)
    with pytest.raises(DistributedError):
        pool.run(DESYNC)  # rank 1 closes its group (release) so rank 0's all_reduce fails
    assert pool.run("import torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))").ok  # regroup


def test_every_message_sent_both_ways_matches_its_declared_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "sent.jsonl"
    monkeypatch.setenv(CHECK_ENV, str(record))  # the pool passes it on to the ranks
    with Pool(
        nproc=2,
        device="cpu",
        log_dir=tmp_path / "logs",
        sink=ConsoleSink(io.StringIO(), io.StringIO()),
        stdin=lambda prompt: "typed",
    ) as pool:
        _drive(pool, tmp_path)
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    wrong = [(m["sender"], m["type"], m["problems"]) for m in sent if m["problems"]]
    assert wrong == []
    assert all(check_body(m["type"], m["body"]) == [] for m in sent)  # as received: after JSON
    by_kernel = {m["type"] for m in sent if m["sender"] == KERNEL}
    by_ranks = {m["type"] for m in sent if m["sender"] != KERNEL}
    assert {m["sender"] for m in sent} >= {KERNEL, "rank-0", "rank-1", "rank-0.io", "rank-1.io"}
    assert by_kernel | by_ranks == MSG_TYPES - NOT_DRIVEN, "types not driven by this test"
