"""``%debug`` after a failed ``%%distributed`` cell, and ``%dist_debug --rank K``: pdb on a rank, at the
frame where its part of the cell raised, with its prompt in the notebook's input box.

IPython's own ``%debug`` is kept and wrapped: when the last cell that failed in this kernel was a
``%%distributed`` (or ``%%rank``) cell, a bare ``%debug`` opens the first failing rank's frame (the rank
named first in the error); after a local exception, or with arguments, IPython's ``%debug`` runs as
always. The ranks keep the last failed cell's traceback until their next cell.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import ExecutionResult, InteractiveShell

from jupyter_shard.pool.results import DistributedError

if TYPE_CHECKING:
    from jupyter_shard.pool.pool import Pool

__all__ = ["PostMortem"]


class PostMortem:
    """Remembers the last failed cell of the kernel and opens pdb on a rank for it."""

    def __init__(self, shell: InteractiveShell, pool: Any) -> None:
        self.shell = shell
        self._pool = pool  # () -> the magics' pool, or None
        self.failure: DistributedError | None = None
        self._sessions: list[Any] = []  # the results of post-mortem cells (not the user's cells)
        self._ipython_debug: dict[str, Any] = {}

    def install(self) -> None:
        self.shell.events.register("post_run_cell", self._after_cell)
        magics = self.shell.magics_manager.magics
        for kind in ("line", "cell"):
            original = magics[kind].get("debug")
            resolve = getattr(original, "_resolve", None)  # IPython 9 loads its magics lazily
            if callable(resolve):
                original = resolve()  # the loaded magic, so that the wrapper never calls itself
            if original is not None and not getattr(original, "_jupyter_shard", False):
                self._ipython_debug[kind] = original
                magics[kind]["debug"] = self._wrap(original)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            self.shell.events.unregister("post_run_cell", self._after_cell)
        magics = self.shell.magics_manager.magics
        for kind, original in self._ipython_debug.items():
            magics[kind]["debug"] = original
        self._ipython_debug.clear()

    def _after_cell(self, result: ExecutionResult) -> None:
        error = result.error_in_exec or result.error_before_exec
        if error is not None and not isinstance(error, UsageError):
            self.failure = error if isinstance(error, DistributedError) else None

    def _wrap(self, original: Any) -> Any:
        def debug(line: str = "", cell: str | None = None) -> Any:
            if self.failure is not None and not line.strip() and cell is None:
                return self.open(self.failure.rank)
            return original(line) if cell is None else original(line, cell)

        debug.__doc__ = (original.__doc__ or "") + (
            "\nAfter a failed %%distributed cell, a bare %debug opens pdb on the first failing rank "
            "(%dist_debug --rank K: another rank)."
        )
        debug._jupyter_shard = True  # type: ignore[attr-defined]
        return debug

    def open(self, rank: int | None) -> None:
        """pdb on ``rank`` (default: the first failing rank of the last failed cell)."""
        pool: Pool | None = self._pool()
        failure = self.failure
        if pool is None or not pool.started:
            raise UsageError("no pool is running: %dist_debug opens pdb on a rank after a failed cell")
        last = pool.last_result
        if failure is None or (last is not failure.result and all(last is not s for s in self._sessions)):
            raise UsageError(
                "the ranks keep a failed cell's traceback only until their next cell; run the failing "
                "cell again, then %debug (or %dist_debug --rank K)"
            )
        rank = failure.rank if rank is None else rank
        if rank not in {r.rank for r in pool.ranks}:
            raise UsageError(f"--rank {rank} is not a rank of this pool (0-{pool.world_size - 1})")
        if rank not in failure.tracebacks:
            failed = ", ".join(str(k) for k in sorted(failure.tracebacks)) or "none"
            raise UsageError(f"rank {rank} did not fail in the last cell (failed: rank {failed})")
        print(f"jupyter_shard: pdb on rank {rank}, where its part of the cell raised (q: quit)", flush=True)
        try:
            pool.post_mortem(rank)
        finally:
            self._sessions = [failure.result, pool.last_result]
