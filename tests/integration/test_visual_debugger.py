"""JupyterLab's visual debugger on the ranks, driven as JupyterLab drives it: ``debug_request`` on the
control channel (initialize, attach, dumpCell, setBreakpoints, configurationDone), then the cell is
executed; each rank that reaches the gutter breakpoint says ``stopped``; threads, stackTrace, scopes,
variables, evaluate, next and continue act on the rank whose ids they carry."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jupyter_shard.notebook.debug_adapter import RANK_IDS, from_global
from tests.conftest import Kernel

pytestmark = pytest.mark.timeout(180)


class Debugger:
    """The frontend's side of Jupyter's debug protocol."""

    def __init__(self, kernel: Kernel) -> None:
        self.kc = kernel.kc
        self.seq = 0
        self.events: list[dict[str, Any]] = []
        self.streams: list[str] = []

    def request(self, command: str, **arguments: Any) -> dict[str, Any]:
        self.seq += 1
        content = {"type": "request", "seq": self.seq, "command": command, "arguments": arguments}
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        while True:
            reply = self.kc.control_channel.get_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                response: dict[str, Any] = reply["content"]
                return response

    def wait_for(self, event: str, count: int = 1, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Read iopub until ``count`` rank events named ``event`` came (keeping everything read)."""
        deadline = time.monotonic() + timeout
        while len(self.rank_events(event)) < count and time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "debug_event":
                self.events.append(msg["content"])
            elif msg["msg_type"] == "stream":
                self.streams.append(msg["content"]["text"])
        return self.rank_events(event)

    def rank_events(self, event: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["event"] == e["event"] == event and from_global(e["body"].get("threadId"))
        ]


@pytest.fixture(scope="module")
def debugged(shared_kernel: Kernel) -> Iterator[tuple[Kernel, Debugger]]:
    assert shared_kernel.execute("%%distributed --nproc 2 --device cpu\npass").ok
    debugger = Debugger(shared_kernel)
    assert debugger.request(
        "initialize", clientID="test", adapterID="python", pathFormat="path", linesStartAt1=True
    )["success"]
    assert debugger.request("attach")["success"]
    yield shared_kernel, debugger
    debugger.request("disconnect", restart=False, terminateDebuggee=False)


def _run_to_breakpoint(debugger: Debugger, code: str, line: int) -> str:
    path = str(debugger.request("dumpCell", code=code)["body"]["sourcePath"])
    assert debugger.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": line}])["success"]
    assert debugger.request("configurationDone")["success"]
    debugger.events.clear()
    debugger.kc.execute(code)
    return path


def test_a_gutter_breakpoint_stops_every_rank_and_its_variables_are_read_per_rank(
    debugged: tuple[Kernel, Debugger],
) -> None:
    kernel, debugger = debugged
    code = "%%distributed\nscale = 10 + shard.rank\nresult = scale * 2\nprint('result', result)"
    path = _run_to_breakpoint(debugger, code, line=3)
    stopped = debugger.wait_for("stopped", count=2)
    assert sorted(from_global(e["body"]["threadId"]) for e in stopped) == [(0, 1), (1, 1)]  # type: ignore[type-var]
    assert all(e["body"]["reason"] == "breakpoint" for e in stopped)

    threads = debugger.request("threads")["body"]["threads"]
    names = {t["name"] for t in threads if t["id"] >= RANK_IDS}
    assert names == {"rank 0 · MainThread", "rank 1 · MainThread"}
    assert any(t["id"] < RANK_IDS for t in threads)  # the kernel's own threads are still listed

    thread = stopped[0]["body"]["threadId"]
    frames = debugger.request("stackTrace", threadId=thread)["body"]["stackFrames"]
    assert [f["name"] for f in frames] == ["rank 0 · <module>", "rank 1 · <module>"]
    assert {f["line"] for f in frames} == {3} and {f["source"]["path"] for f in frames} == {path}

    values = {}
    for frame in frames:
        rank = from_global(frame["id"])
        assert rank is not None
        scopes = debugger.request("scopes", frameId=frame["id"])["body"]["scopes"]
        local = next(s for s in scopes if s["name"] == "Locals")
        variables = debugger.request("variables", variablesReference=local["variablesReference"])["body"]
        by_name = {v["name"]: v["value"] for v in variables["variables"]}
        assert "result" not in by_name and "In" not in by_name and "_ih" not in by_name
        values[rank[0]] = by_name["scale"]
        evaluated = debugger.request("evaluate", expression="scale * 3", frameId=frame["id"], context="watch")
        assert evaluated["body"]["result"] == str((10 + rank[0]) * 3)
    assert values == {0: "10", 1: "11"}

    # `next` acts on the selected rank only: rank 1 moves to line 4, rank 0 stays at line 3.
    rank1 = next(e["body"]["threadId"] for e in stopped if from_global(e["body"]["threadId"]) == (1, 1))
    assert debugger.request("next", threadId=rank1)["success"]
    debugger.wait_for("stopped", count=3)
    frames = debugger.request("stackTrace", threadId=rank1)["body"]["stackFrames"]
    assert [(f["name"], f["line"]) for f in frames] == [("rank 0 · <module>", 3), ("rank 1 · <module>", 4)]

    assert debugger.request("continue", threadId=rank1)["body"]["allThreadsContinued"]
    debugger.wait_for("continued", count=3)
    reply = kernel.kc.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "ok"
    debugger.wait_for("never", timeout=1.0)  # the cell's remaining output
    text = "".join(debugger.streams)
    assert "[rank 0] result 20" in text and "[rank 1] result 22" in text
    assert debugger.request("debugInfo")["body"]["stoppedThreads"] == []


