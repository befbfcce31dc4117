"""The measuring loops: per rank count, each system's round trips and warm restarts with only that
system alive, then the cold starts, systems alternated."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.dispatch.ours import AbSession, FloorSession, ShardKernelSession, ShardSession
from benchmarks.dispatch.peers import IppCluster, IppKernelSession, JdKernelSession, JdSession
from benchmarks.dispatch.results import FIRST_CELL, Results, Starts
from benchmarks.dispatch.timing import INTERRUPTS, stop_leftovers, zygote_switch
from jupyter_shard import Pool
from jupyter_shard.launchers import zygote

SESSIONS: dict[str, Callable[[int, Path], Any]] = {
    "floor": FloorSession,
    "shard": ShardSession,
    "shard-nb": ShardKernelSession,
    "ipp": IppCluster,
    "ipp-nb": IppKernelSession,
    "jd": JdSession,
    "jd-nb": JdKernelSession,
    "shard-ab": AbSession,
}


# -- measurements --------------------------------------------------------------------------------------


def measure_sessions(args: argparse.Namespace, nproc: int, scratch: Path, into: Results) -> None:
    """Round trips and warm restarts, one system alive at a time."""
    trips = into.trips.setdefault(nproc, {})
    warm = into.warm.setdefault(nproc, {})
    for name in args.systems:
        if name in into.skipped:
            continue
        print(f"[{nproc} ranks] {name}: round trips ...", flush=True)
        session = SESSIONS[name](nproc, scratch)
        try:
            trips.update(session.round_trips(args.warmup, args.repeats))
            restarts = session.warm_restarts()
            for i in range(args.warm_repeats):  # variants alternate, so drift hits each of them
                for variant, restart in restarts.items():
                    print(
                        f"[{nproc} ranks] {variant}: warm restart {i + 1}/{args.warm_repeats} ...", flush=True
                    )
                    warm.setdefault(variant, Starts()).add(*restart())
        finally:
            session.close()
            stop_leftovers(f"{name}, {nproc} ranks", into)


def cold_shard(nproc: int, scratch: Path, fork: bool) -> tuple[float, float]:
    zygote.close_all()  # the first %%distributed of a kernel finds no zygote
    with zygote_switch(fork):
        t0 = time.perf_counter()
        pool = Pool(nproc=nproc, device="cpu", log_dir=scratch / "logs")
        try:
            pool.start()
            t1 = time.perf_counter()
            pool.run(FIRST_CELL)
            t2 = time.perf_counter()
        finally:
            pool.shutdown()
            zygote.close_all()
    return t1 - t0, t2 - t1


def cold_ipp(nproc: int, scratch: Path) -> tuple[float, float]:
    cluster = IppCluster(nproc, scratch)
    try:
        t1 = time.perf_counter()
        cluster.view.execute(FIRST_CELL, block=True)
        return cluster.startup, time.perf_counter() - t1
    finally:
        cluster.close()


def cold_jd(nproc: int, scratch: Path) -> tuple[float, float]:
    session = JdSession(nproc, scratch)
    try:
        return session.startup, session.first_cell()
    finally:
        session.close()


COLD_STARTS: dict[str, Callable[[int, Path], tuple[float, float]]] = {
    "shard": lambda n, scratch: cold_shard(n, scratch, True),
    "shard-spawn": lambda n, scratch: cold_shard(n, scratch, False),
    "ipp": cold_ipp,
    "jd": cold_jd,
}


def measure_cold(args: argparse.Namespace, nproc: int, scratch: Path, into: Results) -> None:
    cold = into.cold.setdefault(nproc, {})
    names = [n for n in COLD_STARTS if n.split("-")[0] in args.systems and n not in into.skipped]
    for i in range(args.cold_repeats):
        for name in names:
            print(f"[{nproc} ranks] {name}: cold start {i + 1}/{args.cold_repeats} ...", flush=True)
            try:
                cold.setdefault(name, Starts()).add(*COLD_STARTS[name](nproc, scratch))
            finally:
                stop_leftovers(f"{name} cold start, {nproc} ranks", into)
            INTERRUPTS.check()
