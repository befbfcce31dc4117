"""The magics that keep a pool's state beyond its processes or its kernel: ``%dist_suspend``,
``%dist_resume``, ``%dist_pools`` and ``%dist_attach``. Thin, as the other magics: parse, call
:mod:`jupyter_shard.pool.suspend` or :mod:`jupyter_shard.pool.keep`, and say what happened."""

from __future__ import annotations

import time
from typing import Protocol

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_magic, magics_class

from jupyter_shard.errors import SpecError
from jupyter_shard.notebook.args import MagicParser, resume_options
from jupyter_shard.pool.keep import attach, format_duration, kept_pools, parse_duration, pools_table
from jupyter_shard.pool.pool import Pool
from jupyter_shard.pool.suspend import DEFAULT_DIRECTORY, resume, suspend
from jupyter_shard.spec import LaunchSpec, format_ranks

__all__ = ["KeepMagics"]


class PoolHolder(Protocol):
    """The ``%%distributed`` magics, which hold this kernel's pool."""

    pool: Pool | None
    parser: MagicParser

    def new_pool(self, spec: LaunchSpec) -> Pool: ...


@magics_class
class KeepMagics(Magics):
    def __init__(self, shell: InteractiveShell, holder: PoolHolder) -> None:
        super().__init__(shell)
        self.holder = holder

    @line_magic
    def dist_suspend(self, line: str) -> None:
        """Write every rank's state to a directory, then end the ranks: %dist_suspend [DIR]"""
        pool = self.holder.pool
        if pool is None or not pool.started:
            raise UsageError("no pool is running; there is nothing to suspend")
        print(suspend(pool, line.strip() or DEFAULT_DIRECTORY, _say).summary())

    @line_magic
    def dist_resume(self, line: str) -> None:
        """Start a pool from a suspend: %dist_resume [DIR] [--nproc N] [other %%distributed options]"""
        directory, changes, keep = resume_options(self.holder.parser, line)
        try:
            seconds = parse_duration(keep) if keep is not None else None
        except SpecError as exc:
            raise UsageError(str(exc)) from None
        holder = self.holder
        pool = holder.pool if holder.pool is not None else holder.new_pool(LaunchSpec())
        try:
            holder.pool, report = resume(directory or DEFAULT_DIRECTORY, changes, pool, _say)
        except SpecError as exc:
            raise UsageError(str(exc)) from None
        if seconds is not None:
            holder.pool.keep = seconds
        print(report.summary())

    @line_magic
    def dist_pools(self, line: str) -> None:
        """Kept pools (%%distributed --keep) of this user on this machine: %dist_pools"""
        print(pools_table(kept_pools()))

    @line_magic
    def dist_attach(self, line: str) -> None:
        """Make a kept pool this kernel's: %dist_attach [ID] [--take-over]"""
        words = line.split()
        take_over = "--take-over" in words
        rest = [w for w in words if w != "--take-over"]
        if len(rest) > 1 or any(w.startswith("-") for w in rest):
            raise UsageError(
                "%dist_attach [ID] [--take-over]: the id %dist_pools shows, or none for the only one"
            )
        holder = self.holder
        began = time.monotonic()
        pool = holder.pool if holder.pool is not None else holder.new_pool(LaunchSpec())
        holder.pool = attach(rest[0] if rest else None, take_over, pool, _say)
        print(
            f"jupyter_shard: attached to {pool.spec.describe()} in {time.monotonic() - began:.2f} s; "
            f"its ranks kept their state. Kept for {format_duration(pool.keep)} after this kernel ends"
        )
        run = pool.background
        if run is not None and run.running:
            ranks = format_ranks(list(run.gathering.targets))
            print(
                f"jupyter_shard: rank {ranks} still run a background cell ({run.gathering.code}): its "
                "output follows here; %dist_wait waits for it, %dist_interrupt stops it"
            )


def _say(line: str) -> None:
    print(line, flush=True)  # before the ranks' own output, as the pool's start line is
