"""JupyterLab's visual debugger on a rank: breakpoints set in the notebook stop the rank's cell, and
the debugger's requests (stack, scopes, variables, evaluate, continue, next, step) act on it.

The rank does not run a debug server of its own: nothing listens. When the notebook's debugger is on,
the kernel sends each cell with a :class:`~jupyter_shard.wire.messages.DebugSetup`: the file name the
kernel's debugger gave the cell (the rank compiles the cell under it, so a breakpoint set in the
cell's gutter names the rank's code too) and every breakpoint. A :class:`bdb.Bdb` traces the cell;
frames of files without a breakpoint are not traced line by line. At a breakpoint the rank sends a
``stopped`` event and answers Debug Adapter Protocol requests that come, signed, on its own socket,
until one resumes it. Ids (thread, frame, variable reference) are the rank's own; the kernel maps
them into its debugger's id space. SIGINT (the stop button, ``--timeout``) ends a stopped cell.
"""

from __future__ import annotations

import bdb
import linecache
import sys
import sysconfig
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

from jupyter_shard.wire.messages import DEBUG_EVENT, DEBUG_RESPONSE, DebugSetup
from jupyter_shard.wire.protocol import Message

if TYPE_CHECKING:
    from jupyter_shard.rank.channel import ShellSocket

__all__ = ["THREAD_ID", "RankTracer"]

THREAD_ID = 1  # the rank's main thread, the one that runs cells
POLL_MS = 100
_HIDDEN = ("IPython.", "jupyter_shard.", "traitlets.", "bdb", "asyncio.")
_RESUMING = {"continue", "next", "stepIn", "stepOut"}


_LIBRARIES = tuple(
    {sys.prefix, sys.base_prefix, sys.exec_prefix, *(sysconfig.get_paths()[k] for k in ("stdlib", "purelib"))}
)


def _user_frame(frame: FrameType) -> bool:
    """A frame of the person's code: a cell (the rank's ``__main__``) or a file outside Python's own
    library and installed packages (as "just my code" in other debuggers)."""
    name = str(frame.f_globals.get("__name__", ""))
    if name == "__main__":
        return True
    if any(name == h.rstrip(".") or name.startswith(h) for h in _HIDDEN):
        return False
    path = frame.f_code.co_filename
    return not (path.startswith(_LIBRARIES) or path.startswith("<frozen"))


