"""How every magic reads its line: one argparse that turns a mistake into one line saying what to do.

argparse prints its usage and exits on a bad option, which would end a kernel; :class:`MagicParser`
raises one :class:`~jupyter_shard.spec.SpecError` line instead (the magics show it as a
``UsageError``). ``%%distributed``'s options are declared here once, with their help (which is
``%%distributed?``) and the values Tab completes. ``%dist_export``'s line is read here too, so
:mod:`jupyter_shard.export` takes already-parsed arguments and knows nothing of magics.
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from IPython.core.completer import CompletionContext, SimpleCompletion, SimpleMatcherResult, context_matcher
from IPython.core.error import UsageError

from jupyter_shard.export.files import export
from jupyter_shard.spec import Device, Offload, Precision, SpecError, Strategy, launcher_names
from jupyter_shard.strategies import available_strategies

if TYPE_CHECKING:
    from jupyter_shard.pool.pool import Pool

__all__ = [
    "ExportArgs",
    "MagicParser",
    "complete_distributed",
    "distributed_parser",
    "export_args",
    "export_magic",
    "option_values",
    "parse_options",
]

EXPORT_USAGE = "%dist_export train.py [--sbatch job.sbatch] [--force]"


class MagicParser(argparse.ArgumentParser):
    """argparse that raises one :class:`SpecError` line instead of printing usage and exiting.

    With a ``usage``, every error line ends with it; without one, an unknown option points to the
    magic's help (``%%distributed?``).
    """

    def __init__(self, prog: str, sigil: str, usage: str | None = None) -> None:
        super().__init__(prog=prog, usage=usage, add_help=False, exit_on_error=False)
        self.magic = f"{sigil}{prog}"
        self._last: tuple[str, dict[str, object]] | None = None  # the last line parsed, and its options

    def error(self, message: str) -> NoReturn:
        raise SpecError(self.line(message))

    def line(self, message: str) -> str:
        """``%magic: message`` (and the usage, when the parser has one)."""
        return f"{self.magic}: {message}" + (f"; usage: {self.usage}" if self.usage else "")

    def parse_line(self, line: str) -> argparse.Namespace:
        """The options of a magic's line; any mistake (unknown option included) is one SpecError.

        The same line as the last one is not parsed again (a notebook runs one magic line over and
        over; parsing it is a tenth of a millisecond of every cell): a fresh copy of its options."""
        if self._last is not None and self._last[0] == line:
            return argparse.Namespace(**self._last[1])
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
        self._last = (line, dict(vars(namespace)))
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


def distributed_parser() -> MagicParser:
    p = MagicParser("distributed", "%%")
    pool = p.add_argument_group("the pool (a change restarts it; rank state is lost)")
    pool.add_argument(
        "--nproc", type=int, metavar="N", help="ranks on this machine (default: one per GPU, or 2 on CPU)"
    )
    pool.add_argument("--gpus", metavar="N|LIST", help="N ranks on CUDA, or the devices to use: 0,2 or 4-7")
    pool.add_argument(
        "--device", metavar="auto|cpu|cuda", help="cuda when a GPU is visible, else cpu (default: auto)"
    )
    pool.add_argument("--strategy", metavar="NAME", help="none, ddp, fsdp, deepspeed or one registered")
    pool.add_argument("--zero-stage", type=int, dest="zero_stage", metavar="0-3", help="DeepSpeed ZeRO stage")
    pool.add_argument(
        "--offload", metavar="none|cpu|nvme", help="where fsdp/ZeRO keep parameters and optimizer state"
    )
    pool.add_argument(
        "--precision", metavar="32|bf16-mixed|16-mixed", help="mixed precision for shard.prepare"
    )
    pool.add_argument(
        "--accumulate", type=int, metavar="N", help="micro-batches per optimizer step in shard.step()"
    )
    pool.add_argument(
        "--clip-grad-norm", type=float, dest="clip_grad_norm", metavar="X", help="clip in shard.step()"
    )
    pool.add_argument("--config", metavar="PATH", help="a DeepSpeed JSON config to start from")
    pool.add_argument(
        "--collective-timeout",
        type=float,
        dest="collective_timeout",
        metavar="S",
        help="the process group's (60 s)",
    )
    p.add_argument_group("keeping the ranks (no restart)").add_argument(
        "--keep",
        metavar="DURATION",
        help="keep the ranks and their state for 30m, 2h, 90s after the kernel ends (%%dist_attach); 0: no",
    )
    where = p.add_argument_group("where the ranks run")
    where.add_argument("--launcher", metavar="NAME", help="local (default), torchrun or slurm")
    where.add_argument("--nodes", type=int, metavar="N", help="machines (torchrun, slurm)")
    where.add_argument("--hosts", metavar="A,B", help="the machines, for --launcher torchrun")
    where.add_argument(
        "--interface", metavar="IF", help="the network interface ranks on other machines dial back to"
    )
    where.add_argument("--partition", metavar="P", help="SLURM partition")
    where.add_argument("--time", dest="time_limit", metavar="T", help="SLURM time limit")
    where.add_argument("--account", metavar="A", help="SLURM account")
    cell = p.add_argument_group("this cell only")
    cell.add_argument("--ranks", metavar="SPEC", help="run on some ranks: 0, 0,2 or 1-3 (as %%%%rank)")
    cell.add_argument("--timeout", type=float, metavar="S", help="stop the cell after S seconds")
    cell.add_argument("--bg", action="store_true", default=None, help="run in the background (%%dist_wait)")
    cell.add_argument(
        "--no-dashboard", action="store_true", default=None, dest="no_dashboard", help="no live dashboard"
    )
    return p


def option_values() -> dict[str, list[str]]:
    """What ``%%distributed --<option> <Tab>`` offers."""
    return {
        "--device": [d.value for d in Device],
        "--strategy": [*dict.fromkeys([s.value for s in Strategy] + available_strategies())],
        "--zero-stage": ["0", "1", "2", "3"],
        "--offload": [o.value for o in Offload],
        "--precision": [p.value for p in Precision],
        "--launcher": launcher_names(),
    }


@context_matcher()  # type: ignore[untyped-decorator]  # IPython leaves it untyped
def complete_distributed(context: CompletionContext) -> SimpleMatcherResult:
    """Tab completion on a ``%%distributed`` line (an IPython matcher): the options, and the values of
    those with a fixed set (``--strategy <Tab>``); any other line is left to IPython's own."""
    line = context.text_until_cursor
    if context.cursor_line != 0 or not line.startswith("%%distributed"):
        return _matched([], "", suppress=False)
    words = line.split()[1:]
    typing = "" if line.endswith((" ", "\t")) or not words else words.pop()
    values = option_values()
    if words and words[-1] in values and not typing.startswith("-"):
        found = [v for v in values[words[-1]] if v.startswith(typing)]
    else:
        options = [o for action in distributed_parser()._actions for o in action.option_strings]
        found = [o for o in options if o.startswith(typing) and o not in words]
    return _matched(found, typing, suppress=True)


