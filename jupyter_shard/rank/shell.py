"""The IPython shell a rank runs cells in: magics, ``!cmd``, ``display()`` and last-expression
results as in a notebook, with results, displays and tracebacks sent to the kernel."""

from __future__ import annotations

import ast
import contextlib
import keyword
import os
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from types import CodeType, TracebackType
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.inputtransformer2 import TransformerManager
from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell
from traitlets.config import Config

from jupyter_shard.rank.channel import Channel
from jupyter_shard.wire.messages import DISPLAY, RESULT, DisplayBody


class _RankDisplayHook(DisplayHook):
    """Send the last expression's value as a ``result`` message instead of printing it."""

    def write_output_prompt(self) -> None:
        pass

    def compute_format_data(self, result: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        shell = self.shell
        assert isinstance(shell, RankShell)
        shell.last_value = (result,)  # what the kernel copies for the cell's Out[n]
        format_dict, md_dict = super().compute_format_data(result)  # type: ignore[no-untyped-call]
        return format_dict, md_dict

    def write_format_data(self, format_dict: dict[str, Any], md_dict: dict[str, Any] | None = None) -> None:
        shell = self.shell
        assert isinstance(shell, RankShell)
        shell.channel.send(
            *RESULT({"cell_id": shell.cell_id, "data": format_dict, "metadata": md_dict or {}})
        )

    def finish_displayhook(self) -> None:
        pass


class _RankDisplayPublisher(DisplayPublisher):
    def publish(
        self,
        data: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        source: object = None,
        *,
        transient: dict[str, Any] | None = None,
        update: bool = False,
        **kwargs: Any,
    ) -> None:
        shell = self.shell
        assert isinstance(shell, RankShell)
        body: DisplayBody = {
            "cell_id": shell.cell_id,
            "data": data,
            "metadata": metadata or {},
            "transient": transient or {},
            "update": update,
        }
        shell.channel.send(*DISPLAY(body))

    def clear_output(self, wait: bool = False) -> None:
        pass


_DEFAULT_TRANSFORMS = TransformerManager()
_SPECIAL_CHARS = frozenset("%!?")
_SPECIAL_STARTS = (",", ";", "/", ">>>", "...", "In [")


_KEYWORDS = frozenset(keyword.kwlist)
_HEADLESS_BACKENDS = ("agg", "cairo", "pdf", "pgf", "ps", "svg", "template")


def _keyword_line(line: str) -> bool:
    """A single line whose first word is a Python keyword: IPython's prefilter leaves it unchanged.

    Its checkers act on the first word as a name (a macro, an autocall object or a magic when not
    shadowed, and keywords always are), and the Emacs checker on a trailing ``# PYTHON-MODE``.
    """
    word = line.split(None, 1)[0] if line.strip() else ""
    word = word.split("(", 1)[0].split(":", 1)[0].split(".", 1)[0]
    return word in _KEYWORDS and "#" not in line


def _plain_python(cell: str) -> bool:
    """True when IPython's static input transforms would return the cell unchanged.

    Those transforms act only on magics (``%``), shell escapes (``!``), help (``?``), escaped
    autocalls (``,`` ``;`` ``/`` at a line start), pasted prompts (``>>>``, ``...``, ``In [n]:``),
    and leading blank lines or indentation; a cell with none of them is plain Python.
    """
    if not cell or cell[0].isspace():
        return False
    if _SPECIAL_CHARS.isdisjoint(cell):
        return not any(line.lstrip().startswith(_SPECIAL_STARTS) for line in cell.splitlines())
    return all(_plain_line(line.lstrip()) for line in cell.splitlines())


def _plain_line(line: str) -> bool:
    """A line (stripped on the left) that no static transform acts on. A line starting with ``#``
    is one whatever follows (a comment, or text in a string), so the ``# %%distributed ...`` line
    the magic puts first keeps its cell plain; other transforms key on a line's start or on tokens,
    which a comment is only one of."""
    return line.startswith("#") or (_SPECIAL_CHARS.isdisjoint(line) and not line.startswith(_SPECIAL_STARTS))


_POOL_FILES = tuple(
    os.path.join(os.path.dirname(__file__), name) for name in ("runner.py", "runtime.py", "channel.py")
)


def _pool_frame(block: str) -> bool:
    """A traceback block of the rank's own machinery (the SIGINT handler that raises the user's
    ``KeyboardInterrupt``, the cell loop): not the user's code, so not shown."""
    first = block.lstrip().split("\n", 1)[0]
    return first.startswith("File ") and any(f"File {path}:" in first for path in _POOL_FILES)


@dataclass(frozen=True)
class _Compiled:
    """A plain cell as :meth:`RankShell._run_plain` compiled it, for the same cell run again."""

    cell: str  # transformed
    codes: tuple[CodeType, ...]  # compiled under the name of the run that compiled them
    flags: int  # the compiler's flags afterwards (a ``__future__`` import adds its own)


COMPILED_CELLS = 32  # plain cells whose compiled code a rank keeps, the most recently run


def _renamed(code: CodeType, name: str) -> CodeType:
    """``code`` and the code objects in it (functions, classes, comprehensions) under file ``name``."""
    consts = tuple(_renamed(c, name) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=name, co_consts=consts)


def _drive(coroutine: Any) -> Any:
    """Run a coroutine that never awaits (IPython's ``run_code`` without top-level ``await``)."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a plain-Python cell awaited")


class RankShell(InteractiveShell):
    """One per rank process; ``channel`` and ``cell_id`` are set by the runtime."""

    displayhook_class = _RankDisplayHook
    display_pub_class = _RankDisplayPublisher

    channel: Channel
    rank: int = 0  # this process's rank
    cell_id: str = ""
    last_error: tuple[str, str, list[str]] | None = None
    last_value: tuple[Any] | None = None  # (the last cell's value,), None when it ended in a statement
    kept_error: BaseException | None = None  # the last failed cell's exception, for a post-mortem
    _inline_said: set[str] = set()  # noqa: RUF012 (one shell per rank process)
    _default_checkers: list[str] = []  # noqa: RUF012 (set once by create)
    _compiled: dict[tuple[object, ...], _Compiled]  # set by create

    @classmethod
    def create(cls, channel: Channel, user_ns: dict[str, Any]) -> RankShell:
        config = Config()
        config.HistoryManager.enabled = False
        config.InteractiveShell.colors = "nocolor"
        config.InteractiveShell.xmode = "Context"
        shell = cls.instance(config=config, user_ns=user_ns)
        shell.channel = channel
        assert shell.prefilter_manager is not None
        shell._default_checkers = [type(c).__name__ for c in shell.prefilter_manager.checkers]
        shell._compiled = {}
        return shell

    def init_prompts(self) -> None:
        """No ``sys.ps1``: a rank is not an interactive interpreter, and libraries check for one.

        IPython sets the prompts "so that scripts can decide if they are running interactively";
        Lightning, for one, then refuses ``strategy="ddp"`` and asks for ``ddp_notebook`` (a fork).
        """

    def enable_matplotlib(self, gui: str | None = None) -> tuple[str, str]:
        """``%matplotlib`` on a rank: figures go to the notebook as images (the inline backend), and
        the headless backends (``agg``, ``pdf``, ``svg``…) are taken as asked. A rank has no window
        system and no comm to the frontend of its own, so a GUI toolkit (``qt``, ``tk``…) or an
        interactive notebook backend (``widget``, ``notebook``) is shown inline, said once."""
        asked = (gui or "").lower()
        if asked not in ("", "inline", *_HEADLESS_BACKENDS):
            if asked not in self._inline_said:
                self._inline_said.add(asked)
                print(
                    f"%matplotlib {gui}: figures from a rank are shown as images (inline); an "
                    "interactive or windowed figure needs the notebook kernel itself",
                    file=sys.stderr,
                )
            gui = "inline"
        elif not asked:
            gui = "inline"
        shown: tuple[str, str] = super().enable_matplotlib(gui)  # type: ignore[no-untyped-call]
        return shown

    def enable_gui(self, gui: str | None = None) -> None:
        """No event loop to integrate: :meth:`enable_matplotlib` asks only for backends without one."""

    @contextlib.contextmanager
    def _tee(self, channel: str) -> Iterator[None]:
        """Keep no copy of what a cell prints.

        IPython 9 wraps ``sys.stdout.write``/``sys.stderr.write`` during ``run_cell`` and appends
        every write to ``history_manager.outputs``, history enabled or not. A rank's output already
        goes to its log and the kernel; the copy grew by about 155 MB per million printed lines and
        was never freed.
        """
        yield

    def transform_cell(self, raw_cell: str) -> str:
        """IPython's transform, skipping the tokenizer pass for plain Python (a third of a no-op cell)."""
        if not _plain_python(raw_cell) or self._transforms_customised():
            return str(super().transform_cell(raw_cell))  # type: ignore[no-untyped-call]
        # IPython's leading_indent step also blanks whitespace-only lines (textwrap.dedent does that).
        cell = textwrap.dedent(raw_cell if raw_cell.endswith("\n") else raw_cell + "\n")
        if len(cell.splitlines()) == 1:
            manager = self.prefilter_manager
            assert manager is not None
            if _keyword_line(cell) and not manager.transformers and self._checkers_default():
                self._last_input_line = cell.rstrip("\n")  # as prefilter_line records it
            else:
                with self.builtin_trap:
                    cell = manager.prefilter_lines(cell) + "\n"
        lines = cell.splitlines(keepends=True)
        for transform in self.input_transformers_post:
            lines = transform(lines)
        return "".join(lines)

    def _checkers_default(self) -> bool:
        checkers = self.prefilter_manager.checkers  # type: ignore[union-attr]
        return [type(c).__name__ for c in checkers] == self._default_checkers

    def _transforms_customised(self) -> bool:
        manager = self.input_transformer_manager
        return bool(
            manager.cleanup_transforms != _DEFAULT_TRANSFORMS.cleanup_transforms
            or manager.line_transforms != _DEFAULT_TRANSFORMS.line_transforms
            or manager.token_transformers != _DEFAULT_TRANSFORMS.token_transformers
        )

    def should_run_async(
        self, raw_cell: str, *, transformed_cell: str | None = None, preprocessing_exc_tuple: Any = None
    ) -> bool:
        """Top-level ``await`` needs the word ``await`` or ``async``; skip the trial compile without it."""
        code = transformed_cell if transformed_cell is not None else raw_cell
        if "await" not in code and "async" not in code:
            return False
        return bool(
            super().should_run_async(
                raw_cell, transformed_cell=transformed_cell, preprocessing_exc_tuple=preprocessing_exc_tuple
            )
        )

    def _plain_ok(self, code: str) -> bool:
        """Whether :meth:`_run_plain` gives what ``run_cell`` would for this cell."""
        return (
            _plain_python(code)
            and "await" not in code
            and "async" not in code
            and not self.ast_transformers
            and not self.trio_runner
            and not self.logger.log_active
            and self.ast_node_interactivity == "last_expr"
            and not self._transforms_customised()
        )

    def _run_plain(self, raw_cell: str, cell_id: str, exec_count: int = 0) -> ExecutionResult | None:
        """``run_cell`` for plain Python (no magics, no top-level ``await``), with IPython's pieces.

        The same transform, history (``In``, ``_i``), events, ``__future__`` flags, builtins
        (``get_ipython``), display hook for a last expression (``Out``, ``_``), source kept for
        tracebacks and error handling (:meth:`run_code`), without the general path's per-cell
        machinery, which was half of a rank's CPU in a no-op cell. Statements before a last
        expression are compiled together, so the whole cell is compiled before any of it runs; a
        cell that fails to compile returns None and goes through ``run_cell`` for IPython's report.
        A cell run again (the same text, under the same compiler flags) runs the code compiled the
        first time, under this run's name (:meth:`_compiled_key` says which cells are kept).
        """
        compiler = self.compile
        count = exec_count if exec_count > 0 else self.execution_count
        key = self._compiled_key(raw_cell)
        compiled = self._compiled.pop(key, None) if key is not None else None
        if compiled is not None:  # run before: its code under this run's name
            cell = compiled.cell
            name = compiler.cache(cell, count, raw_code=raw_cell)
            codes = [_renamed(code, name) for code in compiled.codes]
            compiler.flags = compiled.flags
        else:
            try:
                cell = self.transform_cell(raw_cell)
            except Exception:  # run_cell shows a failed transform as the cell's error
                return None
            name = compiler.cache(cell, count, raw_code=raw_cell)
            try:
                codes = self._compile_plain(cell, name)
            except Exception:  # SyntaxError and the rest: IPython reports them its own way
                return None
            compiled = _Compiled(cell, tuple(codes), compiler.flags)
        if key is not None:  # the most recently run last: the oldest is dropped first
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILED_CELLS:
                del self._compiled[next(iter(self._compiled))]
        info = ExecutionInfo(raw_cell, True, False, True, cell_id, None, transformed_cell=cell)
        result = ExecutionResult(info)
        result.execution_count = count
        self.execution_count = count + 1
        events = self.events
        events.trigger("pre_execute")
        events.trigger("pre_run_cell", info)
        try:
            assert self.history_manager is not None
            if not ("run_line_magic(" in cell and "paste" in cell):  # as run_cell: no %paste
                self.history_manager.store_inputs(count, cell, raw_cell)
            raised = False
            with self.builtin_trap, self.display_trap:
                self.displayhook.exec_result = result
                try:
                    for code in codes:
                        if _drive(self.run_code(code, result)):  # type: ignore[no-untyped-call]
                            raised = True
                            break
                finally:
                    self.displayhook.exec_result = None
            self.last_execution_succeeded = not raised
            self.last_execution_result = result
            if result.error_in_exec is not None:
                self.history_manager.exceptions[count] = self._format_exception_for_storage(  # type: ignore[no-untyped-call]
                    result.error_in_exec
                )
        finally:
            events.trigger("post_execute")
            events.trigger("post_run_cell", result)
        return result

    def _compiled_key(self, raw_cell: str) -> tuple[object, ...] | None:
        """What a plain cell's compiled code depends on, or None where it is not kept. A cell of one
        line is not: IPython's prefilter transforms it by what the namespace holds (``time`` is a
        magic until a variable shadows it). Nor is a cell under a debugger's file name."""
        if "\n" not in raw_cell.rstrip("\n") or "get_code_name" in vars(self.compile):
            return None
        return (raw_cell, self.compile, self.compile.flags, *self.input_transformers_post)

    def _compile_plain(self, cell: str, name: str) -> list[CodeType]:
        """The cell's code: statements before a last expression together, then that expression so
        that the display hook shows its value."""
        compiler = self.compile
        tree = compiler.ast_parse(cell, filename=name)
        assert isinstance(tree, ast.Module)
        body = tree.body
        last = body[-1] if body and isinstance(body[-1], ast.Expr) else None
        codes: list[CodeType] = []
        if last is None or len(body) > 1:
            codes.append(compiler(ast.Module(body[:-1] if last else body, []), name, "exec"))  # type: ignore[arg-type]
        if last is not None:
            codes.append(compiler(ast.Interactive([last]), name, "single"))  # type: ignore[arg-type]
        return codes

    def _showtraceback(self, etype: type[BaseException], evalue: BaseException, stb: list[str]) -> None:
        self.last_error = (etype.__name__, str(evalue), [block for block in stb if not _pool_frame(block)])
        self.kept_error = evalue

    def post_mortem(self, cell_id: str) -> tuple[str, str, list[str]] | None:
        """pdb at the frame where this rank's last failed cell raised (``%debug`` in the notebook),
        its prompt in the notebook's input box; the cell's own frames first, not the rank's loop."""
        self.cell_id = cell_id
        exc = self.kept_error
        if exc is None or exc.__traceback__ is None:
            why = "has no failed cell to debug (a traceback is kept only until the next cell)"
            text = f"rank {self.rank} {why}"
            return ("LookupError", text, [f"LookupError: {text}"])
        cells = self.compile._filename_map  # the names the cells were compiled under
        tb: TracebackType | None = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename not in cells:
            tb = tb.tb_next
        debugger = self.debugger_cls()
        debugger.reset()
        debugger.interaction(None, tb or exc.__traceback__)
        return None

    def run(
        self, code: str, cell_id: str, exec_count: int, filename: str = ""
    ) -> tuple[str, str, list[str]] | None:
        """Run one cell; the error as (name, value, traceback lines), or None on success.
        ``filename``: compile the cell under this name (the notebook debugger's for the cell)."""
        self.cell_id = cell_id
        self.last_error = None
        self.last_value = None
        self.kept_error = None
        if filename:
            self.compile.get_code_name = lambda raw, transformed, number: filename  # type: ignore[method-assign,assignment]
        try:
            result = self._run_plain(code, cell_id, exec_count) if self._plain_ok(code) else None
            if result is None:
                if exec_count > 0:
                    self.execution_count = exec_count
                result = self.run_cell(code, store_history=True)  # type: ignore[no-untyped-call]
        finally:
            if filename:
                del self.compile.get_code_name
        history = self.history_manager
        if history is not None:
            # The display hook files each result's repr under its cell; nothing here reads them back.
            history.outputs.clear()
            # Each cell's source also waits in a cache for the history database, which a rank does
            # not have: nothing would ever write it out (``In`` keeps the sources, as in a notebook).
            if not history.enabled:
                with history.db_input_cache_lock:
                    history.db_input_cache.clear()
        if self.last_error is None and not result.success:
            exc = result.error_in_exec or result.error_before_exec
            if exc is not None:
                self.last_error = (type(exc).__name__, str(exc), [f"{type(exc).__name__}: {exc}"])
                self.kept_error = exc
        return self.last_error
