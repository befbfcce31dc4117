"""The notebook surface: ``%%distributed`` and friends. Thin: parse options, build a spec, call the pool.

Bad options become one ``UsageError`` line and leave a running pool untouched. A failed cell raises
:class:`~jupyter_shard.DistributedError`, shown as every failed rank's traceback (root cause first)
rather than the magic's own frames, so "Run All" stops there and nbval sees the failure.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.display import DisplayHandle, display

from jupyter_shard._util.units import format_bytes
from jupyter_shard.errors import PoolError
from jupyter_shard.gpus import format_gpus
from jupyter_shard.launchers import get_launcher, merge_spec, resolve_spec
from jupyter_shard.launchers.zygote import close_idle
from jupyter_shard.notebook.args import (
    MagicParser,
    complete_distributed,
    distributed_parser,
    export_magic,
    magic_line,
    parse_options,
    rank_code,
)
from jupyter_shard.notebook.dashboard import CellDashboard, Dashboard, StatusTable
from jupyter_shard.notebook.debug_adapter import RankDebugRouter
from jupyter_shard.notebook.display import SUMMARY_FROM, NotebookSink, in_kernel, output_mode, set_output_mode
from jupyter_shard.notebook.headstart import HeadStart, Repeat, Repeats
from jupyter_shard.notebook.keeping import KeepMagics
from jupyter_shard.notebook.panel import PromptNotice, register_comm, unregister_comm
from jupyter_shard.notebook.postmortem import PostMortem
from jupyter_shard.notebook.values import cell_value, shown_bundle
from jupyter_shard.pool.background import BackgroundRun
from jupyter_shard.pool.keep import parse_duration
from jupyter_shard.pool.pool import Pool
from jupyter_shard.pool.results import DistributedError
from jupyter_shard.spec import (
    LaunchSpec,
    SpecError,
    format_ranks,
    parse_ranks,
)

INTERRUPT_WAIT = 10.0  # seconds %dist_interrupt and an interrupted %dist_wait wait for a background run


_RUN_OPTIONS = ("ranks", "timeout", "bg", "no_dashboard", "keep")  # not options of the pool's processes


@magics_class
class DistributedMagics(Magics):
    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self.pool: Pool | None = None
        self.default_line = ""  # options of a bare %%distributed (set from the picker)
        self.parser = distributed_parser()
        self._dashboard: tuple[Dashboard, DisplayHandle] | None = None
        self.post_mortem = PostMortem(shell, lambda: self.pool)
        self.dap: RankDebugRouter | None = None  # the frontend's debugger on the ranks
        self.repeats = Repeats()  # the lines that ran on the pool as it is: a cell repeating one goes ahead
        self.head_start: HeadStart | None = None

    # -- running cells ---------------------------------------------------------------------------

    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run the cell on every rank: %%distributed [--nproc N | --gpus N | --gpus 0,2]
        [--device auto|cpu|cuda] [--strategy none|ddp|fsdp|deepspeed] [--ranks SPEC] [--timeout S] ..."""
        opts = parse_options(self.parser, line or self.default_line)
        self._report_unseen_background_failure()
        try:
            spec = self._resolve(opts)
            ranks = parse_ranks(opts.ranks, spec.world_size) if opts.ranks else None
            keep = parse_duration(opts.keep) if opts.keep is not None else None
        except SpecError as exc:
            raise UsageError(str(exc)) from None
        if self.pool is not None:
            self.pool.refuse_while_background("run a cell")
        unchanged = self.pool is not None and self.pool.started and spec == self.pool.spec
        pool = self._pool_for(spec)
        if keep is not None and keep != pool.keep:
            pool.keep = keep
        repeat = Repeat(line, self.default_line, pool, pool.spec, ranks, opts.timeout)
        self.repeats.ran(repeat, pool_kept=unchanged, background=bool(opts.bg))
        magic = magic_line("distributed", line)
        return self._run(magic, pool, cell, ranks, opts.timeout, not opts.no_dashboard, bool(opts.bg))

    @cell_magic
    def rank(self, line: str, cell: str) -> Any:
        """Run the cell only on some ranks: %%rank 0 | 0,2 | 1-3"""
        pool = self._require_pool()
        if not line.strip():
            raise UsageError("%%rank needs the ranks to run on: %%rank 0, %%rank 0,2 or %%rank 1-3")
        try:
            ranks = parse_ranks(line.strip(), pool.world_size)
        except SpecError as exc:
            raise UsageError(str(exc)) from None
        return self._run(magic_line("rank", line), pool, cell, ranks, None, True)

    def _run(
        self,
        magic: str,
        pool: Pool,
        cell: str,
        ranks: tuple[int, ...] | None,
        timeout: float | None,
        dashboard: bool,
        background: bool = False,
    ) -> Any:
        if dashboard:
            pool.observers.append(CellDashboard(pool, show_now=background or "shard.log" in cell))
        code, count = rank_code(magic, cell), self._count()
        if not background:
            return cell_value(pool, pool.run(code, ranks, timeout=timeout, exec_count=count), self.shell)
        pool.run_background(code, ranks, timeout=timeout, exec_count=count, on_done=_report_background)
        print(
            f"jupyter_shard: running in the background on {pool.spec.describe()}; "
            "%dist_wait waits for it, %dist_interrupt stops it"
        )
        return None

    def _count(self) -> int:
        # IPython counts the running cell before executing it, so the running cell is count - 1.
        return max(self.shell.execution_count - 1, 0) if self.shell is not None else 0

    def _report_unseen_background_failure(self) -> None:
        run = self.pool.background if self.pool is not None else None
        if run is not None and not run.running and run.error is not None and not run.reported:
            run.reported = True
            print(
                f"jupyter_shard: {run.describe()} failed: {run.error.args[0]} "
                "(its traceback is under that cell)",
                file=sys.stderr,
            )

    def spec_for(self, line: str) -> LaunchSpec:
        """The spec a ``%%distributed`` line asks for over the running pool's options (what a cell
        with it would run on); a bad option is a :class:`SpecError` or a ``UsageError``."""
        return self._resolve(parse_options(self.parser, line or self.default_line))

    def _resolve(self, opts: argparse.Namespace) -> LaunchSpec:
        """The spec this cell asks for: the options it names over the running pool's (``merged``)."""
        given = {k: v for k, v in vars(opts).items() if v is not None and k not in _RUN_OPTIONS}
        if "collective_timeout" in given:  # the process group's timeout, a pool-wide setting
            given["timeout"] = given.pop("collective_timeout")
        spec = resolve_spec(**given) if self.pool is None else merge_spec(self.pool.spec, given)
        launcher = get_launcher(spec.launcher)
        if launcher.remote:
            launcher.bind_address(spec)  # what only the launcher checks, before a running pool stops
        return spec

    def _pool_for(self, spec: LaunchSpec) -> Pool:
        """The pool for ``spec``, started; a start that fails leaves no pool behind (an option only
        the launcher can check, such as ``--launcher slurm`` without ``--interface``, is one line)."""
        pool = self.pool if self.pool is not None else self.new_pool(spec)
        try:
            if spec != pool.spec:
                if pool.started:
                    print(
                        f"jupyter_shard: restarting pool {_change(pool.spec, spec)}; rank state is lost",
                        flush=True,  # before the new ranks' output, as the start line is
                    )
                pool.restart(spec)
            if not pool.started:
                print(f"jupyter_shard: starting {spec.describe()} …", flush=True)
                pool.start()
        except BaseException as exc:
            pool.shutdown()
            self.pool = None
            if isinstance(exc, SpecError):
                raise UsageError(str(exc)) from None
            raise
        return pool

    def new_pool(self, spec: LaunchSpec) -> Pool:
        """This kernel's pool, for ``spec``, not started yet."""
        pool = self.pool = Pool(spec=spec, sink=NotebookSink() if in_kernel() else None)
        pool.observers.append(PromptNotice())  # the side panel hears of prompts while the kernel is busy
        return pool

    @line_magic
    def dist_wait(self, line: str) -> Any:
        """Wait for the background run to end; show its value, or raise its error: %dist_wait [--timeout S]"""
        parser = MagicParser("dist_wait", "%")
        parser.add_argument("--timeout", type=float)
        opts = parse_options(parser, line)
        run = self._require_pool().background
        if run is None:
            raise UsageError("no background run to wait for; start one with %%distributed --bg")
        try:
            result = run.wait(opts.timeout)
        except TimeoutError as exc:
            raise UsageError(
                f"{exc} after --timeout {opts.timeout:g} s; wait again or %dist_interrupt"
            ) from None
        except KeyboardInterrupt:
            self._require_pool().interrupt()
            result = run.wait(INTERRUPT_WAIT)
        return cell_value(self._require_pool(), result, self.shell)

    @line_magic
    def dist_debug(self, line: str) -> None:
        """pdb on a rank where the last failed cell raised: %dist_debug [--rank K] (default: the
        first failing rank; a bare %debug does the same)"""
        parser = MagicParser("dist_debug", "%")
        parser.add_argument("--rank", type=int, help="the rank to debug (default: the first that failed)")
        self.post_mortem.open(parse_options(parser, line).rank)

    @line_magic
    def dist_dashboard(self, line: str) -> None:
        """Live dashboard of the pool: per-rank status, every shard.log scalar, memory."""
        pool = self._require_pool()
        if self._dashboard is not None:
            old, handle = self._dashboard
            if old in pool.observers:
                pool.observers.remove(old)
            handle.update(old.static_bundle(), raw=True)
            old.close()
        dashboard = Dashboard(pool)
        pool.observers.append(dashboard)
        handle = display(dashboard, display_id=True)
        self._dashboard = (dashboard, handle)

    @line_cell_magic
    def dist_picker(self, line: str, cell: str | None = None) -> Any:
        """Strategy picker: %dist_picker [MODEL | 1.3B], or a dry run of the model and a batch:
        %dist_picker MODEL --batch EXPR [--world-size N] [--device cuda] [--gpu NAME] [--find-batch
        [--confirm]]; as a cell, %%dist_picker --batch EXPR [options], the cell's code builds the model
        (under fake tensors, in a scratch namespace: it defines nothing in the notebook's)"""
        from jupyter_shard.notebook.picker import picker

        def set_default(options: str) -> None:
            self.default_line = options.removeprefix("%%distributed").strip()
            print(
                f"jupyter_shard: %%distributed without options now means: %%distributed {self.default_line}"
            )

        ns = self.shell.user_ns if self.shell is not None else {}
        try:
            return picker(line.strip(), ns, self.pool, set_default, cell)
        except SpecError as exc:
            raise UsageError(str(exc)) from None

    def _require_pool(self) -> Pool:
        if self.pool is None or not self.pool.started:
            raise UsageError("no pool is running; start one with a %%distributed cell")
        return self.pool

    # -- moving values ---------------------------------------------------------------------------

    @line_magic
    def dist_push(self, line: str) -> None:
        """Copy kernel variables to every rank: %dist_push a b"""
        names = line.split()
        if not names:
            raise UsageError("%dist_push needs variable names, e.g. %dist_push lr batch_size")
        ns = self.shell.user_ns if self.shell is not None else {}
        missing = [n for n in names if n not in ns]
        if missing:
            raise UsageError(f"%dist_push: {missing[0]!r} is not defined in the notebook")
        pool = self._require_pool()
        sent = pool.push({n: ns[n] for n in names})  # a user variable may be called ranks
        ranks = format_ranks(list(range(pool.world_size)))
        print(f"jupyter_shard: pushed {', '.join(names)} to rank {ranks} ({format_bytes(sent)} each)")

    @line_magic
    def dist_pull(self, line: str) -> None:
        """Bring a rank variable into the kernel: %dist_pull name [--rank K | --all | --gather] [--device]

        ``--gather`` gathers the model returned by ``shard.prepare`` (sharded or not) into the kernel
        as a plain ``nn.Module``. Tensors arrive on the CPU; ``--device`` keeps them on the rank's
        device (on CUDA that creates a CUDA context in the kernel)."""
        parser = MagicParser("dist_pull", "%")
        parser.add_argument("name")
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--rank", type=int, default=0)
        group.add_argument("--all", action="store_true")
        group.add_argument("--gather", action="store_true")
        parser.add_argument("--device", action="store_true")
        opts = parse_options(parser, line)
        pool = self._require_pool()
        if not 0 <= opts.rank < pool.world_size:
            raise UsageError(
                f"%dist_pull: rank {opts.rank} does not exist; the pool has ranks 0-{pool.world_size - 1}"
            )
        if opts.gather:
            value = pool.pull(opts.name, gather=True, device=opts.device)
            moved = pool.last_transfer
            if moved is not None:
                print(
                    f"jupyter_shard: gathered {opts.name} on the ranks in {moved.gather:.2f} s, then "
                    f"{format_bytes(moved.nbytes)} to the kernel in {moved.seconds - moved.gather:.2f} s"
                )
        elif opts.all:
            value = pool.pull_all(opts.name, device=opts.device)
        else:
            value = pool.pull(opts.name, opts.rank, device=opts.device)
        if self.shell is not None:
            self.shell.user_ns[opts.name] = value

    # -- inspecting and control ------------------------------------------------------------------

    @line_magic
    def dist_status(self, line: str) -> Any:
        """Per-rank table: rank, pid, host, device, state, memory, current cell, log; then what is wrong
        with a rank that needs attention (broken: why, and what to do)."""
        if self.pool is None:
            print("no pool is running; start one with a %%distributed cell")
            return None
        return StatusTable(self.pool.spec.describe(), self.pool.status(), self.pool.launch_path)

    @line_magic
    def dist_stacks(self, line: str) -> None:
        """Print every rank's current Python stack."""
        for rank, text in self._require_pool().stacks().items():
            print(f"──── rank {rank} ────\n{text}")

    @line_magic
    def dist_interrupt(self, line: str) -> None:
        """Send KeyboardInterrupt to ranks that are running (and stop a background run)."""
        pool = self._require_pool()
        run = pool.background
        interrupted = pool.interrupt()
        if not interrupted:
            print("jupyter_shard: no rank is running a cell; nothing to interrupt")
        elif run is None or not run.running:
            print(f"jupyter_shard: interrupted rank {format_ranks(interrupted)}")
        else:
            try:
                run.wait(INTERRUPT_WAIT)
            except TimeoutError:
                print(f"jupyter_shard: {run.describe()} has not stopped yet", file=sys.stderr)
                return
            except (DistributedError, PoolError):
                pass
            print(f"jupyter_shard: stopped {run.describe()}")

    @line_magic
    def dist_restart(self, line: str) -> None:
        """Fresh rank processes with the same options; rank state is lost."""
        if self.pool is None:
            raise UsageError("no pool to restart; start one with a %%distributed cell")
        self.pool.restart()
        print(f"jupyter_shard: restarted {self.pool.spec.describe()}; rank state is lost")

    @line_magic
    def dist_export(self, line: str) -> None:
        """Write the cells run since the pool started as a torchrun script:
        %dist_export train.py [--sbatch job.sbatch] [--force]"""
        if self.pool is None:
            raise UsageError("nothing to export: no %%distributed cell has run in this kernel")
        try:
            print(export_magic(line, self.pool))
        except SpecError as exc:
            raise UsageError(str(exc)) from None

    @line_magic
    def dist_output(self, line: str) -> None:
        """How later cells show what ranks print: ``summary``, ``all`` or ``auto``; bare, which is set."""
        mode = line.strip()
        if mode:
            try:
                set_output_mode(mode)
            except ValueError:
                raise UsageError(f"%dist_output {mode}: say summary, all or auto") from None
        shown = {
            "summary": "a line several ranks print shows once, with their ranks",
            "all": "every line of every rank as it comes",
            "auto": f"the summary from {SUMMARY_FROM} ranks up, every line below",
        }
        mode = output_mode()
        print(f"jupyter_shard: rank output: {mode} ({shown[mode]}); the rank logs keep every line")

    @line_magic
    def dist_shutdown(self, line: str) -> None:
        """Stop every rank."""
        if self.pool is None or not self.pool.started:
            print("jupyter_shard: no pool is running; nothing to shut down")
            return
        self.pool.shutdown()
        self.pool = None
        print("jupyter_shard: pool shut down")


