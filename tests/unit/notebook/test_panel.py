"""The kernel end of the side panel: replies to status and control requests over a fake comm."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jupyter_shard
from jupyter_shard.notebook import panel
from jupyter_shard.pool.ranks import RankSnapshot, RankState

ROOT = Path(__file__).resolve().parents[3]


class FakeComm:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.handler: Callable[[dict[str, Any]], None] | None = None
        self.closer: Callable[[dict[str, Any]], None] | None = None

    def send(self, data: dict[str, Any]) -> None:
        json.dumps(data)  # what the comm would put on the wire
        self.sent.append(data)

    def on_msg(self, callback: Callable[[dict[str, Any]], None]) -> None:
        self.handler = callback

    def on_close(self, callback: Callable[[dict[str, Any]], None]) -> None:
        self.closer = callback

    def request(self, name: str) -> dict[str, Any]:
        assert self.handler is not None
        self.handler({"content": {"data": {"request": name}}})
        return self.sent[-1]


PROBLEMS = {"dead": "dead: exit 1", "broken": "broken: CUDA context lost (CUDA error: …)"}


class FakePool:
    def __init__(self, states: list[RankState]) -> None:
        self.started = True
        self.background = None
        self.spec = SimpleNamespace(describe=lambda: f"{len(states)} CPU ranks · ddp")
        self.states = states
        self.calls: list[str] = []

    def activity(self) -> list[RankSnapshot]:
        return [
            RankSnapshot(
                rank=k,
                state=s,
                step=3.0,
                memory={"rss": 2**20},
                heartbeat_age=0.4,
                problem=PROBLEMS.get(s.value, ""),
            )
            for k, s in enumerate(self.states)
        ]

    def interrupt(self) -> None:
        self.calls.append("interrupt")

    def restart(self) -> None:
        self.calls.append("restart")

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def stacks(self) -> dict[int, str]:
        return {0: "MainThread:\n  File x", 1: "MainThread:\n  File y"}


def _panel(pool: FakePool | None) -> tuple[FakeComm, Any]:
    comm = FakeComm()
    holder = SimpleNamespace(pool=pool)
    panel.PanelComm(comm, holder)  # type: ignore[arg-type]
    return comm, holder


def test_status_lists_every_rank_and_the_pool_state() -> None:
    comm, _ = _panel(FakePool([RankState.IDLE, RankState.IDLE]))
    reply = comm.request("status")
    assert reply["reply"] == "status"
    assert reply["pool"] == "2 CPU ranks · ddp"
    assert reply["state"] == "idle"
    assert [r["rank"] for r in reply["ranks"]] == [0, 1]
    assert reply["ranks"][0] == {
        "rank": 0,
        "state": "idle",
        "step": 3.0,
        "memory": {"rss": 2**20, "cuda": None},
        "heartbeat_age": 0.4,
        "cell": "",
        "problem": "",
    }


def test_state_is_running_if_any_rank_runs_and_failed_if_one_died() -> None:
    comm, _ = _panel(FakePool([RankState.IDLE, RankState.RUNNING]))
    assert comm.request("status")["state"] == "running"
    comm, _ = _panel(FakePool([RankState.IDLE, RankState.DEAD]))
    reply = comm.request("status")
    assert reply["state"] == "failed"
    assert reply["ranks"][1]["problem"] == "dead: exit 1"


def test_a_stopped_cell_leaves_the_ranks_interrupted_not_failed() -> None:
    comm, _ = _panel(FakePool([RankState.INTERRUPTED, RankState.INTERRUPTED]))
    reply = comm.request("status")
    assert reply["state"] == "interrupted"
    assert [r["state"] for r in reply["ranks"]] == ["interrupted", "interrupted"]
    comm, _ = _panel(FakePool([RankState.INTERRUPTED, RankState.FAILED]))
    assert comm.request("status")["state"] == "failed"


def test_a_rank_that_lost_its_cuda_context_shows_the_pool_broken_until_a_restart() -> None:
    comm, _ = _panel(FakePool([RankState.IDLE, RankState.BROKEN, RankState.FAILED]))
    reply = comm.request("status")
    assert reply["state"] == "broken (rank 1: CUDA context lost; restart)"
    assert reply["ranks"][1]["state"] == "broken"
    assert reply["ranks"][1]["problem"].startswith("broken: CUDA context lost")
    comm, _ = _panel(FakePool([RankState.DEAD, RankState.BROKEN]))  # a dead rank is said first
    assert comm.request("status")["state"] == "failed"


def test_no_pool() -> None:
    comm, _ = _panel(None)
    assert comm.request("status") == {
        "reply": "status",
        "pool": None,
        "state": "no pool",
        "ranks": [],
        "message": "",
    }
    reply = comm.request("interrupt")
    assert reply["reply"] == "error"
    assert "no pool to interrupt" in reply["error"]


def test_controls_reach_the_pool() -> None:
    pool = FakePool([RankState.IDLE])
    comm, holder = _panel(pool)
    assert comm.request("interrupt")["message"] == "interrupt sent"
    assert "rank state is lost" in comm.request("restart")["message"]
    reply = comm.request("shutdown")
    assert pool.calls == ["interrupt", "restart", "shutdown"]
    assert holder.pool is None
    assert reply["state"] == "no pool"


def test_stacks_text_names_every_rank() -> None:
    comm, _ = _panel(FakePool([RankState.RUNNING, RankState.RUNNING]))
    reply = comm.request("stacks")
    assert reply["reply"] == "stacks"
    assert "──── rank 0 ────" in reply["text"] and "File y" in reply["text"]


def test_unknown_request_and_failing_action_are_one_error_line() -> None:
    pool = FakePool([RankState.IDLE])
    comm, _ = _panel(pool)
    assert "unknown request 'explode'" in comm.request("explode")["error"]

    def broken() -> None:
        raise RuntimeError("rank 1 is dead")

    pool.restart = broken  # type: ignore[method-assign]
    reply = comm.request("restart")
    assert reply == {"reply": "error", "request": "restart", "error": "restart failed: rank 1 is dead"}


def test_register_comm_without_a_kernel_does_nothing(monkeypatch: Any) -> None:
    registered: list[str] = []
    manager = SimpleNamespace(register_target=lambda name, fn: registered.append(name))
    monkeypatch.setattr("comm.get_comm_manager", lambda: manager)
    panel.register_comm(SimpleNamespace(), SimpleNamespace(pool=None))  # type: ignore[arg-type]
    assert registered == []
    panel.register_comm(SimpleNamespace(kernel=object()), SimpleNamespace(pool=None))  # type: ignore[arg-type]
    assert registered == [panel.COMM_TARGET]  # the same call with a kernel does register


def test_register_comm_opens_a_panel_that_answers_the_open_message(monkeypatch: Any) -> None:
    targets: dict[str, Any] = {}
    manager = SimpleNamespace(register_target=lambda name, fn: targets.__setitem__(name, fn))
    monkeypatch.setattr("comm.get_comm_manager", lambda: manager)
    panel.register_comm(SimpleNamespace(kernel=object()), SimpleNamespace(pool=None))  # type: ignore[arg-type]
    comm = FakeComm()
    targets[panel.COMM_TARGET](comm, {"content": {"data": {"request": "status"}}})
    assert comm.sent[-1]["state"] == "no pool"
    assert panel.frontend_attached()
    assert comm.closer is not None
    comm.closer({})
    assert not panel.frontend_attached()


def test_extension_version_is_the_python_version() -> None:
    package = json.loads((ROOT / "labextension" / "package.json").read_text())
    assert package["version"] == jupyter_shard.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", package["version"])


def test_restart_and_shutdown_wait_for_the_running_cell() -> None:
    pool = FakePool([RankState.RUNNING, RankState.IDLE])
    comm, holder = _panel(pool)
    for request in ("restart", "shutdown"):
        reply = comm.request(request)
        assert reply["reply"] == "error"
        assert "a cell is running on the ranks; interrupt it first" in reply["error"]
    assert pool.calls == []
    assert holder.pool is pool


def _starting_pool(ready: int, total: int) -> FakePool:
    pool = FakePool([RankState.IDLE] * ready + [RankState.STARTING] * (total - ready))
    pool.started = total > 0  # the pool's socket is open from the launch on
    return pool


def test_while_the_ranks_start_the_panel_says_how_many_are_ready_not_no_pool() -> None:
    comm, _ = _panel(_starting_pool(37, 64))
    reply = comm.request("status")
    assert reply["pool"] == "64 CPU ranks · ddp" and reply["state"] == "starting: 37 of 64 ranks ready"
    assert [(r["rank"], r["state"]) for r in reply["ranks"]] == [("0-36", "idle"), ("37-63", "starting")]
    comm, _ = _panel(_starting_pool(61, 64))  # few left: which
    assert comm.request("status")["state"] == "starting: 61 of 64 ranks ready (waiting for rank 61-63)"
    comm, _ = _panel(_starting_pool(0, 0))  # nothing launched yet
    assert comm.request("status")["state"] == "no pool"


def test_the_start_is_sent_to_open_panels_when_the_count_changes_at_most_twice_a_second(
    monkeypatch: Any,
) -> None:
    comm = FakeComm()
    monkeypatch.setattr(panel, "_open", [SimpleNamespace(comm=comm)])
    clock = [100.0]
    monkeypatch.setattr(panel.time, "monotonic", lambda: clock[0])
    notice = panel.PromptNotice()
    notice.starting(_starting_pool(0, 4))  # type: ignore[arg-type]
    notice.starting(_starting_pool(0, 4))  # type: ignore[arg-type]  # the same: not sent again
    clock[0] += 0.1
    notice.starting(_starting_pool(1, 4))  # type: ignore[arg-type]  # changed, but too soon
    clock[0] += 0.5
    notice.starting(_starting_pool(2, 4))  # type: ignore[arg-type]
    assert [m["state"] for m in comm.sent] == [
        "starting: 0 of 4 ranks ready",
        "starting: 2 of 4 ranks ready (waiting for rank 2-3)",
    ]


def test_at_1024_ranks_the_panel_gets_a_row_per_state_and_per_rank_in_trouble() -> None:
    """From 9 ranks the side panel's rows are the status table's: each rank in trouble on its own row,
    then a row per state (its ranks as a range, how many, the lowest step, the largest memory, the
    oldest heartbeat). A row per rank made each 2-second poll 149 KB at 1,024 ranks, and 1,024 rows
    in a 250 px panel."""
    states = [RankState.IDLE] * 1024
    states[5] = RankState.DEAD
    states[700:710] = [RankState.RUNNING] * 10
    comm, _ = _panel(FakePool(states))
    reply = comm.request("status")
    assert reply["state"] == "running"
    assert [(r["rank"], r["count"], r["state"], r["problem"]) for r in reply["ranks"]] == [
        ("5", 1, "dead", "dead: exit 1"),
        ("0-4,6-699,710-1023", 1013, "idle", ""),
        ("700-709", 10, "running", ""),
    ]
    group = reply["ranks"][1]
    assert group["step"] == 3.0 and group["memory"] == {"rss": 2**20, "cuda": None}
    assert group["heartbeat_age"] == 0.4
    assert len(json.dumps(reply)) < 2_000
    many_dead = [RankState.DEAD] * 20 + [RankState.IDLE] * 1004
    rows = _panel(FakePool(many_dead))[0].request("status")["ranks"]
    assert [(r["rank"], r["count"], r["problem"]) for r in rows] == [
        ("0-19", 20, "dead: exit 1 (and 19 more)"),
        ("20-1023", 1004, ""),
    ]
    few = _panel(FakePool([RankState.IDLE] * 8))[0].request("status")["ranks"]
    assert [r["rank"] for r in few] == list(range(8)) and "count" not in few[0]
