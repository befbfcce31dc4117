"""A ``%%distributed`` cell's head start: the ranks get it when the kernel takes the request.

Between taking an ``execute_request`` and calling the cell magic, ipykernel and IPython spend 1.5 to
2 ms of their own (``execute_input``, history, transforming and compiling the cell); ranks idle
since the last cell need about as long to wake up and run a short one. So a cell whose line is one
that already ran on the pool as it is now (no restart since) is sent to the ranks from the kernel's
``execute_request`` handler, and the magic then gathers it instead of sending it
(:mod:`jupyter_shard.pool.headstart`).

Only a cell whose sending is certain goes ahead: IPython's own transform of the cell must be exactly
``run_cell_magic('distributed', line, body)``, the line must name no variables for IPython to expand
and must be one that ran before on the same pool, spec and default line, and the pool must be ready
to run it without a word first. Anything else runs as before, from the magic. A cell sent ahead that the
magic never takes (the kernel was interrupted before it ran) is interrupted on the ranks.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from jupyter_shard.notebook.args import magic_line, rank_code
from jupyter_shard.pool.pool import Pool
from jupyter_shard.spec import LaunchSpec

__all__ = ["HeadStart", "Magics", "Repeat"]

Handler = Callable[[Any, Any, dict[str, Any]], Awaitable[Any]]
_EXPANDED = ("$", "{", "}")  # IPython expands variables in a magic's line where these appear


@dataclass(frozen=True)
class Repeat:
    """A ``%%distributed`` line that ran on a pool without changing it: what a cell with the same
    line sends (its ranks and timeout), and the state under which that holds."""

    line: str
    default_line: str
    pool: Pool
    spec: LaunchSpec
    ranks: tuple[int, ...] | None
    timeout: float | None


class Repeats:
    """The lines run on the pool since it last started or changed, the most recent ``LIMIT``."""

    LIMIT = 16

    def __init__(self) -> None:
        self._by_line: dict[str, Repeat] = {}

    def add(self, repeat: Repeat) -> None:
        self._by_line.pop(repeat.line, None)
        self._by_line[repeat.line] = repeat
        while len(self._by_line) > self.LIMIT:
            del self._by_line[next(iter(self._by_line))]

    def ran(self, repeat: Repeat, pool_kept: bool, background: bool) -> None:
        """After a ``%%distributed`` cell: a cell with its line may go ahead once it ran on the pool
        as it is; a start or restart forgets every line, and a background cell is not repeated."""
        if not pool_kept:
            self.clear()
        elif not background:
            self.add(repeat)

    def get(self, line: str) -> Repeat | None:
        return self._by_line.get(line)

    def clear(self) -> None:
        self._by_line.clear()


def cell_magic_call(shell: Any, code: str) -> tuple[str, str, str] | None:
    """``(magic, line, body)`` as IPython will call a cell magic for ``code``, or None where the
    cell is anything else (or an AST transformer could change the call)."""
    if shell.ast_transformers:
        return None
    try:
        tree = ast.parse(shell.transform_cell(code))
    except Exception:  # IPython says so itself when it runs the cell
        return None
    if len(tree.body) != 1 or not isinstance(stmt := tree.body[0], ast.Expr):
        return None
    call = stmt.value
    if (
        not isinstance(call, ast.Call)
        or call.keywords
        or not isinstance(call.func, ast.Attribute)
        or call.func.attr != "run_cell_magic"
        or not isinstance(owner := call.func.value, ast.Call)
        or not isinstance(owner.func, ast.Name)
        or owner.func.id != "get_ipython"
        or len(call.args) != 3
    ):
        return None
    args = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return (args[0], args[1], args[2]) if len(args) == 3 else None


def transform_state(shell: Any) -> tuple[object, ...]:
    """What IPython's transform of a cell depends on besides its text: the transformers, the
    prefilter's parts and the automagic and autocall settings."""
    static, prefilter = shell.input_transformer_manager, shell.prefilter_manager
    return (
        *static.cleanup_transforms,
        *static.line_transforms,
        *static.token_transformers,
        *shell.input_transformers_post,
        *prefilter.transformers,
        *prefilter.checkers,
        shell.automagic,
        shell.autocall,
    )


