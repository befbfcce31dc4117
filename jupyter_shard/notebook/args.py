"""How every magic reads its line: one argparse that turns a mistake into one line saying what to do.

argparse prints its usage and exits on a bad option, which would end a kernel; :class:`MagicParser`
raises one :class:`~jupyter_shard.spec.SpecError` line instead (the magics show it as a
``UsageError``). ``%dist_export``'s line is read here too, so :mod:`jupyter_shard.export` takes
already-parsed arguments and knows nothing of magics.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from jupyter_shard.export.files import export
from jupyter_shard.spec import SpecError

if TYPE_CHECKING:
    from jupyter_shard.kernel.pool import Pool

__all__ = ["ExportArgs", "MagicParser", "export_args", "export_magic"]

EXPORT_USAGE = "%dist_export train.py [--sbatch job.sbatch] [--force]"


class MagicParser(argparse.ArgumentParser):
    """argparse that raises one :class:`SpecError` line instead of printing usage and exiting.

    With a ``usage``, every error line ends with it; without one, an unknown option points to the
    magic's help (``%%distributed?``).
    """

    def __init__(self, prog: str, sigil: str, usage: str | None = None) -> None:
        super().__init__(prog=prog, usage=usage, add_help=False, exit_on_error=False)
        self.magic = f"{sigil}{prog}"

    def error(self, message: str) -> NoReturn:
        raise SpecError(self.line(message))

    def line(self, message: str) -> str:
        """``%magic: message`` (and the usage, when the parser has one)."""
        return f"{self.magic}: {message}" + (f"; usage: {self.usage}" if self.usage else "")

    def parse_line(self, line: str) -> argparse.Namespace:
        """The options of a magic's line; any mistake (unknown option included) is one SpecError."""
        try:
            namespace, extra = self.parse_known_args(shlex.split(line))
        except SpecError:
            raise
        except (ValueError, argparse.ArgumentError) as exc:
            raise SpecError(self.line(str(exc))) from None
        if extra:
            unknown = f"unknown option {extra[0]!r}"
            if self.usage:
                raise SpecError(self.line(unknown))
            raise SpecError(f"{self.magic}: {unknown}; see {self.magic}? for the options")
        return namespace


@dataclass(frozen=True)
class ExportArgs:
    """``%dist_export train.py [--sbatch job.sbatch] [--force]``, parsed."""

    script: Path
    sbatch: Path | None
    force: bool


def export_args(line: str) -> ExportArgs:
    parser = MagicParser("dist_export", "%", usage=EXPORT_USAGE)
    parser.add_argument("script")
    parser.add_argument("--sbatch")
    parser.add_argument("--force", action="store_true")
    opts = parser.parse_line(line)
    return ExportArgs(Path(opts.script), Path(opts.sbatch) if opts.sbatch else None, bool(opts.force))


def export_magic(line: str, pool: Pool) -> str:
    """``%dist_export train.py [--sbatch job.sbatch] [--force]``: what was written and how to run it."""
    args = export_args(line)
    return export(pool.transcript, pool.spec, args.script, sbatch=args.sbatch, force=args.force)
