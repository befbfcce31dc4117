"""A rank's stdin is the notebook's input box: ``input()``, ``getpass()``, ``sys.stdin.readline()``
and pdb's prompt (``breakpoint()``, ``pdb.set_trace()``, a post-mortem) ask the kernel, which asks
the person through Jupyter's stdin channel with the rank named in the prompt.

The main thread sends an ``prompt`` on its own socket and waits there for the ``answer``;
the request carries ``io_count`` (as ``done`` does), so the kernel shows the output written before the
prompt first. While it waits, the heartbeat says so (``waiting``): the kernel shows the rank as at a
prompt, not stuck. The wait polls in short steps, so SIGINT (an interrupt, a ``--timeout``, the stop
button) ends it as it ends any Python code. Where no one can answer (nbclient, nbval, a script with
no terminal), the kernel replies with why, and the call raises
:class:`~IPython.core.error.StdinNotImplementedError` with that text at once: a cell never hangs on a
prompt no one sees.
"""

from __future__ import annotations

import bdb
import builtins
import getpass
import io
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from IPython.core.error import StdinNotImplementedError

from jupyter_shard.wire.messages import PROMPT
from jupyter_shard.wire.protocol import Message

if TYPE_CHECKING:
    from jupyter_shard.rank.channel import Channel, ShellSocket
    from jupyter_shard.rank.runner import CellState

__all__ = ["RankStdin"]

POLL_MS = 100


class RankStdin:
    """Asks the kernel for a line on behalf of this rank's main thread."""

    def __init__(
        self,
        rank: int,
        sock: ShellSocket,
        channel: Channel,
        state: CellState,
        on_other: Callable[[Message], None],
    ) -> None:
        self.rank = rank
        self.sock = sock
        self.channel = channel
        self.state = state
        self.on_other = on_other  # a message other than the reply that came while waiting

    def install(self) -> None:
        """Take over ``input``, ``getpass.getpass``, ``sys.stdin`` and ``breakpoint()`` for this process."""
        builtins.input = self.input
        getpass.getpass = self.getpass
        sys.stdin = _StdinReader(self)
        sys.breakpointhook = _breakpoint

    def input(self, prompt: object = "") -> str:
        return self.ask(str(prompt), password=False)

    def getpass(self, prompt: str = "Password: ", stream: Any = None) -> str:
        return self.ask(prompt, password=True)

    def ask(self, prompt: str, password: bool) -> str:
        """One line from the person at the notebook; raises ``EOFError`` when they send end-of-input."""
        if not self.state.executing:
            raise StdinNotImplementedError(
                f"input() on rank {self.rank} outside a cell: there is no notebook prompt to ask in"
            )
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.state.waiting = prompt.strip() or "input()"
        try:
            self.sock.send(
                *PROMPT(
                    {
                        "cell_id": self.state.cell_id,
                        "prompt": prompt,
                        "password": password,
                        "io_count": self.channel.flush(),
                    }
                )
            )
            try:
                reply = self._await_reply()
            except KeyboardInterrupt:
                if _in_debugger():  # pdb takes KeyboardInterrupt as "stop here" and prompts again
                    self.state.stopped_at_prompt = True
                    raise bdb.BdbQuit from None
                raise
        finally:
            self.state.waiting = ""
        if reply.body["error"]:
            raise StdinNotImplementedError(str(reply.body["error"]))
        if reply.body["eof"]:
            raise EOFError
        value = str(reply.body["value"])
        print(prompt + ("" if password else value), file=sys.__stdout__, flush=True)  # the rank's log
        return value

    def _await_reply(self) -> Message:
        while True:
            msg = self.sock.poll_recv(POLL_MS)
            if msg is None:
                continue
            if msg.type == "answer":
                return msg
            self.on_other(msg)


_DEBUGGERS = ("bdb", "pdb", "cmd", "IPython.core.debugger")
# Not stopped in while stepping: the shell and the rank loop around the cell's code. IPython runs a
# cell's top-level statements one by one, so ``n`` at the end of one goes on to the next statement
# rather than into IPython's ``run_code``.
SKIPPED_MODULES = ("IPython.*", "jupyter_shard.*", "traitlets.*")


def _breakpoint(*args: Any, **kwargs: Any) -> Any:
    """``breakpoint()`` on a rank: pdb, stepping over the rank's own machinery. ``PYTHONBREAKPOINT``
    is honoured as Python honours it (``0`` turns ``breakpoint()`` off, a name picks another hook)."""
    if os.environ.get("PYTHONBREAKPOINT", "") not in ("", "pdb.set_trace"):
        return sys.__breakpointhook__(*args, **kwargs)
    import pdb

    pdb.Pdb(skip=list(SKIPPED_MODULES)).set_trace(sys._getframe(1))
    return None


def _in_debugger() -> bool:
    """Whether this prompt is a debugger's (a ``bdb``/``cmd`` frame is on the stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") in _DEBUGGERS:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _StdinReader(io.TextIOBase):
    """``sys.stdin`` on a rank: each ``readline()`` is one prompt in the notebook."""

    def __init__(self, stdin: RankStdin) -> None:
        self._stdin = stdin

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:  # a rank must not look like an interactive session to libraries
        return False

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        try:
            return self._stdin.ask("", password=False) + "\n"
        except EOFError:
            return ""

    def read(self, size: int | None = -1) -> str:
        return self.readline()