def _matched(found: list[str], typed: str, suppress: bool) -> SimpleMatcherResult:
    return {
        "completions": [SimpleCompletion(text=f, type="param") for f in found],
        "matched_fragment": typed,  # what the completions replace
        "suppress": suppress,
        "ordered": True,
        "do_not_suppress": set(),
    }


def magic_line(name: str, line: str) -> str:
    """A cell magic's first line as written: ``%%distributed --nproc 2``, ``%%rank 0``."""
    return f"%%{name} {line}".strip()


def rank_code(magic: str, cell: str) -> str:
    """The code the ranks run for a cell magic's body. The magic line, as a comment, keeps traceback
    line numbers equal to the notebook's; a body that starts with a cell magic of its own (%%time)
    keeps it on its first line."""
    return cell if cell.startswith("%%") else f"# {magic}\n{cell}"


def parse_options(parser: MagicParser, line: str) -> argparse.Namespace:
    try:
        namespace = parser.parse_line(line)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    timeout = getattr(namespace, "timeout", None)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"{parser.magic}: --timeout {timeout:g} is not valid; give seconds above 0")
    return namespace


def resume_options(parser: MagicParser, line: str) -> tuple[str | None, dict[str, object], str | None]:
    """``%dist_resume [DIR] [options]``: the directory, the ``%%distributed`` pool options that change
    the suspended ones (``--nproc 4``), and ``--keep``; cell options (``--ranks``, ``--bg``…) are refused."""
    words = shlex.split(line)
    directory = words.pop(0) if words and not words[0].startswith("-") else None
    given = {k: v for k, v in vars(parse_options(parser, shlex.join(words))).items() if v is not None}
    cell_only = sorted(k for k in given if k in _CELL_ONLY and given[k])
    if cell_only:
        shown = ", ".join("--" + k.replace("_", "-") for k in cell_only)
        raise UsageError(f"%dist_resume takes the pool's options (--nproc, --strategy, …), not {shown}")
    given = {k: v for k, v in given.items() if k not in _CELL_ONLY}
    keep = given.pop("keep", None)
    if "collective_timeout" in given:
        given["timeout"] = given.pop("collective_timeout")
    return directory, given, None if keep is None else str(keep)


_CELL_ONLY = ("ranks", "timeout", "bg", "no_dashboard")
