"""Dispatch latency and cold start: jupyter_shard vs ipyparallel vs a raw pyzmq floor, in one run.

What is compared, per rank count N (``--ranks``, default 2 and 4), all on this machine, one system
alive at a time:

Round trip of a no-op cell (``pass``), ``--warmup`` untimed runs then ``--repeats`` timed ones:

* **jupyter_shard**: ``Pool(nproc=N, device="cpu", log_dir=<temp>)``, started (every rank has
  imported torch and joined the gloo group) before timing; one sample is ``pool.run("pass")``.
* **ipyparallel**: ``ipyparallel.Cluster(n=N)`` with a temporary profile dir,
  ``start_and_connect_sync()`` and ``wait_for_engines(N)`` before timing; one sample is
  ``client[:].execute("pass", block=True)`` on a DirectView over all N engines.
* **pyzmq floor**: a ROUTER on ``ipc://`` in this process and N plain Python subprocesses, each a
  DEALER that echoes every message; one sample is: send a 4-byte message to each of the N, then
  receive N replies. No serialisation, signing or bookkeeping: the transport cost alone.

Cold start to first result, ``--cold-repeats`` times each (alternating the two systems), reported
as medians. Both libraries are imported before any timing, so their import cost is excluded.

* **jupyter_shard**: time from ``Pool(...)`` + ``start()`` (ranks spawn, import torch, init gloo)
  to the first ``pool.run("import torch; x = 1")`` returning.
* **ipyparallel**: time from ``Cluster(n=N)`` + ``start_and_connect_sync()`` + ``wait_for_engines(N)``
  to the first ``client[:].execute("import torch; x = 1", block=True)`` returning; the engines do
  not import torch on their own, so the first cell pays for it.

Timing uses ``time.perf_counter``. Everything started is stopped in ``finally`` blocks, including on
Ctrl-C. The markdown table is printed and written, with the machine description, to ``--results``
(default ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipyparallel
import torch
import zmq

from jupyter_shard import Pool

NOOP = "pass"
FIRST_CELL = "import torch; x = 1"
ENGINE_TIMEOUT = 120.0

# A floor worker: a DEALER that echoes every message it gets. It exits when it receives b"stop" or
# when its parent goes away (checked every 0.5 s), so a killed benchmark leaves nothing behind.
# It ignores SIGINT: on Ctrl-C the benchmark stops it.
_ECHO_WORKER = """
import os, signal, sys, zmq
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal Ctrl-C is the parent's to handle
parent = os.getppid()
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.IDENTITY, sys.argv[2].encode())
sock.connect(sys.argv[1])
sock.send(b"ready")
while True:
    if sock.poll(500):
        msg = sock.recv()
        if msg == b"stop":
            break
        sock.send(msg)
    elif os.getppid() != parent:
        break