def _report_background(run: BackgroundRun) -> None:
    """Runs in the background cell's context when it ends: its outcome goes under that cell."""
    shell = InteractiveShell.instance() if InteractiveShell.initialized() else None
    if run.error is None:
        print(f"jupyter_shard: the background run finished in {run.elapsed:.1f} s")
        shown = shown_bundle(run.result)
        if shown is not None:
            display(shown, raw=True)
        return
    if shell is not None:
        run.reported = True
        _show_error(shell, type(run.error), run.error, None)
    else:
        print(str(run.error), file=sys.stderr)


def _change(old: LaunchSpec, new: LaunchSpec) -> str:
    """What differs between two specs, e.g. ``2 → 4 ranks, zero_stage 2 → 3``."""
    parts = []
    if old.nproc != new.nproc:
        parts.append(f"{old.nproc} → {new.nproc} ranks" + (" per node" if new.nodes > 1 else ""))
    values = [(name, getattr(old, name), getattr(new, name)) for name in LaunchSpec.__dataclass_fields__]
    mine, theirs = dict(old.launcher_options.items()), dict(new.launcher_options.items())
    values += [(name, mine.get(name), theirs.get(name)) for name in {**mine, **theirs}]
    for name, a, b in values:
        if name == "gpus" and old.devices != new.devices:
            parts.append(f"GPUs {format_gpus(old.devices) or 'none'} → {format_gpus(new.devices) or 'none'}")
        elif name not in ("nproc", "launcher_options", "gpus") and a != b:
            shown = "collective-timeout" if name == "timeout" else name.replace("_", "-")
            parts.append(f"{shown} {getattr(a, 'value', a)} → {getattr(b, 'value', b)}")
    return ", ".join(parts) or "with new options"


