"""Where the answer to a rank's prompt comes from: the notebook's input box, a script's terminal, a
callable given to ``Pool(stdin=...)``, or nowhere (then the rank is told why at once).

A source is asked without blocking (:meth:`StdinSource.start`, then :meth:`StdinSource.poll` each
step of the cell), so that while a person types, the other ranks' output still streams, a rank that
dies is noticed, and ``--timeout`` and the stop button still end the cell.

:class:`KernelStdin` speaks Jupyter's stdin channel for the ipykernel it runs in: an
``input_request`` with the running cell's execute request as parent, the ``input_reply`` read when it
comes (what ipykernel's own ``raw_input`` does, split into asking and polling). A frontend that does
not allow stdin (nbclient, nbval, ``allow_stdin=False``) gives :class:`NoStdin`.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = ["EOF", "CallbackStdin", "KernelStdin", "NoStdin", "StdinSource", "default_stdin"]


class _EndOfInput:
    def __repr__(self) -> str:
        return "EOF"


EOF = _EndOfInput()  # the person sent end-of-input (Ctrl-D in a terminal)
Answer = str | _EndOfInput


class StdinSource(ABC):
    """One way of asking a person for a line."""

    def unavailable(self) -> str:
        """Why no one can be asked (a clause: "this frontend does not …"), or "" when someone can."""
        return ""

    @abstractmethod
    def start(self, prompt: str, password: bool) -> None:
        """Show the prompt."""

    @abstractmethod
    def poll(self) -> Answer | None:
        """The answer once given, else None."""


class NoStdin(StdinSource):
    def __init__(self, why: str) -> None:
        self.why = why

    def unavailable(self) -> str:
        return self.why

    def start(self, prompt: str, password: bool) -> None:
        raise RuntimeError(f"cannot ask for input: {self.why}")

    def poll(self) -> Answer | None:
        return EOF


class CallbackStdin(StdinSource):
    """A blocking callable ``(prompt) -> str`` (``input``, or ``Pool(stdin=...)``); ``EOFError`` from
    it is end-of-input."""

    def __init__(self, ask: Callable[[str], str]) -> None:
        self._ask = ask
        self._prompt: str | None = None

    def start(self, prompt: str, password: bool) -> None:
        self._prompt = prompt

    def poll(self) -> Answer | None:
        prompt, self._prompt = self._prompt, None
        if prompt is None:
            return None
        try:
            return str(self._ask(prompt))
        except EOFError:
            return EOF


class KernelStdin(StdinSource):
    """The notebook's input box, through the stdin channel of the ipykernel this process runs."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def start(self, prompt: str, password: bool) -> None:
        import zmq

        kernel = self.kernel
        sock = kernel.stdin_socket
        while True:  # stale replies (an answer to a prompt of a cell that was stopped)
            try:
                sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        ident = kernel._get_shell_context_var(kernel._shell_parent_ident)
        parent = kernel.get_parent("shell")
        content = {"prompt": prompt, "password": password}
        kernel.session.send(sock, "input_request", content, parent, ident=ident)

    def poll(self) -> Answer | None:
        import zmq

        sock = self.kernel.stdin_socket
        if not sock.poll(0, zmq.POLLIN):
            return None
        _, reply = self.kernel.session.recv(sock)
        if reply is None:
            return None
        value = str(reply.get("content", {}).get("value", ""))
        return EOF if value == "\x04" else value


_NO_FRONTEND = "this frontend does not answer input requests (nbclient, nbval, or allow_stdin=False)"


def default_stdin() -> StdinSource:
    """The notebook's input box when this runs in a cell of a kernel whose frontend allows stdin,
    else a script's terminal, else nowhere."""
    kernel = _running_kernel()
    if kernel is not None:
        usable = all(
            hasattr(kernel, a)
            for a in ("stdin_socket", "session", "_get_shell_context_var", "_shell_parent_ident")
        )
        if not getattr(kernel, "_allow_stdin", False):
            return NoStdin(_NO_FRONTEND)
        return KernelStdin(kernel) if usable else CallbackStdin(kernel.raw_input)
    stdin = sys.stdin
    if stdin is not None and stdin.isatty():
        return CallbackStdin(input)
    return NoStdin("this script has no terminal to ask in (pass Pool(stdin=...) to answer from code)")


def _running_kernel() -> Any:
    shell = sys.modules.get("IPython")
    if shell is None:
        return None
    from IPython import get_ipython

    ip = get_ipython()
    return getattr(ip, "kernel", None)
