"""JupyterLab's debugger requests routed to ranks: id mapping, which requests stay with the kernel's
own debugger, and what a rank's answer becomes, with a stand-in kernel debugger and debug link."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from jupyter_shard.notebook.debug_adapter import RANK_IDS, RankDebugRouter, from_global, to_global
from jupyter_shard.pool.debugging import DebugLink


class _KernelDebugger:
    """ipykernel's ``Debugger``: what the router reads and wraps."""

    def __init__(self) -> None:
        self.is_started = True
        self.breakpoint_list: dict[str, list[dict[str, Any]]] = {}
        self.stopped_threads: set[int] = set()
        self.events: list[dict[str, Any]] = []
        self.handled: list[dict[str, Any]] = []

    def event_callback(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    async def process_request(self, message: dict[str, Any]) -> dict[str, Any]:
        self.handled.append(message)
        body = {"threads": [{"id": 1, "name": "MainThread"}]} if message["command"] == "threads" else {}
        return {"type": "response", "command": message["command"], "success": True, "body": body}


class _Link:
    """The pool's debug link: ranks stopped now, and their answers."""

    def __init__(self, stopped: set[int], answers: dict[tuple[int, str], dict[str, Any]]) -> None:
        self.stopped = stopped
        self.answers = answers
        self.asked: list[tuple[int, str, dict[str, Any]]] = []

    def request(self, rank: int, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
        self.asked.append((rank, command, arguments))
        body = self.answers.get((rank, command), {})
        return {"success": True, "message": "", "body": body}


@pytest.fixture
def kernel() -> SimpleNamespace:
    code = "%%distributed\nx = 1\n"
    return SimpleNamespace(debugger=_KernelDebugger(), get_parent=lambda channel: {"content": {"code": code}})


def _router(kernel: SimpleNamespace, link: _Link | None, started: bool = True) -> RankDebugRouter:
    pool = None if link is None else SimpleNamespace(started=started, debugger=link)
    return RankDebugRouter(kernel, SimpleNamespace(pool=pool))


def _ask(router: RankDebugRouter, command: str, seq: int = 5, **arguments: Any) -> dict[str, Any]:
    message = {"type": "request", "seq": seq, "command": command, "arguments": arguments}
    return asyncio.run(router.process_request(message))


@pytest.mark.parametrize(("rank", "local"), [(0, 1), (3, 0), (7, RANK_IDS - 1)])
def test_rank_ids_round_trip_far_above_the_kernels_own(rank: int, local: int) -> None:
    number = to_global(rank, local)
    assert number >= RANK_IDS
    assert from_global(number) == (rank, local)


@pytest.mark.parametrize("number", [0, 1, 12345, RANK_IDS - 1, "4", None, 1.5e20])
def test_ids_that_are_not_a_ranks_map_to_nothing(number: Any) -> None:
    assert from_global(number) is None


@pytest.fixture
def installed(kernel: SimpleNamespace) -> Iterator[RankDebugRouter]:
    router = _router(kernel, _Link(set(), {}))
    original = kernel.debugger.process_request
    router.install()
    yield router
    router.uninstall()
    assert kernel.debugger.process_request == original
    assert DebugLink.setup() is None  # the pool no longer asks the notebook


def test_install_routes_the_kernels_requests_and_gives_the_pool_each_cells_setup(
    installed: RankDebugRouter, kernel: SimpleNamespace
) -> None:
    from ipykernel.compiler import get_file_name

    assert kernel.debugger.process_request == installed.process_request
    kernel.debugger.breakpoint_list = {"/tmp/cell.py": [{"line": 2}, {"line": 5}]}
    assert DebugLink.setup() == {
        "filename": get_file_name("%%distributed\nx = 1\n"),
        "breakpoints": {"/tmp/cell.py": [2, 5]},
    }
    kernel.debugger.is_started = False
    assert DebugLink.setup() is None


@pytest.mark.parametrize("link", [None, "stopped-pool"], ids=["no-pool", "pool-not-started"])
def test_without_a_running_pool_every_request_is_the_kernels(
    kernel: SimpleNamespace, link: str | None
) -> None:
    router = _router(kernel, None if link is None else _Link({0}, {}), started=False)
    reply = _ask(router, "stackTrace", threadId=to_global(0, 1))
    assert reply["success"] and len(kernel.debugger.handled) == 1


def test_threads_lists_the_kernels_then_each_stopped_rank(kernel: SimpleNamespace) -> None:
    reply = _ask(_router(kernel, _Link({2, 0}, {})), "threads")
    assert reply["body"]["threads"] == [
        {"id": 1, "name": "MainThread"},
        {"id": to_global(0, 1), "name": "rank 0 · MainThread"},
        {"id": to_global(2, 1), "name": "rank 2 · MainThread"},
    ]


def test_a_request_about_the_kernels_own_frame_stays_with_the_kernel(kernel: SimpleNamespace) -> None:
    link = _Link({0}, {})
    _ask(_router(kernel, link), "scopes", frameId=3)
    _ask(_router(kernel, link), "setBreakpoints", source={"path": "x"})
    assert [m["command"] for m in kernel.debugger.handled] == ["scopes", "setBreakpoints"]
    assert link.asked == []


def test_a_frame_request_goes_to_its_rank_with_the_ranks_ids(kernel: SimpleNamespace) -> None:
    scopes = {
        "scopes": [{"name": "Locals", "variablesReference": 4}, {"name": "Empty", "variablesReference": 0}]
    }
    link = _Link({1}, {(1, "scopes"): scopes})
    reply = _ask(_router(kernel, link), "scopes", seq=9, frameId=to_global(1, 17))
    assert link.asked == [(1, "scopes", {"frameId": 17})]
    assert reply["type"] == "response" and reply["request_seq"] == 9 and reply["command"] == "scopes"
    assert reply["success"] and "message" not in reply
    assert reply["body"]["scopes"] == [
        {"name": "Locals", "variablesReference": to_global(1, 4)},
        {"name": "Empty", "variablesReference": 0},
    ]
    assert kernel.debugger.handled == []


def test_variables_and_evaluate_are_read_on_the_rank_that_owns_the_reference(kernel: SimpleNamespace) -> None:
    answers = {
        (2, "variables"): {"variables": [{"name": "x", "value": "1", "variablesReference": 0}]},
        (2, "evaluate"): {"result": "[1]", "variablesReference": 8},
    }
    link = _Link({2}, answers)
    router = _router(kernel, link)
    variables = _ask(router, "variables", variablesReference=to_global(2, 4))
    evaluated = _ask(router, "evaluate", expression="y", frameId=to_global(2, 17))
    assert link.asked == [
        (2, "variables", {"variablesReference": 4}),
        (2, "evaluate", {"expression": "y", "frameId": 17}),
    ]
    assert variables["body"]["variables"][0]["name"] == "x"
    assert evaluated["body"]["variablesReference"] == to_global(2, 8)


def test_a_step_acts_on_the_selected_rank_only(kernel: SimpleNamespace) -> None:
    link = _Link({0, 1}, {})
    _ask(_router(kernel, link), "next", threadId=to_global(1, 1))
    assert link.asked == [(1, "next", {"threadId": 1})]


def test_the_call_stack_holds_every_stopped_ranks_frames_named_by_rank(kernel: SimpleNamespace) -> None:
    answers = {
        (0, "stackTrace"): {"stackFrames": [{"id": 1, "name": "step"}, {"id": 2, "name": "<module>"}]},
        (3, "stackTrace"): {"stackFrames": [{"id": 1, "name": "forward"}]},
    }
    link = _Link({3, 0}, answers)
    reply = _ask(_router(kernel, link), "stackTrace", threadId=to_global(3, 1))
    frames = reply["body"]["stackFrames"]
    assert [(f["id"], f["name"]) for f in frames] == [
        (to_global(0, 1), "rank 0 · step"),
        (to_global(0, 2), "rank 0 · <module>"),
        (to_global(3, 1), "rank 3 · forward"),
    ]
    assert reply["body"]["totalFrames"] == 3


def test_continue_on_a_rank_lets_every_stopped_rank_go_on(kernel: SimpleNamespace) -> None:
    link = _Link({1, 0}, {})
    reply = _ask(_router(kernel, link), "continue", threadId=to_global(1, 1))
    assert link.asked == [(0, "continue", {"threadId": 1}), (1, "continue", {"threadId": 1})]
    assert reply["body"] == {"allThreadsContinued": True}


def test_continue_on_the_kernels_running_thread_goes_to_the_stopped_ranks(kernel: SimpleNamespace) -> None:
    link = _Link({2}, {})
    reply = _ask(_router(kernel, link), "continue", threadId=1)
    assert link.asked == [(2, "continue", {"threadId": 1})] and reply["success"]
    assert kernel.debugger.handled == []


def test_continue_on_a_kernel_thread_its_own_debugger_stopped_stays_with_the_kernel(
    kernel: SimpleNamespace,
) -> None:
    kernel.debugger.stopped_threads.add(1)
    link = _Link({2}, {})
    _ask(_router(kernel, link), "continue", threadId=1)
    assert link.asked == [] and [m["command"] for m in kernel.debugger.handled] == ["continue"]


def test_a_ranks_events_reach_the_frontend_with_its_thread_made_global(kernel: SimpleNamespace) -> None:
    router = _router(kernel, _Link(set(), {}))
    thread = to_global(1, 1)
    router.on_event(1, {"event": "stopped", "body": {"threadId": 1, "reason": "breakpoint"}})
    assert kernel.debugger.stopped_threads == {thread}
    router.on_event(1, {"event": "output", "body": {"output": "hi"}})
    router.on_event(1, {"event": "continued", "body": {"threadId": 1}})
    assert kernel.debugger.stopped_threads == set()
    assert kernel.debugger.events == [
        {"type": "event", "seq": 0, "event": "stopped", "body": {"threadId": thread, "reason": "breakpoint"}},
        {"type": "event", "seq": 0, "event": "output", "body": {"output": "hi"}},
        {"type": "event", "seq": 0, "event": "continued", "body": {"threadId": thread}},
    ]
