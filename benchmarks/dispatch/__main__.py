"""Dispatch latency, cold start and warm restart: jupyter_shard against its peers, side by side in one run.

Per rank count N (``--ranks``, default 2 4 8), all on this machine, one system alive at a time:

No-op round trip, ``--warmup`` untimed runs then ``--repeats`` timed ones; p50 and p90:

* ``floor``: a pyzmq ROUTER here, N echoing DEALER subprocesses over ``ipc://``; one sample sends
  4 bytes to each and receives N replies. Transport only: the least any design on pyzmq can do.
* ``shard``: ``Pool(nproc=N, device="cpu").run("pass")`` on a started pool.
* ``shard-nb``: the notebook path. A real IPython kernel (jupyter_client ``KernelManager``) with
  ``%load_ext jupyter_shard`` runs ``%%distributed --nproc N --device cpu`` + ``pass``.
* ``ipp``: ``client[:].execute("pass", block=True)`` on a DirectView over the N engines of an
  ``ipyparallel.Cluster(n=N)``.
* ``ipp-nb``: the same cluster started inside a kernel, ``rc.activate()``, then ``%%px`` + ``pass``.
* ``jd``: jupyter-distributed's ``DistributedKernelGroup(N).execute("pass")`` (N ipykernels), awaited
  on an asyncio loop here.
* ``jd-nb``: jupyter-distributed's notebook kernel (``python -m jupyter_distributed.kernel``, the
  proxy its server extension installs) with ``JUPYTER_DISTRIBUTED_WORLD_SIZE=N`` running ``pass``.

A notebook-path sample runs from just before the ``execute_request`` is written to the kernel's
shell socket until the ``status: idle`` that answers it is read from iopub (ipykernel sends the
``execute_reply`` before that idle; the reply is read after the clock stops).

Cold start to first result (``--cold-repeats``, systems alternated): from constructing the pool,
cluster or group to the first ``import torch; x = 1`` returning on all N. ``shard`` forks ranks from
a zygote that is not running yet (the first ``%%distributed`` of a kernel); ``shard-spawn`` sets
``JUPYTER_SHARD_ZYGOTE=0``; ``ipp`` is controller + N engines; ``jd`` is N ipykernels.

Warm restart to first result (``--warm-repeats``): ``Pool.restart()`` then the first ``run`` (zygote
on, and ``shard-spawn`` with it off); ``shard-nb``: a ``%dist_restart`` cell then a ``%%distributed``
cell; ``ipp``: ``Cluster.restart_engines()`` (ipyparallel 9's closest: the engine set is stopped and
started again while controller and client stay up) + wait for N new engines + first execute;
``jd``: ``DistributedKernelGroup.restart()`` + first execute.

Libraries are imported before any timing. Everything started is stopped in ``finally`` blocks,
including on Ctrl-C, and descendants still alive afterwards are killed by pid (and counted in the
report). Writes ``--results`` (default ``benchmarks/results/dispatch.md``) and, beside it,
``dispatch-roundtrip.png`` and ``dispatch-start.png``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, LoadWatch, load_average, write_section
from benchmarks.dispatch.measure import SESSIONS, measure_cold, measure_sessions
from benchmarks.dispatch.ours import AbSession
from benchmarks.dispatch.peers import JD_MISSING
from benchmarks.dispatch.plot import plot
from benchmarks.dispatch.report import changed_since, code_state, machine, report
from benchmarks.dispatch.results import Results
from benchmarks.dispatch.timing import INTERRUPTS, stop_leftovers
from jupyter_shard.launchers import zygote


def write(res: Results, results: str) -> None:
    """The report (and, unless only printing, its plots and raw samples beside it)."""
    plots: list[str] = []
    if results != "-":
        folder = Path(results).parent
        folder.mkdir(parents=True, exist_ok=True)
        stem = Path(results).stem  # dispatch.md: dispatch.json, dispatch-roundtrip.png, ...
        plots = plot(res, folder, stem)
        (folder / f"{stem}.json").write_text(res.to_json())
    print()
    write_section(report(res, plots, Path(results).stem if results != "-" else "dispatch"), results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=200, help="timed no-op round trips per system")
    parser.add_argument("--warmup", type=int, default=20, help="untimed no-op round trips first")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="rank/engine counts")
    parser.add_argument("--cold-repeats", type=int, default=3, help="cold starts per system (0 skips)")
    parser.add_argument("--warm-repeats", type=int, default=5, help="warm restarts per system (0 skips)")
    parser.add_argument(
        "--systems", nargs="+", default=[s for s in SESSIONS if s != "shard-ab"], choices=list(SESSIONS)
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="another checkout (e.g. `git worktree add /tmp/base <commit>`): system shard-ab times "
        "Pool.run there and in this tree, interleaved",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 20 round trips, 2 ranks, 1 start each"
    )
    parser.add_argument(
        "--results", default=str(RESULTS / "dispatch.md"), help="markdown file to write (- only prints)"
    )
    parser.add_argument(
        "--replot", type=Path, metavar="JSON", help="measure nothing: redraw from dispatch.json"
    )
    args = parser.parse_args(argv)
    if args.replot:
        write(Results.from_json(args.replot.read_text()), args.results)
        return 0
    if "shard-ab" in args.systems and args.baseline is None:
        parser.error("--systems shard-ab needs --baseline DIR")
    AbSession.baseline = args.baseline.resolve() if args.baseline else None
    if args.quick:
        args.repeats, args.warmup, args.ranks, args.cold_repeats, args.warm_repeats = 20, 3, [2], 1, 1
    if min(args.repeats, *args.ranks) < 1 or min(args.warmup, args.cold_repeats, args.warm_repeats) < 0:
        parser.error("--repeats and --ranks must be ≥ 1, --warmup, --cold-repeats and --warm-repeats ≥ 0")

    settings = {k: getattr(args, k) for k in ("repeats", "warmup", "cold_repeats", "warm_repeats")}
    res = Results(" ".join([".venv/bin/python", "-m", "benchmarks.dispatch", *sys.argv[1:]]), settings)
    if JD_MISSING:
        res.skipped.update({"jd": JD_MISSING, "jd-nb": JD_MISSING})
    load_before, code, started = load_average(), code_state(), time.time()
    scratch = Path(tempfile.mkdtemp(prefix="jshard-bench-"))
    INTERRUPTS.install()
    try:
        with LoadWatch() as watch:
            for n in args.ranks:
                measure_sessions(args, n, scratch, res)
            for n in args.ranks if args.cold_repeats else []:
                measure_cold(args, n, scratch, res)
    except BaseException:
        if not INTERRUPTS.seen:
            raise
        print("interrupted: everything started was stopped, nothing written", file=sys.stderr)
        return 130
    finally:
        zygote.close_all()
        stop_leftovers("end of run", res)
        INTERRUPTS.restore()
        shutil.rmtree(scratch, ignore_errors=True)
    res.machine = machine(load_before, load_average(), watch, code, changed_since(started))
    write(res, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