class Magics(Protocol):
    """What the head start reads of the magics (``DistributedMagics``; named here, not imported: the
    magics import this module)."""

    @property
    def shell(self) -> Any: ...

    @property
    def pool(self) -> Pool | None: ...

    @property
    def default_line(self) -> str: ...

    @property
    def repeats(self) -> Repeats: ...


class HeadStart:
    """Wraps the kernel's ``execute_request`` handler to send repeated ``%%distributed`` cells ahead.

    The last cell's call is kept with what the transform depended on: a cell run again (the usual
    way of a notebook) is not transformed twice, which costs about 0.4 ms of the head start.
    """

    PREFIX = "%%distributed"

    def __init__(self, kernel: Any, magics: Magics) -> None:
        self.kernel = kernel
        self.magics = magics
        self._original: Handler | None = None
        self.active = False
        self._last: tuple[tuple[object, ...], tuple[str, str, str] | None] | None = None
        self._sending_to: Pool | None = None  # the pool a cell may have gone ahead to, until it ended

    def install(self) -> None:
        handlers = getattr(self.kernel, "shell_handlers", None)
        if not isinstance(handlers, dict) or "execute_request" not in handlers:
            return
        if self._original is None:  # else still in another wrapper's chain: in use again
            self._original = handlers["execute_request"]
            handlers["execute_request"] = self.execute_request
        self.active = True

    def uninstall(self) -> None:
        """Put the kernel's handler back; where another wrapper came after this one, this one stays
        in its chain and passes every request on untouched."""
        self.active = False
        handlers = self.kernel.shell_handlers
        if self._original is not None and handlers.get("execute_request") == self.execute_request:
            handlers["execute_request"], self._original = self._original, None

    async def execute_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> Any:
        assert self._original is not None  # set while this handler is anywhere in the chain
        if not self.active:
            return await self._original(stream, ident, parent)
        try:
            self._send(parent)
            return await self._original(stream, ident, parent)
        finally:  # an interrupt may come at any point, the send included
            pool, self._sending_to = self._sending_to, None
            if pool is not None:
                pool.settle_ahead()  # taken by the magic in the normal course: then nothing to do

    def _call(self, shell: Any, code: str) -> tuple[str, str, str] | None:
        """:func:`cell_magic_call`, kept for the last cell's text under the same transform."""
        key = (code, *transform_state(shell))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        call = cell_magic_call(shell, code)
        self._last = (key, call)
        return call

    def _owns_magic(self, shell: Any) -> bool:
        """Whether IPython's ``%%distributed`` is still this extension's."""
        return (
            getattr(shell.magics_manager.magics["cell"].get("distributed"), "__self__", None) is self.magics
        )

    def _send(self, parent: dict[str, Any]) -> None:
        """Send the request's cell to the ranks if it may go ahead."""
        try:
            content = parent.get("content") or {}
            code = content.get("code")
            if not isinstance(code, str) or not code.startswith(self.PREFIX):
                return
            if content.get("silent", False) or not content.get("store_history", True):
                return  # the cell's number would differ; rare enough to run as before
            shell = self.magics.shell
            if shell is None:
                return
            call = self._call(shell, code)
            if (
                call is None
                or call[0] != "distributed"
                or call[2] == ""
                or any(c in call[1] for c in _EXPANDED)
            ):
                return
            repeat = self.magics.repeats.get(call[1])
            if repeat is None or self.magics.pool is not repeat.pool or repeat.pool.spec is not repeat.spec:
                return
            if self.magics.default_line != repeat.default_line or not self._owns_magic(shell):
                return
            code = rank_code(magic_line("distributed", repeat.line), call[2])  # as the magic makes it
            self._sending_to = repeat.pool
            repeat.pool.send_ahead(code, repeat.ranks, repeat.timeout, shell.execution_count)
        except Exception as exc:  # the cell then runs as before, from the magic
            print(f"jupyter_shard: could not send the cell ahead: {exc!r}", file=sys.__stderr__)