def _show_error(
    shell: InteractiveShell, etype: type, evalue: BaseException, tb: object, tb_offset: int | None = None
) -> None:
    stb = evalue.render() if isinstance(evalue, DistributedError) else [f"{etype.__name__}: {evalue}"]
    shell._showtraceback(etype, evalue, stb)


def load(shell: InteractiveShell) -> None:
    magics = DistributedMagics(shell)
    shell.register_magics(magics)
    shell.register_magics(KeepMagics(shell, magics))
    magics.post_mortem.install()
    kernel = getattr(shell, "kernel", None)
    if getattr(kernel, "debugger", None) is not None:  # ipykernel with debugpy
        magics.dap = RankDebugRouter(kernel, magics)
        magics.dap.install()
    if kernel is not None:
        magics.head_start = HeadStart(kernel, magics)
        magics.head_start.install()
    completer: Any = shell.Completer
    if complete_distributed not in completer.custom_matchers:
        completer.custom_matchers.append(complete_distributed)
    shell.set_custom_exc((DistributedError, PoolError), _show_error)
    register_comm(shell, magics)


def unload(shell: InteractiveShell) -> None:
    """Undo :func:`load`: shut the pool down (saying so), unregister every magic, the error display
    and the panel's comm target, and end the zygote, so that nothing is left running or reachable
    only from the old magics; ``%reload_ext`` then loads a fresh extension."""
    manager = shell.magics_manager
    _unregister(manager, manager.registry.pop("KeepMagics", None))
    magics = manager.registry.pop("DistributedMagics", None)
    if isinstance(magics, DistributedMagics):
        magics.post_mortem.uninstall()
        if magics.dap is not None:
            magics.dap.uninstall()
        if magics.head_start is not None:
            magics.head_start.uninstall()
        if magics.pool is not None:
            described = magics.pool.spec.describe()
            magics.pool.shutdown()
            magics.pool = None
            print(f"jupyter_shard: unloaded; the pool ({described}) was shut down, rank state is lost")
        _unregister(manager, magics)
    completer: Any = shell.Completer
    if complete_distributed in completer.custom_matchers:
        completer.custom_matchers.remove(complete_distributed)
    shell.set_custom_exc((), None)
    unregister_comm(shell)
    close_idle()


def _unregister(manager: Any, magics: Magics | None) -> None:
    """Remove every magic of ``magics`` from IPython's tables."""
    if magics is None:
        return
    for kind, names in magics.magics.items():
        for name in names:
            if getattr(manager.magics[kind].get(name), "__self__", None) is magics:
                del manager.magics[kind][name]


DistributedMagics.distributed.__doc__ = (
    "Run the cell on every rank of the pool, starting it (or restarting it for changed options) first.\n\n"
    + distributed_parser().format_help().replace("usage: distributed", "usage: %%distributed", 1)
    + "\nOptions not given keep the running pool's values. Rank output comes back labelled [rank k]; "
    "the cell's value is the lowest rank's (Out[n], _), jupyter_shard.last_values() gives every rank's."
)
