"""jupyter_shard.pool.escalation: what the notebook is told when ranks end a cell without a usable
process group (the cell destroyed it, NCCL found it broken, or its health cannot be read after a
failed collective), and when the pool aborted it itself; with a stand-in connection (no ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.escalation import Escalation
from jupyter_shard.pool.history import History
from jupyter_shard.pool.ranks import RankRecord, RankState, RankTable
from jupyter_shard.wire.messages import GROUP_DESTROYED, GROUP_UNKNOWN
from jupyter_shard.wire.protocol import Message
from tests.unit.pool.handles import IdleHandle


class _Connection:
    """Answers every request at once, as ranks that did what they were asked."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, targets: list[RankRecord], msg_type: str, body: dict[str, Any]) -> None:
        self.sent.append(msg_type)

    def request(
        self, msg_type: str, body: dict[str, Any], targets: list[RankRecord], *, timeout: float
    ) -> dict[int, Message]:
        self.sent.append(msg_type)
        reply = {"ok": True, "error": "", "closed": 1, "prepared": False, "seconds": 0.005}
        return {r.rank: Message(f"{msg_type}_reply", reply) for r in targets}


@pytest.fixture
def notices() -> list[str]:
    return []


@pytest.fixture
def escalation(tmp_path: Path, notices: list[str]) -> Escalation:
    """Two idle CUDA ranks (an NCCL pool)."""
    ranks = RankTable(History())
    for k in (0, 1):
        record = RankRecord(IdleHandle(k), tmp_path / f"rank-{k}.log")
        record.state, record.device = RankState.IDLE, f"cuda:{k}"
        ranks.add(record)
    return Escalation(cast(Connection, _Connection()), ranks, notices.append, lambda ranks: {})


def _regroup(escalation: Escalation, tmp_path: Path) -> bool:
    return escalation.regroup(tmp_path, on_agent_store=False, world_size=2, timeout=5.0)


def test_a_group_the_cell_destroyed_is_said_as_before(
    escalation: Escalation, notices: list[str], tmp_path: Path
) -> None:
    escalation.group_closed(0, GROUP_DESTROYED)
    escalation.group_closed(1)  # a done that does not say why
    escalation.say_group_closed()
    assert notices == [
        "the cell closed the process group on rank 0-1 (destroy_process_group); the next cell gets a new one"
    ]
    assert escalation.regroup_needed and _regroup(escalation, tmp_path)
    assert notices[-1] == "rebuilt the process group after destroy_process_group in 5 ms; rank state is kept"


def test_a_group_nccl_found_broken_is_not_said_to_be_closed_by_the_cell(
    escalation: Escalation, notices: list[str], tmp_path: Path
) -> None:
    escalation.group_closed(1, "REMOTE_ERROR")
    escalation.say_group_closed()
    assert notices == [
        "NCCL found the process group broken on rank 1 (REMOTE_ERROR: an error on a peer rank); "
        "the next cell gets a new one"
    ]
    assert _regroup(escalation, tmp_path)
    assert notices[-1] == (
        "rebuilt the process group after NCCL found it broken (REMOTE_ERROR) in 5 ms; rank state is kept"
    )


def test_a_group_of_unknown_health_after_a_failed_collective_is_said_to_be_untrusted(
    escalation: Escalation, notices: list[str], tmp_path: Path
) -> None:
    escalation.group_closed(0, GROUP_UNKNOWN)
    escalation.group_closed(1, GROUP_UNKNOWN)
    escalation.say_group_closed()
    assert notices == [
        "a collective failed on rank 0-1, where NCCL's error record cannot be read, so its process group "
        "is not trusted; the next cell gets a new one"
    ]
    assert _regroup(escalation, tmp_path)
    assert notices[-1] == "rebuilt the process group after a failed collective in 5 ms; rank state is kept"


def test_each_cause_is_named_with_its_ranks_the_cells_own_first(
    escalation: Escalation, notices: list[str]
) -> None:
    escalation.group_closed(0, "COMM_ERROR")
    escalation.group_closed(1, GROUP_DESTROYED)
    escalation.say_group_closed()
    assert notices == [
        "the cell closed the process group on rank 1 (destroy_process_group); NCCL found the process "
        "group broken on rank 0 (COMM_ERROR: a communication error); the next cell gets a new one"
    ]


def test_a_group_the_pool_aborted_to_free_a_blocked_rank_is_not_blamed_on_the_cell(
    escalation: Escalation, notices: list[str], tmp_path: Path
) -> None:
    escalation.ranks[1].collective = "all_reduce"  # its heartbeat says where it waits
    escalation.stop([1], "timed out", lambda still, grace, done_early: [])
    assert "rank 1 is blocked in all_reduce on NCCL: aborting its process group to free it" in notices
    escalation.group_closed(1, GROUP_DESTROYED)  # its done: the abort left it without a group
    said = len(notices)
    escalation.say_group_closed()
    assert len(notices) == said
    assert _regroup(escalation, tmp_path)
    assert notices[-1] == "rebuilt the process group after the desync in 5 ms; rank state is kept"