def test_a_breakpoint_in_a_function_from_an_earlier_cell_stops_where_it_is_called(
    debugged: tuple[Kernel, Debugger],
) -> None:
    kernel, debugger = debugged
    define = "%%distributed\ndef double(v):\n    twice = v * 2\n    return twice"
    path = str(debugger.request("dumpCell", code=define)["body"]["sourcePath"])
    debugger.request("setBreakpoints", source={"path": path}, breakpoints=[])
    assert kernel.execute(define).ok  # compiled under the debugger's file name for the cell
    assert debugger.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": 4}])["success"]
    debugger.events.clear()
    kernel.kc.execute("%%distributed\nout = double(shard.rank + 5)\nout")
    stopped = debugger.wait_for("stopped", count=2)
    thread = stopped[0]["body"]["threadId"]
    frames = debugger.request("stackTrace", threadId=thread)["body"]["stackFrames"]
    shown = [(f["name"], f["line"]) for f in frames]
    assert shown == [
        ("rank 0 · double", 4),
        ("rank 0 · <module>", 2),
        ("rank 1 · double", 4),
        ("rank 1 · <module>", 2),
    ]
    assert frames[0]["source"]["path"] == path  # the defining cell's file: the gutter shows the stop
    # JupyterLab forgets the stopped thread before asking to continue and names the kernel's thread 1.
    assert debugger.request("continue", threadId=1)["success"]
    reply = kernel.kc.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "ok"
    debugger.request("setBreakpoints", source={"path": path}, breakpoints=[])


def test_without_breakpoints_cells_run_as_before_and_the_kernels_own_cells_are_debugged(
    debugged: tuple[Kernel, Debugger],
) -> None:
    kernel, debugger = debugged
    run = kernel.execute("%%distributed\nshard.rank * 10")
    assert run.ok and "[rank 1] 10" in run.data("execute_result")[0]["text/plain"]
    local = "a_local = 41\na_local += 1\na_local"
    path = str(debugger.request("dumpCell", code=local)["body"]["sourcePath"])
    assert debugger.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": 2}])["success"]
    debugger.events.clear()
    kernel.kc.execute(local)
    deadline = time.monotonic() + 20
    while not any(e["event"] == "stopped" for e in debugger.events) and time.monotonic() < deadline:
        debugger.wait_for("never", timeout=0.2)
    stopped = [e for e in debugger.events if e["event"] == "stopped"]
    assert stopped and from_global(stopped[0]["body"]["threadId"]) is None  # the kernel's own thread
    assert debugger.request("continue", threadId=stopped[0]["body"]["threadId"])["success"]
    assert kernel.kc.get_shell_msg(timeout=30)["content"]["status"] == "ok"
    debugger.request("setBreakpoints", source={"path": path}, breakpoints=[])
