"""Where the answer to a rank's prompt comes from: the kernel's stdin channel (a stand-in kernel),
a callable, a terminal, or nowhere."""

from __future__ import annotations

import io
from typing import Any

import pytest
import zmq

from jupyter_shard.pool import stdin as stdin_module
from jupyter_shard.pool.stdin import EOF, CallbackStdin, KernelStdin, NoStdin, default_stdin


class _Socket:
    """The kernel's stdin socket: replies queued in ``waiting``."""

    def __init__(self, *waiting: list[bytes]) -> None:
        self.waiting = list(waiting)
        self.drained: list[list[bytes]] = []

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        assert flags == zmq.NOBLOCK
        if not self.waiting:
            raise zmq.Again
        frames = self.waiting.pop(0)
        self.drained.append(frames)
        return frames

    def poll(self, timeout: int, flags: int) -> int:
        return zmq.POLLIN if self.waiting else 0


class _Session:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, str, dict[str, Any], Any, Any]] = []
        self.replies: list[dict[str, Any] | None] = []

    def send(self, sock: Any, msg_type: str, content: dict[str, Any], parent: Any, ident: Any) -> None:
        self.sent.append((sock, msg_type, content, parent, ident))

    def recv(self, sock: _Socket) -> tuple[Any, dict[str, Any] | None]:
        sock.waiting.pop(0)
        return [], self.replies.pop(0)


class _Kernel:
    """The parts of an ipykernel ``Kernel`` that :class:`KernelStdin` uses."""

    _shell_parent_ident = "ident-var"
    _allow_stdin = True

    def __init__(self) -> None:
        self.stdin_socket = _Socket()
        self.session = _Session()

    def _get_shell_context_var(self, var: str) -> list[bytes]:
        assert var == "ident-var"
        return [b"frontend"]

    def get_parent(self, channel: str) -> dict[str, Any]:
        assert channel == "shell"
        return {"header": {"msg_id": "execute-1"}}

    def raw_input(self, prompt: str) -> str:
        return f"raw:{prompt}"


def test_the_kernel_source_drops_stale_replies_then_asks_as_the_running_cell() -> None:
    kernel = _Kernel()
    kernel.stdin_socket.waiting = [[b"stale-1"], [b"stale-2"]]
    source = KernelStdin(kernel)
    source.start("[rank 1] name? ", True)
    assert kernel.stdin_socket.drained == [[b"stale-1"], [b"stale-2"]]
    [(sock, msg_type, content, parent, ident)] = kernel.session.sent
    assert sock is kernel.stdin_socket and msg_type == "input_request"
    assert content == {"prompt": "[rank 1] name? ", "password": True}
    assert parent == {"header": {"msg_id": "execute-1"}} and ident == [b"frontend"]


def test_the_kernel_source_is_polled_without_blocking_and_reads_the_value() -> None:
    kernel = _Kernel()
    source = KernelStdin(kernel)
    assert source.poll() is None  # nothing on the socket yet
    kernel.stdin_socket.waiting = [[b"reply"]]
    kernel.session.replies = [{"content": {"value": "alice"}}]
    assert source.poll() == "alice"


@pytest.mark.parametrize(
    ("reply", "expected"),
    [({"content": {"value": "\x04"}}, EOF), ({"content": {}}, ""), (None, None)],
    ids=["ctrl-d", "no-value", "unreadable"],
)
def test_the_kernel_sources_end_of_input_and_odd_replies(reply: dict[str, Any] | None, expected: Any) -> None:
    kernel = _Kernel()
    kernel.stdin_socket.waiting = [[b"reply"]]
    kernel.session.replies = [reply]
    assert KernelStdin(kernel).poll() == expected


def test_nowhere_to_ask_says_why_and_answers_end_of_input() -> None:
    source = NoStdin("nobody is there")
    assert source.unavailable() == "nobody is there"
    assert source.poll() is EOF
    with pytest.raises(RuntimeError, match="cannot ask for input: nobody is there"):
        source.start("x? ", False)


def test_a_callable_is_asked_once_per_prompt_with_the_prompt() -> None:
    asked: list[str] = []

    def ask(prompt: str) -> str:
        asked.append(prompt)
        return "yes"

    source = CallbackStdin(ask)
    assert source.unavailable() == ""
    source.start("[rank 0] go? ", False)
    assert source.poll() == "yes"
    assert source.poll() is None  # answered: not asked again until the next prompt
    assert asked == ["[rank 0] go? "]


def test_a_kernel_whose_frontend_allows_no_stdin_gives_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _Kernel()
    kernel._allow_stdin = False
    monkeypatch.setattr(stdin_module, "_running_kernel", lambda: kernel)
    source = default_stdin()
    assert isinstance(source, NoStdin) and "does not answer input requests" in source.unavailable()


def test_a_kernel_with_a_stdin_channel_gives_the_input_box(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _Kernel()
    monkeypatch.setattr(stdin_module, "_running_kernel", lambda: kernel)
    source = default_stdin()
    assert isinstance(source, KernelStdin) and source.kernel is kernel


def test_a_kernel_without_ipykernels_internals_is_asked_through_raw_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Plain:
        _allow_stdin = True

        def raw_input(self, prompt: str) -> str:
            return f"raw:{prompt}"

    monkeypatch.setattr(stdin_module, "_running_kernel", lambda: Plain())
    source = default_stdin()
    assert isinstance(source, CallbackStdin)
    source.start("p? ", False)
    assert source.poll() == "raw:p? "


def test_a_script_on_a_terminal_asks_there(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(stdin_module, "_running_kernel", lambda: None)
    monkeypatch.setattr("sys.stdin", Tty())
    monkeypatch.setattr("builtins.input", lambda prompt: f"typed after {prompt}")
    source = default_stdin()
    assert isinstance(source, CallbackStdin)
    source.start("p? ", False)
    assert source.poll() == "typed after p? "


def test_a_script_without_stdin_at_all_cannot_be_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stdin_module, "_running_kernel", lambda: None)
    monkeypatch.setattr("sys.stdin", None)
    source = default_stdin()
    assert isinstance(source, NoStdin) and "Pool(stdin=...)" in source.unavailable()
