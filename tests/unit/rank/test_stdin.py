"""jupyter_shard.rank.stdin: input(), getpass(), sys.stdin and breakpoint() on a rank ask the kernel."""

from __future__ import annotations

import bdb
import builtins
import getpass
import io
import sys
import types
from typing import Any

import pytest
from IPython.core.error import StdinNotImplementedError

from jupyter_shard.rank import stdin as stdin_module
from jupyter_shard.rank.runner import CellState
from jupyter_shard.rank.stdin import SKIPPED_MODULES, RankStdin
from jupyter_shard.wire.messages import check_body
from jupyter_shard.wire.protocol import Message

pytestmark = pytest.mark.timeout(30)


class FakeSock:
    """Hands out the planned messages (None: nothing came within the poll) and records prompts."""

    def __init__(self, state: CellState, *incoming: Message | BaseException | None) -> None:
        self.state = state
        self.incoming = list(incoming)
        self.sent: list[dict[str, Any]] = []
        self.waiting_seen: list[str] = []
        self.others: list[Message] = []  # what the runner was handed while the prompt waited

    def send(self, msg_type: str, body: Any) -> None:
        assert msg_type == "prompt" and check_body(msg_type, body) == []
        self.sent.append(dict(body))

    def poll_recv(self, timeout_ms: int) -> Message | None:
        assert timeout_ms == stdin_module.POLL_MS, "short steps, so SIGINT can end the wait"
        self.waiting_seen.append(self.state.waiting)
        item = self.incoming.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


class FakeChannel:
    def flush(self) -> int:
        return 12


def _answer(value: str = "", error: str = "", eof: bool = False) -> Message:
    return Message("answer", {"value": value, "error": error, "eof": eof})


def _stdin(*incoming: Message | BaseException | None, executing: bool = True) -> tuple[RankStdin, FakeSock]:
    state = CellState()
    if executing:
        state.begin("cell-9", "input()")
    sock = FakeSock(state, *incoming)
    stdin = RankStdin(3, sock, FakeChannel(), state, sock.others.append)  # type: ignore[arg-type]
    return stdin, sock


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    out = io.StringIO()
    monkeypatch.setattr(sys, "__stdout__", out)
    return out


def test_input_asks_the_kernel_and_returns_the_answer(log: io.StringIO) -> None:
    stdin, sock = _stdin(None, None, _answer("42"))
    assert stdin.input("How many? ") == "42"
    assert sock.sent == [{"cell_id": "cell-9", "prompt": "How many? ", "password": False, "io_count": 12}]
    assert sock.waiting_seen == ["How many?"] * 3, "the heartbeat shows the prompt while it waits"
    assert stdin.state.waiting == ""
    assert log.getvalue() == "How many? 42\n", "the rank's log shows the exchange"


def test_a_prompt_without_text_is_shown_as_input() -> None:
    stdin, sock = _stdin(_answer("x"))
    stdin.input()
    assert sock.waiting_seen == ["input()"]


def test_getpass_asks_for_a_password_and_keeps_it_out_of_the_log(log: io.StringIO) -> None:
    stdin, sock = _stdin(_answer("hunter2"))
    assert stdin.getpass() == "hunter2"
    assert sock.sent[0]["password"] is True and sock.sent[0]["prompt"] == "Password: "
    assert "hunter2" not in log.getvalue()


def test_other_messages_while_waiting_go_to_the_runner() -> None:
    pull = Message("pull", {"req_id": "p"})
    stdin, sock = _stdin(pull, _answer("ok"))
    assert stdin.input() == "ok"
    assert sock.others == [pull]


def test_no_one_to_answer_raises_at_once_with_the_kernels_reason() -> None:
    stdin, _ = _stdin(_answer(error="input() is not supported under nbclient"))
    with pytest.raises(StdinNotImplementedError, match=r"^input\(\) is not supported under nbclient$"):
        stdin.input()
    assert stdin.state.waiting == ""


def test_end_of_input_raises_eof_error() -> None:
    stdin, _ = _stdin(_answer(eof=True))
    with pytest.raises(EOFError):
        stdin.input()


def test_outside_a_cell_there_is_no_prompt_to_ask_in() -> None:
    stdin, sock = _stdin(executing=False)
    with pytest.raises(StdinNotImplementedError, match=r"input\(\) on rank 3 outside a cell"):
        stdin.input("?")
    assert sock.sent == []


def test_an_interrupt_while_waiting_interrupts_the_cell() -> None:
    stdin, _ = _stdin(None, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        stdin.input("? ")
    assert stdin.state.waiting == "" and stdin.state.stopped_at_prompt is False


def test_an_interrupt_at_a_debugger_prompt_quits_the_debugger() -> None:
    stdin, _ = _stdin(KeyboardInterrupt())
    in_pdb = eval("lambda ask: ask('(Pdb) ')", {"__name__": "pdb"})  # a frame of pdb's on the stack
    with pytest.raises(bdb.BdbQuit):
        in_pdb(stdin.input)
    assert stdin.state.stopped_at_prompt is True, "the runner reports the cell as interrupted"
    assert stdin.state.waiting == ""


def test_install_takes_over_input_getpass_stdin_and_breakpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for obj, name in ((builtins, "input"), (getpass, "getpass"), (sys, "stdin"), (sys, "breakpointhook")):
        monkeypatch.setattr(obj, name, getattr(obj, name))
    stdin, sock = _stdin(_answer("a"), _answer("b"), _answer("c"), _answer(eof=True), _answer("d"))
    stdin.install()
    assert input("1? ") == "a"
    assert getpass.getpass("2? ") == "b"
    assert sys.stdin.readline() == "c\n"
    assert sys.stdin.readline() == "", "end of input reads as an empty string, as from a file"
    assert sys.stdin.read() == "d\n"
    assert sys.stdin.readable() and not sys.stdin.isatty()
    assert [b["password"] for b in sock.sent] == [False, True, False, False, False]
    assert sys.breakpointhook is stdin_module._breakpoint


def test_breakpoint_starts_pdb_in_the_callers_frame_skipping_the_ranks_machinery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[tuple[list[str], types.FrameType]] = []

    class FakePdb:
        def __init__(self, skip: list[str]) -> None:
            self.skip = skip

        def set_trace(self, frame: types.FrameType) -> None:
            started.append((self.skip, frame))

    import pdb

    monkeypatch.setattr(pdb, "Pdb", FakePdb)
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    monkeypatch.setattr(sys, "breakpointhook", stdin_module._breakpoint)
    here = sys._getframe()
    breakpoint()
    ((skip, frame),) = started
    assert skip == list(SKIPPED_MODULES) and frame is here


@pytest.mark.parametrize("setting", ["0", "fake_hooks.hook"])
def test_breakpoint_honours_pythonbreakpoint(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    import pdb

    called: list[tuple[Any, ...]] = []
    module = types.ModuleType("fake_hooks")
    module.hook = lambda *args, **kwargs: called.append((args, kwargs))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_hooks", module)
    monkeypatch.setattr(pdb, "Pdb", None)  # pdb must not start
    monkeypatch.setenv("PYTHONBREAKPOINT", setting)
    monkeypatch.setattr(sys, "breakpointhook", stdin_module._breakpoint)
    breakpoint(1, x=2)
    assert called == ([] if setting == "0" else [((1,), {"x": 2})])
