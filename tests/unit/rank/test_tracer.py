"""jupyter_shard.rank.tracer: JupyterLab's debugger on a rank, a cell traced in this process.

The cell is run as the rank runs it: compiled under the file name the kernel's debugger gave it,
in a ``__main__`` namespace, called from hidden machinery (here a function whose module is named
``IPython.…``). The socket is a stand-in that hands out the debugger's requests in order and
records what the tracer sends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from jupyter_shard.rank.tracer import THREAD_ID, RankTracer
from jupyter_shard.wire.messages import check_body
from jupyter_shard.wire.protocol import Message

pytestmark = pytest.mark.timeout(30)

FILENAME = "/tmp/ipykernel_4242/1234567.py"
CELL = """a = 1
b = [1, 2]
c = a + 1
d = {"k": c}
e = 5
"""

# the shell that runs a cell: hidden from the debugger, as IPython's frames are
_run = eval("lambda code, ns: exec(code, ns)", {"__name__": "IPython.core.fake_shell"})


class _NoMoreRequests(Exception):
    pass


class FakeSock:
    def __init__(self, requests: list[Message]) -> None:
        self.requests = list(requests)
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def poll_recv(self, timeout_ms: int) -> Message | None:
        if not self.requests:
            raise _NoMoreRequests("the tracer waited for a request the test did not plan")
        return self.requests.pop(0)

    def send(self, msg_type: str, body: Any, buffers: list[Any] | None = None) -> None:
        assert check_body(msg_type, body) == [], body
        self.sent.append((msg_type, dict(body)))

    def events(self) -> list[tuple[str, Any]]:
        return [(b["event"], b["body"].get("reason")) for t, b in self.sent if t == "debug_event"]

    def response(self, seq: int) -> dict[str, Any]:
        (found,) = [b for t, b in self.sent if t == "debug_response" and b["seq"] == seq]
        return found


def _request(seq: int, command: str, **arguments: Any) -> Message:
    return Message("debug_request", {"seq": seq, "command": command, "arguments": arguments})


@pytest.fixture(autouse=True)
def no_trace_left() -> Iterator[None]:
    previous = sys.gettrace()
    yield
    sys.settrace(previous)


def _run_cell(
    tracer: RankTracer, breakpoints: dict[str, list[int]], code: str = CELL
) -> tuple[bool, dict[str, Any]]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    armed = tracer.arm({"filename": FILENAME, "breakpoints": breakpoints}, code)
    if armed:
        tracer.start()
    try:
        _run(compile(code, FILENAME, "exec"), ns)
    finally:
        tracer.stop()
    return armed, ns


def test_no_breakpoint_or_one_on_a_line_without_code_leaves_the_cell_untraced() -> None:
    sock = FakeSock([])
    tracer = RankTracer(0, sock, lambda msg: None)  # type: ignore[arg-type]
    assert tracer.arm({"filename": FILENAME, "breakpoints": {}}, CELL) is False
    assert tracer.arm({"filename": FILENAME, "breakpoints": {FILENAME: [40]}}, CELL) is False
    assert tracer.arm({"filename": FILENAME, "breakpoints": {FILENAME: [40, 2]}}, CELL) is True
    armed, ns = _run_cell(tracer, {})
    assert armed is False and ns["e"] == 5 and sock.sent == []


def test_a_breakpoint_stops_the_cell_and_the_debuggers_requests_are_answered() -> None:
    others: list[Message] = []
    answer = Message("answer", {"value": "", "error": "", "eof": False})
    sock = FakeSock(
        [
            _request(1, "threads"),
            _request(2, "stackTrace", threadId=THREAD_ID),
            _request(3, "scopes", frameId=1),
            _request(4, "variables", variablesReference=1),
            _request(5, "variables", variablesReference=3),
            _request(6, "evaluate", expression="a + 1", frameId=1),
            answer,
            _request(7, "bogus"),
            _request(8, "setBreakpoints", source={"path": FILENAME}, breakpoints=[{"line": 5}]),
            _request(9, "next", threadId=THREAD_ID),
            _request(10, "evaluate", expression="c"),
            _request(11, "continue", threadId=THREAD_ID),
            _request(12, "evaluate", expression="d"),
            _request(13, "continue", threadId=THREAD_ID),
        ]
    )
    tracer = RankTracer(2, sock, others.append)  # type: ignore[arg-type]
    armed, ns = _run_cell(tracer, {FILENAME: [3]})

    assert armed and ns["e"] == 5 and sock.requests == []
    assert others == [answer], "a message other than a debug request goes to the runner"
    assert sock.events() == [
        ("stopped", "breakpoint"),
        ("continued", None),
        ("stopped", "step"),  # the line after 3, by "next"
        ("continued", None),
        ("stopped", "breakpoint"),  # line 5, set while stopped; 3's was replaced
        ("continued", None),
    ]
    assert sock.response(1)["body"] == {"threads": [{"id": THREAD_ID, "name": "MainThread"}]}
    stack = sock.response(2)["body"]
    assert stack["totalFrames"] == 1, "only the cell: the shell's frames are hidden"
    assert stack["stackFrames"][0] == {
        "id": 1,
        "name": "<module>",
        "line": 3,
        "column": 1,
        "source": {"path": FILENAME},
    }
    scopes = sock.response(3)["body"]["scopes"]
    assert [(s["name"], s["variablesReference"]) for s in scopes] == [("Locals", 1), ("Globals", 2)]
    variables = sock.response(4)["body"]["variables"]
    assert variables == [
        {"name": "a", "value": "1", "type": "int", "variablesReference": 0},
        {"name": "b", "value": "[1, 2]", "type": "list", "variablesReference": 3},
    ], "the cell's names so far, none of the namespace's own (__builtins__, __name__)"
    items = sock.response(5)["body"]["variables"]
    assert [(v["name"], v["value"]) for v in items] == [("0", "1"), ("1", "2")]
    assert sock.response(6) == {
        "seq": 6,
        "success": True,
        "message": "",
        "body": {"name": "", "result": "2", "type": "int", "variablesReference": 0},
    }
    assert sock.response(7) == {
        "seq": 7,
        "success": False,
        "message": "ValueError: 'bogus' is not supported on a rank",
        "body": {},
    }
    assert sock.response(8)["body"] == {"breakpoints": [{"verified": True, "line": 5}]}
    assert sock.response(10)["body"]["result"] == "2"
    assert sock.response(12)["body"]["result"] == "{'k': 2}"


def test_a_failing_expression_is_answered_with_its_error_and_the_rank_stays_stopped() -> None:
    sock = FakeSock(
        [
            _request(1, "evaluate", expression="undefined_name"),
            _request(2, "evaluate", expression="Bad()"),
            _request(3, "evaluate", expression="'x' * 600"),
            _request(4, "continue"),
        ]
    )
    code = "class Bad:\n    def __repr__(self):\n        raise ValueError\nx = 1\n"
    tracer = RankTracer(0, sock, lambda msg: None)  # type: ignore[arg-type]
    _run_cell(tracer, {FILENAME: [4]}, code)
    failed = sock.response(1)
    assert failed["success"] is False
    assert failed["message"] == "NameError: name 'undefined_name' is not defined"
    assert sock.response(2)["body"]["result"] == "<repr failed: ValueError>"
    long = sock.response(3)["body"]["result"]
    assert len(long) == 501 and long.endswith("…") and long.startswith("'xxx")


def test_step_in_enters_a_function_of_the_cell_and_step_out_leaves_it() -> None:
    code = "def f(n):\n    m = n * 2\n    return m\n\nr = f(3)\ns = r + 1\n"
    sock = FakeSock(
        [
            _request(1, "stepIn"),  # at line 5: into f
            _request(2, "stackTrace"),
            _request(3, "stepOut"),
            _request(4, "continue"),
        ]
    )
    tracer = RankTracer(0, sock, lambda msg: None)  # type: ignore[arg-type]
    _, ns = _run_cell(tracer, {FILENAME: [5]}, code)
    assert ns["s"] == 7
    stops = [b["body"] for t, b in sock.sent if t == "debug_event" and b["event"] == "stopped"]
    assert len(stops) == 3
    frames = sock.response(2)["body"]["stackFrames"]
    assert [(f["name"], f["id"]) for f in frames] == [("f", 1), ("<module>", 2)]
    assert frames[0]["line"] in (1, 2), "stopped inside f"