class RankTracer(bdb.Bdb):
    """Runs one cell with the notebook's breakpoints and serves the debugger while it is stopped."""

    def __init__(self, rank: int, sock: ShellSocket, on_other: Callable[[Message], None]) -> None:
        super().__init__(skip=["IPython.*", "jupyter_shard.*", "traitlets.*"])
        self.rank = rank
        self.sock = sock
        self.on_other = on_other  # a message other than a debug request, while stopped
        self._refs: dict[int, Any] = {}
        self._frames: dict[int, FrameType] = {}

    # -- running the cell ---------------------------------------------------------------------------

    def arm(self, setup: DebugSetup, code: str) -> bool:
        """Set the breakpoints (the cell's own file primed with ``code``); True when there are any."""
        filename = setup["filename"]
        lines = code.splitlines(keepends=True)
        linecache.cache[filename] = (len(code), None, lines, filename)
        self.clear_all_breaks()
        for path, numbers in setup["breakpoints"].items():
            for line in numbers:
                self.set_break(path, int(line))  # a line with no code is refused by bdb: skipped
        return bool(self.breaks)

    def start(self) -> None:
        """Trace from here on, stopping only at breakpoints (the caller runs the cell, then :meth:`stop`)."""
        self.reset()
        self.botframe = sys._getframe(1)
        self._set_stopinfo(self.botframe, None, -1)  # type: ignore[attr-defined]  # bdb's set_continue
        sys.settrace(self.trace_dispatch)

    def stop(self) -> None:
        sys.settrace(None)
        self.clear_all_breaks()

    # -- bdb's hooks ------------------------------------------------------------------------------------

    def user_line(self, frame: FrameType) -> None:
        if not _user_frame(frame):
            self.set_step()  # stepped out into the shell: go on to the next line of the cell
            return
        reason = (
            "breakpoint"
            if self.get_breaks(self.canonic(frame.f_code.co_filename), frame.f_lineno)
            else "step"
        )
        self._interaction(frame, reason)

    def _interaction(self, frame: FrameType, reason: str) -> None:
        self._refs.clear()
        self._frames = {}
        stack = []
        current: FrameType | None = frame
        while current is not None and _user_frame(current):
            stack.append(current)
            current = current.f_back
        for number, f in enumerate(stack, start=1):
            self._frames[number] = f
        self._event("stopped", {"reason": reason, "threadId": THREAD_ID, "allThreadsStopped": False})
        while True:
            msg = self.sock.poll_recv(POLL_MS)
            if msg is None:
                continue
            if msg.type != "debug_request":
                self.on_other(msg)
                continue
            command = str(msg.body["command"])
            try:
                body = self.answer(command, dict(msg.body["arguments"]), frame)
                self._respond(int(msg.body["seq"]), True, "", body)
            except Exception as exc:
                self._respond(int(msg.body["seq"]), False, f"{type(exc).__name__}: {exc}", {})
                continue
            if command in _RESUMING:
                self._event("continued", {"threadId": THREAD_ID, "allThreadsContinued": False})
                return

    # -- requests ---------------------------------------------------------------------------------------

    def answer(self, command: str, args: Mapping[str, Any], frame: FrameType) -> dict[str, Any]:
        """The body of the response to ``command`` (a resuming command also resumes)."""
        if command == "threads":
            return {"threads": [{"id": THREAD_ID, "name": "MainThread"}]}
        if command == "stackTrace":
            frames = [
                {
                    "id": number,
                    "name": f.f_code.co_name,
                    "line": f.f_lineno,
                    "column": 1,
                    "source": {"path": f.f_code.co_filename},
                }
                for number, f in sorted(self._frames.items())
            ]
            return {"stackFrames": frames, "totalFrames": len(frames)}
        if command == "scopes":
            f = self._frames[int(args["frameId"])]
            return {
                "scopes": [
                    {"name": "Locals", "variablesReference": self._ref(f.f_locals), "expensive": False},
                    {"name": "Globals", "variablesReference": self._ref(f.f_globals), "expensive": True},
                ]
            }
        if command == "variables":
            return {"variables": self._children(self._refs[int(args["variablesReference"])])}
        if command == "evaluate":
            f = self._frames.get(int(args.get("frameId", 1)), frame)
            value = eval(str(args["expression"]), f.f_globals, f.f_locals)  # the person's own expression
            described = self._described("", value)
            described["result"] = described.pop("value")
            return described
        if command == "richInspectVariables":
            f = self._frames.get(int(args.get("frameId", 1)), frame)
            value = eval(str(args["variableName"]), f.f_globals, f.f_locals)
            return {"data": {"text/plain": repr(value)}, "metadata": {}}
        if command == "setBreakpoints":
            path = str(args["source"]["path"])
            self.clear_all_file_breaks(path)
            lines = [int(b["line"]) for b in args.get("breakpoints", [])]
            for line in lines:
                self.set_break(path, line)
            return {"breakpoints": [{"verified": True, "line": line} for line in lines]}
        if command == "continue":
            self.set_continue()
            return {"allThreadsContinued": False}
        if command == "next":
            self.set_next(frame)
            return {}
        if command == "stepIn":
            self.set_step()
            return {}
        if command == "stepOut":
            self.set_return(frame)
            return {}
        raise ValueError(f"{command!r} is not supported on a rank")

    def _ref(self, value: Any) -> int:
        number = len(self._refs) + 1
        self._refs[number] = value
        return number

    def _ref_of(self, value: Any) -> int:
        """A reference for a value with children (a container, an object with attributes), else 0."""
        if (isinstance(value, dict | list | tuple) and value) or (hasattr(value, "__dict__") and vars(value)):
            return self._ref(value)
        return 0

    def _children(self, value: Any) -> list[dict[str, Any]]:
        if isinstance(value, dict):
            namespace = "__builtins__" in value  # a module's globals: leave out IPython's own names
            hidden = _shell_names() if namespace else set()
            items = [
                (str(k), v)
                for k, v in value.items()
                if not (namespace and (str(k).startswith("_") or k in hidden))
            ]
        elif isinstance(value, list | tuple):
            items = [(str(i), v) for i, v in enumerate(value)]
        else:
            items = [(k, v) for k, v in vars(value).items() if not k.startswith("__")]
        return [self._described(name, v) for name, v in items[:300]]

    def _described(self, name: str, value: Any) -> dict[str, Any]:
        """A DAP variable: its repr (cut), type, and a reference when it has children."""
        return {
            "name": name,
            "value": _short(value),
            "type": type(value).__name__,
            "variablesReference": self._ref_of(value),
        }

    def _event(self, event: str, body: dict[str, Any]) -> None:
        self.sock.send(*DEBUG_EVENT({"event": event, "body": body}))

    def _respond(self, seq: int, success: bool, message: str, body: dict[str, Any]) -> None:
        self.sock.send(*DEBUG_RESPONSE({"seq": seq, "success": success, "message": message, "body": body}))


def _shell_names() -> set[str]:
    """What IPython puts in a rank's namespace (``In``, ``Out``, ``get_ipython``…), not shown."""
    from IPython import get_ipython

    shell = get_ipython()
    return set(getattr(shell, "user_ns_hidden", {}))


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<repr failed: {type(exc).__name__}>"
    return text if len(text) <= 500 else text[:500] + "…"