sock.close(0)
ctx.term()
"""


# -- statistics ----------------------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Latency:
    """Round-trip samples in seconds for one system at one rank count."""

    samples: list[float]

    @property
    def p50(self) -> float:
        return percentile(self.samples, 50)

    @property
    def p90(self) -> float:
        return percentile(self.samples, 90)


@dataclass
class ColdStart:
    """Cold-start samples in seconds, with the split between start-up and the first cell."""

    total: list[float] = field(default_factory=list)
    startup: list[float] = field(default_factory=list)
    first_cell: list[float] = field(default_factory=list)

    def add(self, startup: float, first_cell: float) -> None:
        self.startup.append(startup)
        self.first_cell.append(first_cell)
        self.total.append(startup + first_cell)


class Interrupts:
    """Turns SIGINT and SIGTERM into KeyboardInterrupt and remembers that one came.

    Needed because ipyparallel's blocking ``execute`` swallows KeyboardInterrupt (it returns the
    AsyncResult instead), and ``Pool.run`` turns it into an interrupted cell: :meth:`check` re-raises
    after such a call, so the ``finally`` blocks stop everything. Later signals are ignored so the
    cleanup is not cut short.
    """

    def __init__(self) -> None:
        self.seen = False
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self.seen:  # already stopping: let the cleanup finish
            return
        self.seen = True
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt


INTERRUPTS = Interrupts()


def time_loop(fn: Callable[[], object], warmup: int, repeats: int) -> Latency:
    for _ in range(warmup):
        fn()
        INTERRUPTS.check()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        INTERRUPTS.check()
    return Latency(samples)


# -- the three systems ---------------------------------------------------------------------------------


@contextlib.contextmanager
def shard_pool(nproc: int, log_root: Path) -> Iterator[Pool]:
    """A started jupyter_shard pool; shut down on exit whatever happens."""
    pool = Pool(nproc=nproc, device="cpu", log_dir=log_root)
    try:
        pool.start()
        yield pool
    finally:
        pool.shutdown()


@contextlib.contextmanager
def ipp_cluster(nproc: int, profile_root: Path) -> Iterator[tuple[Any, float]]:
    """A running ipyparallel cluster with ``nproc`` registered engines, as (client, seconds to start)."""
    profile_dir = Path(tempfile.mkdtemp(prefix="ipp-profile-", dir=profile_root))
    t0 = time.perf_counter()
    cluster = ipyparallel.Cluster(
        n=nproc, profile_dir=str(profile_dir), log_level=logging.WARNING, engine_timeout=ENGINE_TIMEOUT
    )
    client: Any = None
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(nproc, timeout=ENGINE_TIMEOUT)
        yield client, time.perf_counter() - t0
    finally:
        if client is not None:
            client.close()
        cluster.stop_cluster_sync()
        shutil.rmtree(profile_dir, ignore_errors=True)


class EchoFloor:
    """A ROUTER in this process fanned out to ``nproc`` echoing DEALER subprocesses."""

    def __init__(self, nproc: int, sock_dir: Path) -> None:
        self.nproc = nproc
        self.address = f"ipc://{sock_dir / f'floor-{nproc}.sock'}"
        self.identities = [f"w{i}".encode() for i in range(nproc)]
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(self.address)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for ident in self.identities:
            self.procs.append(
                subprocess.Popen([sys.executable, "-c", _ECHO_WORKER, self.address, ident.decode()])
            )
        waiting = set(self.identities)
        deadline = time.monotonic() + 30.0
        while waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"floor workers {sorted(waiting)} did not connect within 30 s")
            if self.sock.poll(100):
                ident, msg = self.sock.recv_multipart()
                if msg == b"ready":
                    waiting.discard(ident)
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"floor worker exited early with code {proc.returncode}")

    def round_trip(self) -> None:
        for ident in self.identities:
            self.sock.send_multipart([ident, b"ping"])
        for _ in range(self.nproc):
            self.sock.recv_multipart()

    def close(self) -> None:
        for ident in self.identities:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([ident, b"stop"], flags=zmq.NOBLOCK)
        for proc in self.procs:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.sock.close(linger=0)
        self.ctx.term()


# -- measurements --------------------------------------------------------------------------------------


@dataclass
class RoundTrips:
    shard: Latency
    ipp: Latency
    floor: Latency


def measure_round_trips(nproc: int, warmup: int, repeats: int, scratch: Path) -> RoundTrips:
    print(f"[{nproc} ranks] pyzmq floor ...", flush=True)
    floor = EchoFloor(nproc, scratch)
    try:
        floor.start()
        floor_lat = time_loop(floor.round_trip, warmup, repeats)
    finally:
        floor.close()

    print(f"[{nproc} ranks] jupyter_shard ...", flush=True)
    with shard_pool(nproc, scratch / "logs") as pool:
        shard_lat = time_loop(lambda: pool.run(NOOP), warmup, repeats)

    print(f"[{nproc} ranks] ipyparallel ...", flush=True)
    with ipp_cluster(nproc, scratch) as (client, _):
        view = client[:]
        if len(view.targets) != nproc:
            raise RuntimeError(f"ipyparallel DirectView has {len(view.targets)} engines, expected {nproc}")
        ipp_lat = time_loop(lambda: view.execute(NOOP, block=True), warmup, repeats)

    return RoundTrips(shard_lat, ipp_lat, floor_lat)


def cold_shard(nproc: int, scratch: Path, into: ColdStart) -> None:
    t0 = time.perf_counter()
    pool = Pool(nproc=nproc, device="cpu", log_dir=scratch / "logs")
    try:
        pool.start()
        t1 = time.perf_counter()
        pool.run(FIRST_CELL)
        t2 = time.perf_counter()
    finally:
        pool.shutdown()
    into.add(t1 - t0, t2 - t1)


def cold_ipp(nproc: int, scratch: Path, into: ColdStart) -> None:
    with ipp_cluster(nproc, scratch) as (client, startup):
        t1 = time.perf_counter()
        client[:].execute(FIRST_CELL, block=True)
        first = time.perf_counter() - t1
        INTERRUPTS.check()
    into.add(startup, first)


def measure_cold(nproc: int, repeats: int, scratch: Path) -> tuple[ColdStart, ColdStart]:
    shard, ipp = ColdStart(), ColdStart()
    for i in range(repeats):
        print(f"[{nproc} ranks] cold start {i + 1}/{repeats} ...", flush=True)
        cold_shard(nproc, scratch, shard)
        cold_ipp(nproc, scratch, ipp)
    return shard, ipp


# -- report --------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "unknown"


def machine(load_before: str) -> list[str]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = "unknown"
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"- Date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- CPU: {cpu}; {os.cpu_count()} logical cores ({affinity} usable by this process)",
        f"- RAM: {ram}",
        f"- OS: {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, "
        f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), ipyparallel {ipyparallel.__version__}",
        f"- Load average (1, 5, 15 min) before the run: {load_before}; after: {load_average()} "
        "(other processes on the machine share the cores and skew the numbers)",
    ]


def met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def report(
    args: argparse.Namespace,
    trips: dict[int, RoundTrips],
    cold: dict[int, tuple[ColdStart, ColdStart]],
    load_before: str,
) -> str:
    out = [
        "# Dispatch benchmark: jupyter_shard vs ipyparallel",
        "",
        "Produced by `benchmarks/dispatch.py` (see `benchmarks/README.md`). "
        f"Command: `{' '.join(['python', 'benchmarks/dispatch.py', *sys.argv[1:]])}`",
        "",
        "## Machine",
        "",
        *machine(load_before),
        "",
    ]
    if trips:
        out += [
            f"## No-op cell round trip (`{NOOP}`), ms — {args.repeats} timed runs after "
            f"{args.warmup} warm-up",
            "",
            "- jupyter_shard: `Pool(nproc=N, device='cpu').run('pass')` (ranks started, torch + gloo up)",
            "- ipyparallel: `client[:].execute('pass', block=True)`, DirectView over N engines "
            "(`Cluster(n=N)`, all engines registered)",
            "- floor: raw pyzmq ROUTER → N echoing DEALER subprocesses over ipc://, 4-byte messages",
            "",
            "| ranks | jupyter_shard p50 / p90 | ipyparallel p50 / p90 | pyzmq floor p50 / p90 "
            "| ipyparallel / jupyter_shard (p50, p90) | jupyter_shard / floor (p50, p90) |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for n, t in sorted(trips.items()):
            out.append(
                f"| {n} | {ms(t.shard.p50)} / {ms(t.shard.p90)} | {ms(t.ipp.p50)} / {ms(t.ipp.p90)} "
                f"| {ms(t.floor.p50)} / {ms(t.floor.p90)} "
                f"| {t.ipp.p50 / t.shard.p50:.1f}× , {t.ipp.p90 / t.shard.p90:.1f}× "
                f"| {t.shard.p50 / t.floor.p50:.1f}× , {t.shard.p90 / t.floor.p90:.1f}× |"
            )
        out.append("")
    if cold:
        out += [
            f"## Cold start to first result, s — median of {args.cold_repeats} (min–max)",
            "",
            f"Both run the same first cell, `{FIRST_CELL}`; library imports happen before timing.",
            "",
            "- jupyter_shard: `Pool(nproc=N, device='cpu', log_dir=tmp)` + `start()` "
            "(spawn ranks, each imports torch and joins a gloo group) → first `run(...)` returns",
            "- ipyparallel: `Cluster(n=N)` + `start_and_connect_sync()` + `wait_for_engines(N)` "
            "(controller + N engines; no torch yet) → first `client[:].execute(..., block=True)` "
            "returns (this is where the engines import torch)",
            "",
            "| ranks | jupyter_shard total | (start + first cell) | ipyparallel total "
            "| (start + first cell) | ipyparallel / jupyter_shard |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for n, (s, i) in sorted(cold.items()):
            out.append(
                f"| {n} | {statistics.median(s.total):.2f} ({min(s.total):.2f}–{max(s.total):.2f}) "
                f"| {statistics.median(s.startup):.2f} + {statistics.median(s.first_cell):.3f} "
                f"| {statistics.median(i.total):.2f} ({min(i.total):.2f}–{max(i.total):.2f}) "
                f"| {statistics.median(i.startup):.2f} + {statistics.median(i.first_cell):.3f} "
                f"| {statistics.median(i.total) / statistics.median(s.total):.2f}× |"
            )
        out.append("")
    out += ["## Targets", ""]
    for n, t in sorted(trips.items()):
        ratio = t.ipp.p50 / t.shard.p50
        out.append(
            f"- Round trip ≥ 5× faster than ipyparallel, {n} ranks (p50): {ratio:.1f}× → {met(ratio >= 5)}"
        )
    if 4 in trips:
        p50 = trips[4].shard.p50
        out.append(f"- Round trip p50 < 2 ms at 4 ranks: {ms(p50)} ms → {met(p50 < 2e-3)}")
    else:
        out.append("- Round trip p50 < 2 ms at 4 ranks: not measured (4 not in --ranks)")
    for n, (s, i) in sorted(cold.items()):
        s_med, i_med = statistics.median(s.total), statistics.median(i.total)
        out.append(
            f"- Cold start no slower than ipyparallel, {n} ranks (median): "
            f"{s_med:.2f} s vs {i_med:.2f} s → {met(s_med <= i_med)}"
        )
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=200, help="timed no-op round trips per system")
    parser.add_argument("--warmup", type=int, default=20, help="untimed no-op round trips first")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank/engine counts")
    parser.add_argument("--cold-repeats", type=int, default=3, help="cold starts per system (0 skips)")
    parser.add_argument(
        "--results",
        type=Path,
        default=Path(__file__).resolve().parent / "RESULTS.md",
        help="markdown file to write (use - to only print)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.cold_repeats < 0 or min(args.ranks) < 1:
        parser.error("--repeats and --ranks must be ≥ 1, --warmup and --cold-repeats ≥ 0")

    load_before = load_average()
    scratch = Path(tempfile.mkdtemp(prefix="jshard-bench-"))
    trips: dict[int, RoundTrips] = {}
    cold: dict[int, tuple[ColdStart, ColdStart]] = {}
    INTERRUPTS.install()
    try:
        for n in args.ranks:
            trips[n] = measure_round_trips(n, args.warmup, args.repeats, scratch)
        if args.cold_repeats:
            for n in args.ranks:
                cold[n] = measure_cold(n, args.cold_repeats, scratch)
    except BaseException:
        if not INTERRUPTS.seen:
            raise
        # Pool.run may turn the interrupt into a DistributedError for the interrupted cell.
        print("interrupted: everything started was stopped, nothing written", file=sys.stderr)
        return 130
    finally:
        INTERRUPTS.restore()
        shutil.rmtree(scratch, ignore_errors=True)

    text = report(args, trips, cold, load_before)
    print()
    print(text)
    if str(args.results) != "-":
        args.results.write_text(text)
        print(f"written to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
