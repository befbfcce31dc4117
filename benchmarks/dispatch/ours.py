"""The systems of this package, and the transport floor under them: ``floor``, ``shard``,
``shard-nb`` (the notebook path in a real kernel) and ``shard-ab`` (this tree against another
checkout, interleaved). Each is started with N ranks, gives its timed no-op loop and its warm
restarts, and stops everything it started on ``close``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import zmq

from benchmarks.common import ROOT
from benchmarks.dispatch.results import FIRST_CELL, IDLE, NOOP, POOL_IN_KERNEL
from benchmarks.dispatch.timing import INTERRUPTS, KernelProbe, time_loops, zygote_switch
from jupyter_shard import Pool
from jupyter_shard.launchers import zygote

# A floor worker: a DEALER that echoes every message. It exits on b"stop" or when its parent goes away
# (checked every 0.5 s), and ignores SIGINT: on Ctrl-C the benchmark stops it.
_ECHO_WORKER = """
import os, signal, sys, zmq
signal.signal(signal.SIGINT, signal.SIG_IGN)
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


class Session(Protocol):
    """One system started with N ranks: its timed no-op loop, and the warm restarts it offers."""

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]: ...

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]: ...


class FloorSession:
    def __init__(self, nproc: int, scratch: Path) -> None:
        self.nproc = nproc
        self.address = f"ipc://{scratch / f'floor-{nproc}.sock'}"
        self.identities = [f"w{i}".encode() for i in range(nproc)]
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(self.address)
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        for ident in self.identities:
            argv = [sys.executable, "-c", _ECHO_WORKER, self.address, ident.decode()]
            self.procs.append(subprocess.Popen(argv))
        waiting = set(self.identities)
        deadline = time.monotonic() + 30.0
        while waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"floor workers {sorted(waiting)} did not connect within 30 s")
            if self.sock.poll(100):
                ident, msg = self.sock.recv_multipart()
                if msg == b"ready":
                    waiting.discard(ident)

    def _round_trip(self) -> None:
        for ident in self.identities:
            self.sock.send_multipart([ident, b"ping"])
        for _ in range(self.nproc):
            self.sock.recv_multipart()

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]:
        return time_loops({"floor": self._round_trip}, warmup, repeats)

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]:
        return {}

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


class ShardSession:
    def __init__(self, nproc: int, scratch: Path) -> None:
        self.pool = Pool(nproc=nproc, device="cpu", log_dir=scratch / "logs")
        try:
            self.pool.start()
        except BaseException:
            self.close()
            raise

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]:
        paced = partial(self.pool.run, NOOP)
        paced.before = partial(time.sleep, IDLE)  # type: ignore[attr-defined]
        return time_loops({"shard": lambda: self.pool.run(NOOP), "shard-paced": paced}, warmup, repeats)

    def _restart(self, fork: bool) -> tuple[float, float]:
        with zygote_switch(fork):
            t0 = time.perf_counter()
            self.pool.restart()
            t1 = time.perf_counter()
            self.pool.run(FIRST_CELL)
            t2 = time.perf_counter()
        INTERRUPTS.check()
        return t1 - t0, t2 - t1

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]:
        return {"shard": lambda: self._restart(True), "shard-spawn": lambda: self._restart(False)}

    def close(self) -> None:
        try:
            self.pool.shutdown()
        finally:
            zygote.close_all()


_AB_DRIVER = """
import sys, time
from jupyter_shard import Pool
pool = Pool(nproc=int(sys.argv[1]), device="cpu", log_dir=sys.argv[2])
pool.start()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "go":
        break
    t0 = time.perf_counter()
    pool.run("pass")
    print(f"took {time.perf_counter() - t0!r}", flush=True)
pool.shutdown()
"""


class _AbSide:
    """One tree's pool in its own process: each ``go`` line is one timed ``Pool.run("pass")`` there."""

    def __init__(self, tree: Path, nproc: int, logs: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _AB_DRIVER, str(nproc), str(logs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tree,
        )
        self._expect("ready")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"the A/B driver ended before {prefix!r} (exit {self.proc.wait()})")

    def run(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._expect("took"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class AbSession:
    """This tree against ``--baseline DIR`` (another checkout), alive together and interleaved sample by
    sample, each timed inside its own process by the same driver: drift on the machine hits both.

    The pool started first runs measurably slower in this setup (the same tree against itself gave
    0.95-0.98), so half the samples are taken with this tree started first and half with the
    baseline started first, on fresh pools.
    """

    baseline: Path | None = None  # set from --baseline

    def __init__(self, nproc: int, scratch: Path) -> None:
        assert self.baseline is not None
        self.nproc, self.scratch = nproc, scratch
        self.trees = {"shard-tree": ROOT, "shard-base": self.baseline}
        self.sides: dict[str, _AbSide] = {}

    def _start(self, order: list[str]) -> None:
        self.close()
        try:
            for name in order:
                self.sides[name] = _AbSide(self.trees[name], self.nproc, self.scratch / f"logs-{name}")
        except BaseException:
            self.close()
            raise

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {name: [] for name in self.trees}
        for half, order in enumerate((["shard-tree", "shard-base"], ["shard-base", "shard-tree"])):
            self._start(order)
            for _ in range(warmup):
                for side in self.sides.values():
                    side.run()
            for i in range(repeats // 2 if half == 0 else repeats - repeats // 2):
                sides = list(self.sides.items())
                for name, side in sides if i % 2 == 0 else reversed(sides):  # who goes first alternates
                    samples[name].append(side.run())
                INTERRUPTS.check()
        self.close()
        return samples

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]:
        return {}

    def close(self) -> None:
        for side in self.sides.values():
            side.close()
        self.sides = {}


class ShardKernelSession:
    def __init__(self, nproc: int, scratch: Path) -> None:
        self.kernel = KernelProbe({"JUPYTER_SHARD_LOG_DIR": str(scratch / "logs")})
        self.magic = f"%%distributed --nproc {nproc} --device cpu"
        try:
            self.kernel.execute("%load_ext jupyter_shard")
            self.kernel.execute(f"{self.magic}\n{NOOP}")  # starts the pool
            self.kernel.execute(
                f"{POOL_IN_KERNEL} = get_ipython().magics_manager.registry['DistributedMagics'].pool"
            )
        except BaseException:
            self.close()
            raise

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]:
        cells = {
            "shard-nb": f"{self.magic}\n{NOOP}",
            "shard-nb-bare": f"%%distributed\n{NOOP}",
            "shard-nb-run": f"{POOL_IN_KERNEL}.run({NOOP!r});",  # the same pool, without the magic
            "kernel": NOOP,
        }
        return time_loops({k: partial(self.kernel.execute, c) for k, c in cells.items()}, warmup, repeats)

    def _restart(self) -> tuple[float, float]:
        restart = self.kernel.execute("%dist_restart")
        first = self.kernel.execute(f"%%distributed\n{FIRST_CELL}")
        INTERRUPTS.check()
        return restart, first

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]:
        return {"shard-nb": self._restart}

    def close(self) -> None:
        self.kernel.close()
