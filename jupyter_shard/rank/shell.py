"""The IPython shell a rank runs cells in: magics, ``!cmd``, ``display()`` and last-expression
results as in a notebook, with results, displays and tracebacks sent to the kernel."""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.inputtransformer2 import TransformerManager
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from jupyter_shard.rank.channel import Channel


class _RankDisplayHook(DisplayHook):
    """Send the last expression's value as a ``result`` message instead of printing it."""

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict: dict[str, Any], md_dict: dict[str, Any] | None = None) -> None:
        shell = self.shell
        assert isinstance(shell, RankShell)
        shell.channel.send(
            "result", {"cell_id": shell.cell_id, "data": format_dict, "metadata": md_dict or {}}
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
        body = {
            "cell_id": shell.cell_id,
            "data": data,
            "metadata": metadata or {},
            "transient": transient or {},
            "update": update,
        }
        shell.channel.send("display", body)

    def clear_output(self, wait: bool = False) -> None:
        pass


_DEFAULT_TRANSFORMS = TransformerManager()
_SPECIAL_CHARS = frozenset("%!?")
_SPECIAL_STARTS = (",", ";", "/", ">>>", "...", "In [")


def _plain_python(cell: str) -> bool:
    """True when IPython's static input transforms would return the cell unchanged.

    Those transforms act only on magics (``%``), shell escapes (``!``), help (``?``), escaped
    autocalls (``,`` ``;`` ``/`` at a line start), pasted prompts (``>>>``, ``...``, ``In [n]:``),
    and leading blank lines or indentation; a cell with none of them is plain Python.
    """
    if not cell or cell[0].isspace() or not _SPECIAL_CHARS.isdisjoint(cell):
        return False
    return not any(line.lstrip().startswith(_SPECIAL_STARTS) for line in cell.splitlines())


class RankShell(InteractiveShell):
    """One per rank process; ``channel`` and ``cell_id`` are set by the runtime."""

    displayhook_class = _RankDisplayHook
    display_pub_class = _RankDisplayPublisher

    channel: Channel
    cell_id: str = ""
    last_error: tuple[str, str, list[str]] | None = None

    @classmethod
    def create(cls, channel: Channel, user_ns: dict[str, Any]) -> RankShell:
        config = Config()
        config.HistoryManager.enabled = False
        config.InteractiveShell.colors = "nocolor"
        config.InteractiveShell.xmode = "Context"
        shell = cls.instance(config=config, user_ns=user_ns)
        shell.channel = channel
        return shell

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
            assert self.prefilter_manager is not None
            with self.builtin_trap:
                cell = self.prefilter_manager.prefilter_lines(cell) + "\n"
        lines = cell.splitlines(keepends=True)
        for transform in self.input_transformers_post:
            lines = transform(lines)
        return "".join(lines)

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

    def _showtraceback(self, etype: type[BaseException], evalue: BaseException, stb: list[str]) -> None:
        self.last_error = (etype.__name__, str(evalue), list(stb))

    def run(self, code: str, cell_id: str, exec_count: int) -> tuple[str, str, list[str]] | None:
        """Run one cell; the error as (name, value, traceback lines), or None on success."""
        self.cell_id = cell_id
        self.last_error = None
        if exec_count > 0:
            self.execution_count = exec_count
        result = self.run_cell(code, store_history=True)  # type: ignore[no-untyped-call]
        # The display hook files each result's repr under its cell; nothing here reads them back.
        if self.history_manager is not None:
            self.history_manager.outputs.clear()
        if self.last_error is None and not result.success:
            exc = result.error_in_exec or result.error_before_exec
            if exc is not None:
                self.last_error = (type(exc).__name__, str(exc), [f"{type(exc).__name__}: {exc}"])
        return self.last_error
