"""Soak: a real kernel runs random cells with faults injected among them for ``--minutes``; report losses.

A kernel started through jupyter_client (``KernelManager``, as Jupyter starts one) loads the
extension and runs a seeded random mix of cells on a CPU pool:

* ``compute``: a ``%%distributed`` cell that increments a counter on every rank and all-reduces it;
* ``train``: a few SGD steps with ``shard.log`` every step (every record must reach the history);
* ``push_pull``: ``%dist_push`` of a fresh list (summed on every rank), ``%dist_pull`` of the counter;
* ``kernel``: plain kernel code incrementing a kernel-side counter;

and, from a shuffled deck so that a short run meets every kind, these faults: a rank calls
``os._exit(3)``; a rank is SIGKILLed (mid-cell or between cells); one rank raises while the others
enter a collective; ``km.interrupt_kernel()`` during a sleeping cell or while one rank sits in a
collective; ``%dist_restart``; ``%dist_suspend`` and ``%dist_resume`` at the same world size, and at
one rank more (then back); a rank SIGKILLed while the pool suspends (the suspend fails in one line
and the earlier suspend in the directory stays whole, or it finished first and is resumed); a
suspend asked for during a ``--bg`` run (refused in one line, then ``%dist_wait``, suspend, resume);
the kernel SIGKILLed with its pool kept and a new kernel attaching; ``--take-over`` from another
kernel during a running cell (refused and withdrawn within 5 s) and then between cells (the pool
moves with its state, and the first kernel says so); two kernels attaching at once (one gets the
pool, the other a one-line refusal). ``faults.py`` says what each checks. Each
fault cell must fail the way RELIABILITY.md says (the message
names the rank and the cause) and the pool must then recover: the next ``compute`` cell succeeds,
after ``%dist_restart`` where the product asks for one.

For every fault the time from the failing cell's end to the end of the next working cell (including a
``%dist_restart`` where one is asked for) is recorded; the summary gives its median and maximum per
fault kind, and a recovery over 5 s counts as a failure.

State: rank 0's counter must continue across faults unless the product said "rank state is lost"
(a restart notice) since the last check; the kernel's counter must never reset. At the end, the
kernel's child processes must be exactly the current ranks, every earlier rank must be gone, and
nothing (the zygote included) may outlive the kernel's shutdown by 2 s. The summary table goes to
stdout; the exit status is 1 when anything unexpected happened.

    .venv/bin/python -m benchmarks.soak --minutes 60 --seed 1
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time

import psutil

from benchmarks.common import LoadWatch, format_loads, target_table
from benchmarks.soak.session import FAULTS, SLOW, Hang, Kernel, Soak, alive


def _times(times: list[float]) -> str:
    """Median, max and how many over :data:`SLOW` of recovery times, as table cells."""
    if not times:
        return f"{'-':>14}{'-':>14}{0:>10}"
    slow = sum(t > SLOW for t in times)
    return f"{statistics.median(times):>14.2f}{max(times):>14.2f}{slow:>10}"


def summary(soak: Soak, minutes: float, seed: int, orphans: list[str]) -> str:
    rows = [f"soak: {minutes:.1f} min, seed {seed}, {soak.nproc} CPU ranks, {soak.cells} cells run", ""]
    rows.append(
        f"{'fault':<22}{'injected':>9}{'survived':>10}{'back p50 (s)':>14}{'back max (s)':>14}"
        f"{f'over {SLOW:g} s':>10}"
    )
    everything: list[float] = []
    for kind in FAULTS:
        times = soak.back.get(kind, [])
        everything += times
        rows.append(f"{kind:<22}{soak.injected[kind]:>9}{soak.survived[kind]:>10}{_times(times)}")
    rows.append(
        f"{'total':<22}{sum(soak.injected.values()):>9}{sum(soak.survived.values()):>10}{_times(everything)}"
    )
    rows.append("")
    for title, items in (("unexpected failures", soak.failures), ("lost", soak.lost), ("orphans", orphans)):
        rows.append(f"{title}: {len(items)}")
        rows.extend(f"  - {item}" for item in items)
    return "\n".join(rows)


def section(
    soak: Soak, table: str, minutes: float, args: argparse.Namespace, orphans: list[str], watch: LoadWatch
) -> str:
    """The run as a RESULTS.md section: its table and one target line per promise (every fault
    survived quickly, nothing lost, nothing left behind, no unexpected failure)."""
    times = [t for kind in FAULTS for t in soak.back.get(kind, [])]
    slow = sum(t > SLOW for t in times)
    worst = f"max {max(times):.2f} s, {slow} over {SLOW:g} s" if times else "no fault recovered"
    injected, survived = sum(soak.injected.values()), sum(soak.survived.values())
    promises: list[tuple[str, str, bool | None]] = [
        (
            f"Back to a working cell within {SLOW:g} s of every failing cell, {args.nproc} ranks",
            worst,
            bool(times) and slow == 0 and survived == injected,
        ),
        (f"No process left behind, {args.nproc} ranks", f"{len(orphans)} orphan(s)", not orphans),
        (f"Nothing lost, {args.nproc} ranks", f"{len(soak.lost)} loss(es)", not soak.lost),
        (f"No unexpected failure, {args.nproc} ranks", f"{len(soak.failures)}", not soak.failures),
    ]
    lines = [
        f"# Soak: faults injected for {minutes:.0f} minutes at {args.nproc} CPU ranks",
        "",
        f"Produced by `.venv/bin/python -m benchmarks.soak --minutes {args.minutes:g} --nproc {args.nproc} "
        f"--seed {args.seed}`; how to read it: `benchmarks/README.md`.",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average (1, 5, 15 min) "
        f"before {format_loads(watch.before)}, after {format_loads(watch.after)}; other benchmarks or "
        f"test runs seen: {', '.join(sorted(watch.others)) or 'none'}",
        "",
        "```",
        table,
        "```",
        "",
        *target_table(promises),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--fault-rate", type=float, default=0.25, help="share of steps that inject a fault")
    parser.add_argument("--only", help="comma-separated fault kinds: the deck holds only these")
    parser.add_argument("--results", help="markdown section to write (for run_all); stdout only without")
    args = parser.parse_args(argv)
    kinds = tuple(args.only.split(",")) if args.only else FAULTS
    if unknown := set(kinds) - set(FAULTS):
        parser.error(f"--only: no fault {', '.join(sorted(unknown))}; the deck: {', '.join(FAULTS)}")
    rng = random.Random(args.seed)
    log_dir = tempfile.mkdtemp(prefix="jupyter_shard-soak-")
    soak = Soak(Kernel(log_dir), rng, args.nproc, f"{log_dir}/suspended", base_nproc=args.nproc, kinds=kinds)
    started = time.monotonic()
    watch = LoadWatch().start()
    orphans: list[str] = []
    try:
        soak.run("%load_ext jupyter_shard")
        first = soak.run(f"%%distributed --nproc {args.nproc} --device cpu\nimport torch")
        if not first.ok:
            raise SystemExit(f"the pool did not start: {first.error or first.stderr}")
        end = started + args.minutes * 60
        while time.monotonic() < end:
            step = rng.choice(("compute", "compute", "train", "push_pull", "kernel"))
            if rng.random() < args.fault_rate:
                soak.fault()
            elif step == "compute":
                if not soak.compute():
                    soak.fail("a compute cell failed outside a fault")
                    soak.recover()
            else:
                {"train": soak.train, "push_pull": soak.push_pull, "kernel": soak.kernel_cell}[step]()
        orphans = soak.orphans()
    except Hang as exc:
        soak.failures.append(f"cell {soak.cells}: hang: {exc}")
    finally:
        zygotes = set()
        with contextlib.suppress(psutil.Error):
            zygotes = {
                c.pid
                for c in psutil.Process(soak.kernel.pid).children()
                if "jupyter_shard.launchers.zygote" in " ".join(c.cmdline())
            }
        family = {soak.kernel.pid, *soak.pids_seen, *zygotes}
        soak.kernel.shutdown()  # the kernel of the end: a fault may have replaced the first
        watch.stop()
        time.sleep(2.0)
        orphans += [f"pid {pid} outlived the kernel's shutdown" for pid in sorted(family) if alive(pid)]
    print()
    minutes = (time.monotonic() - started) / 60
    table = summary(soak, minutes, args.seed, orphans)
    print(table)
    print(f"\nrank logs: {log_dir}")
    if args.results:
        with open(args.results, "w") as fh:
            fh.write(section(soak, table, minutes, args, orphans, watch))
    return 1 if soak.failures or soak.lost or orphans else 0


if __name__ == "__main__":
    sys.exit(main())
