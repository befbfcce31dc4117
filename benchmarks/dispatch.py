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
import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

import ipyparallel
import psutil
import torch
import zmq
from _running import other_runs
from jupyter_client.manager import KernelManager

from jupyter_shard import Pool
from jupyter_shard.launchers import zygote

try:
    import jupyter_distributed
    from jupyter_distributed.kernel_group import DistributedKernelGroup

    JD_MISSING = ""
except ImportError as exc:  # kept out of the venv (its server extension takes over %%rank in JupyterLab)
    JD_MISSING = (
        f"jupyter-distributed is not importable ({exc}); see benchmarks/README.md for running with it "
        "from a folder outside the venv"
    )

NOOP = "pass"
POOL_IN_KERNEL = "_bench_pool"  # the magic's pool, as a name in the kernel
IDLE = 0.010  # `shard-paced`: how long the ranks sit idle before each run, as between notebook cells
FIRST_CELL = "import torch; x = 1"
ENGINE_TIMEOUT = 120.0
CELL_TIMEOUT = 180.0
RESULTS = Path(__file__).resolve().parent / "results" / "dispatch.md"

ROUND_TRIP = {
    "floor": "pyzmq floor",
    "kernel": "ipykernel `pass`, no ranks (kernel)",
    "shard": "jupyter_shard `Pool.run`",
    "shard-paced": f"jupyter_shard `Pool.run`, ranks idle {IDLE * 1e3:g} ms before each",
    "shard-nb": "jupyter_shard `%%distributed --nproc N --device cpu` (kernel)",
    "shard-nb-bare": "jupyter_shard bare `%%distributed` (kernel)",
    "shard-nb-run": "jupyter_shard `Pool.run` called in a cell (kernel)",
    "ipp": "ipyparallel `view.execute`",
    "ipp-nb": "ipyparallel `%%px` (kernel)",
    "jd": "jupyter-distributed `group.execute`",
    "jd-nb": "jupyter-distributed kernel",
    "shard-tree": "jupyter_shard `Pool.run`, this tree (A/B driver)",
    "shard-base": "jupyter_shard `Pool.run`, `--baseline` tree (A/B driver)",
}
COLD = {
    "shard": "jupyter_shard, zygote",
    "shard-spawn": "jupyter_shard, spawn (`JUPYTER_SHARD_ZYGOTE=0`)",
    "ipp": "ipyparallel",
    "jd": "jupyter-distributed",
}
WARM = {
    "shard": "jupyter_shard `Pool.restart`, zygote",
    "shard-spawn": "jupyter_shard `Pool.restart`, spawn",
    "shard-nb": "jupyter_shard `%dist_restart` (kernel)",
    "ipp": "ipyparallel `restart_engines`",
    "jd": "jupyter-distributed `group.restart`",
}

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


# -- statistics ----------------------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Starts:
    """Start-up samples in seconds: until the system answers, then the first cell."""

    startup: list[float] = field(default_factory=list)
    first_cell: list[float] = field(default_factory=list)

    def add(self, startup: float, first_cell: float) -> None:
        self.startup.append(startup)
        self.first_cell.append(first_cell)

    @property
    def total(self) -> list[float]:
        return [a + b for a, b in zip(self.startup, self.first_cell, strict=True)]

    @property
    def median(self) -> float:
        return statistics.median(self.total)


@dataclass
class Results:
    """Everything one run measured, with what is needed to redraw its report (``--replot``)."""

    command: str = ""
    settings: dict[str, int] = field(default_factory=dict)  # repeats, warmup, cold/warm repeats
    machine: list[str] = field(default_factory=list)
    trips: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    cold: dict[int, dict[str, Starts]] = field(default_factory=dict)
    warm: dict[int, dict[str, Starts]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # system -> why it has no numbers
    leftovers: list[str] = field(default_factory=list)  # processes a system left behind

    def to_json(self) -> str:
        def starts(table: dict[int, dict[str, Starts]]) -> dict[str, Any]:
            return {
                str(n): {k: {"startup": v.startup, "first_cell": v.first_cell} for k, v in rows.items()}
                for n, rows in table.items()
            }

        return json.dumps(
            {
                "command": self.command,
                "settings": self.settings,
                "machine": self.machine,
                "trips": {str(n): rows for n, rows in self.trips.items()},
                "cold": starts(self.cold),
                "warm": starts(self.warm),
                "skipped": self.skipped,
                "leftovers": self.leftovers,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Results:
        raw = json.loads(text)

        def starts(table: dict[str, Any]) -> dict[int, dict[str, Starts]]:
            return {
                int(n): {k: Starts(v["startup"], v["first_cell"]) for k, v in rows.items()}
                for n, rows in table.items()
            }

        return cls(
            raw["command"],
            raw["settings"],
            raw["machine"],
            {int(n): rows for n, rows in raw["trips"].items()},
            starts(raw["cold"]),
            starts(raw["warm"]),
            raw["skipped"],
            raw["leftovers"],
        )


class LoadWatch:
    """Samples the 1-minute load average, and other benchmarks running, every few seconds."""

    def __init__(self, every: float = 5.0) -> None:
        self.loads: list[float] = []
        self.others: set[str] = set()
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="load-watch", daemon=True)

    def __enter__(self) -> LoadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self._every):
            with contextlib.suppress(OSError, ValueError):
                self.loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
            self.others |= other_runs()

    def describe(self) -> str:
        if not self.loads:
            return "not sampled"
        return (
            f"{min(self.loads):.2f} / {statistics.median(self.loads):.2f} / {max(self.loads):.2f} "
            f"(min / median / max of {len(self.loads)} samples)"
        )


class Interrupts:
    """Turns SIGINT and SIGTERM into KeyboardInterrupt and remembers that one came.

    ipyparallel's blocking ``execute`` swallows KeyboardInterrupt and ``Pool.run`` turns it into an
    interrupted cell: :meth:`check` re-raises after such a call, so the ``finally`` blocks stop
    everything. Later signals are ignored so the cleanup is not cut short.
    """

    def __init__(self) -> None:
        self.seen = False
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self.seen:
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


def time_loops(fns: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Samples of each function; several are interleaved, so drift on the machine hits them all.
    A function with a ``before`` attribute has it called, untimed, before each of its samples."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            INTERRUPTS.check()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            before = getattr(fn, "before", None)
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
            INTERRUPTS.check()
    return samples


def stop_leftovers(what: str, into: Results, grace: float = 3.0) -> None:
    """Kill, by pid, any descendant of this process still alive after a system was stopped."""
    alive = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(alive, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            into.leftovers.append(f"{what}: pid {proc.pid} ({' '.join(proc.cmdline()[:4])})")
            proc.kill()
    psutil.wait_procs(alive, timeout=5.0)


@contextlib.contextmanager
def zygote_switch(on: bool) -> Iterator[None]:
    """Ranks of pools started inside come from the zygote (on) or one spawned process each (off)."""
    old = os.environ.get(zygote.ENV_SWITCH)
    os.environ[zygote.ENV_SWITCH] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(zygote.ENV_SWITCH, None)
        else:
            os.environ[zygote.ENV_SWITCH] = old


# -- a kernel driven over its own sockets ---------------------------------------------------------------


class KernelProbe:
    """A real kernel subprocess, spoken to as a frontend does: execute_request out, iopub in."""

    def __init__(self, env: dict[str, str], argv: list[str] | None = None, ready_timeout: float = 120.0):
        self.km = KernelManager(kernel_name="python3")
        spec = self.km.kernel_spec
        assert spec is not None
        spec.argv = argv or [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        if argv:
            spec.interrupt_mode = "message"
        self.km.start_kernel(env={**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1", **env})
        self.session = self.km.session
        self.shell = self.km.connect_shell()
        self.iopub = self.km.connect_iopub()
        self._wait_ready(ready_timeout)

    def _recv(self, sock: zmq.Socket[bytes], timeout: float) -> dict[str, Any]:
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no message from the kernel within {timeout:.0f} s")
        _, frames = self.session.feed_identities(sock.recv_multipart())
        msg: dict[str, Any] = self.session.deserialize(frames)
        return msg

    def _wait_ready(self, timeout: float) -> None:
        """Until a kernel_info request is answered on shell and its status seen on iopub (subscribed)."""
        deadline = time.monotonic() + timeout
        sent: set[str] = set()
        while time.monotonic() < deadline:
            if not self.km.is_alive():
                raise RuntimeError("the kernel died while starting")
            sent.add(self.session.send(self.shell, "kernel_info_request", {})["header"]["msg_id"])
            with contextlib.suppress(TimeoutError):
                while True:
                    msg = self._recv(self.iopub, 0.5)
                    if msg["parent_header"].get("msg_id") in sent:
                        while self.shell.poll(0):
                            self.shell.recv_multipart()
                        return
        raise TimeoutError(f"the kernel did not answer within {timeout:.0f} s")

    def execute(self, code: str, timeout: float = CELL_TIMEOUT) -> float:
        """Run one cell; seconds from sending the request to its idle status. Raises if it failed."""
        msg = self.session.msg(
            "execute_request",
            {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
        )
        msg_id = msg["header"]["msg_id"]
        errors: list[str] = []
        t0 = time.perf_counter()
        self.session.send(self.shell, msg)
        while True:
            reply = self._recv(self.iopub, timeout)
            if reply["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = reply["msg_type"], reply["content"]
            if kind == "status" and content["execution_state"] == "idle":
                elapsed = time.perf_counter() - t0
                break
            if kind == "error":
                errors.append(f"{content['ename']}: {content['evalue']}")
        while True:
            answer = self._recv(self.shell, timeout)
            if answer["parent_header"].get("msg_id") == msg_id:
                break
        status = answer["content"]["status"]
        if status != "ok":
            detail = errors or [f"{answer['content'].get('ename')}: {answer['content'].get('evalue')}"]
            raise RuntimeError(
                f"cell {code.strip().splitlines()[0]!r} failed in the kernel: {'; '.join(detail)}"
            )
        return elapsed

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=False)
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)
        self.shell.close(linger=0)
        self.iopub.close(linger=0)


# -- the systems ---------------------------------------------------------------------------------------


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
        self.trees = {"shard-tree": Path(__file__).resolve().parents[1], "shard-base": self.baseline}
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


class IppCluster:
    """A running ipyparallel cluster with ``nproc`` registered engines."""

    def __init__(self, nproc: int, scratch: Path) -> None:
        self.nproc = nproc
        self.profile_dir = Path(tempfile.mkdtemp(prefix="ipp-profile-", dir=scratch))
        t0 = time.perf_counter()
        self.cluster = ipyparallel.Cluster(
            n=nproc,
            profile_dir=str(self.profile_dir),
            log_level=logging.WARNING,
            engine_timeout=ENGINE_TIMEOUT,
        )
        self.client: Any = None
        try:
            self.client = self.cluster.start_and_connect_sync()
            self.client.wait_for_engines(nproc, timeout=ENGINE_TIMEOUT)
        except BaseException:
            self.close()
            raise
        self.startup = time.perf_counter() - t0
        view = self.client[:]
        if len(view.targets) != nproc:
            self.close()
            raise RuntimeError(f"ipyparallel DirectView has {len(view.targets)} engines, expected {nproc}")
        self.view = view

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]:
        return time_loops({"ipp": lambda: self.view.execute(NOOP, block=True)}, warmup, repeats)

    def _restart(self) -> tuple[float, float]:
        old = set(self.client.ids)
        t0 = time.perf_counter()
        self.cluster.restart_engines_sync()
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while len(new := set(self.client.ids) - old) < self.nproc:  # ``ids`` reads registrations
            if time.monotonic() > deadline:
                raise RuntimeError(f"ipyparallel: {len(new)} of {self.nproc} engines came back")
            time.sleep(0.005)
            INTERRUPTS.check()
        t1 = time.perf_counter()
        self.view = self.client[sorted(new)]
        self.view.execute(FIRST_CELL, block=True)
        t2 = time.perf_counter()
        INTERRUPTS.check()
        return t1 - t0, t2 - t1

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]:
        return {"ipp": self._restart}

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
            self.cluster.stop_cluster_sync()
        finally:
            shutil.rmtree(self.profile_dir, ignore_errors=True)


_IPP_KERNEL_SETUP = """
import logging, ipyparallel
_bench_cluster = ipyparallel.Cluster(n={n}, profile_dir={profile!r}, log_level=logging.WARNING,
                                     engine_timeout={timeout})
_bench_rc = _bench_cluster.start_and_connect_sync()
_bench_rc.wait_for_engines({n}, timeout={timeout})
_bench_rc.activate()
assert len(_bench_rc.ids) == {n}, _bench_rc.ids
"""


class IppKernelSession:
    def __init__(self, nproc: int, scratch: Path) -> None:
        self.profile_dir = Path(tempfile.mkdtemp(prefix="ipp-profile-", dir=scratch))
        self.kernel = KernelProbe({})
        try:
            setup = _IPP_KERNEL_SETUP.format(n=nproc, profile=str(self.profile_dir), timeout=ENGINE_TIMEOUT)
            self.kernel.execute(setup)
        except BaseException:
            self.close()
            raise

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]:
        return time_loops({"ipp-nb": partial(self.kernel.execute, f"%%px\n{NOOP}")}, warmup, repeats)

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]:
        return {}

    def close(self) -> None:
        try:
            with contextlib.suppress(Exception):
                self.kernel.execute("_bench_rc.close(); _bench_cluster.stop_cluster_sync()", timeout=60)
            self.kernel.close()
        finally:
            shutil.rmtree(self.profile_dir, ignore_errors=True)


class JdSession:
    """jupyter-distributed's kernel group, driven on an event loop of its own."""

    def __init__(self, nproc: int, scratch: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.group = DistributedKernelGroup(nproc, cwd=str(scratch))
        try:
            t0 = time.perf_counter()
            self.loop.run_until_complete(self.group.start())
            self.startup = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    async def _execute(self, code: str) -> None:
        result = await self.group.execute(code)
        if result.status != "ok":
            raise RuntimeError(f"jupyter-distributed: {code!r} ended {result.status}: {result.ranks}")

    async def _timed(self, warmup: int, repeats: int) -> list[float]:
        for _ in range(warmup):
            await self._execute(NOOP)
            INTERRUPTS.check()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await self._execute(NOOP)
            samples.append(time.perf_counter() - t0)
            INTERRUPTS.check()
        return samples

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]:
        return {"jd": self.loop.run_until_complete(self._timed(warmup, repeats))}

    def first_cell(self) -> float:
        t0 = time.perf_counter()
        self.loop.run_until_complete(self._execute(FIRST_CELL))
        return time.perf_counter() - t0

    def _restart(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.loop.run_until_complete(self.group.restart())
        restart = time.perf_counter() - t0
        return restart, self.first_cell()

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]:
        return {"jd": self._restart}

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.group.shutdown(now=True))
        finally:
            self.loop.close()


class JdKernelSession:
    def __init__(self, nproc: int, scratch: Path) -> None:
        argv = [sys.executable, "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"]
        env = {
            "JUPYTER_DISTRIBUTED_WORLD_SIZE": str(nproc),
            "JUPYTER_DISTRIBUTED_BASE_KERNEL": "python3",
            "JUPYTER_DISTRIBUTED_CWD": str(scratch),
        }
        self.kernel = KernelProbe(env, argv)  # its kernel_info starts the group

    def round_trips(self, warmup: int, repeats: int) -> dict[str, list[float]]:
        return time_loops({"jd-nb": partial(self.kernel.execute, NOOP)}, warmup, repeats)

    def warm_restarts(self) -> dict[str, Callable[[], tuple[float, float]]]:
        return {}

    def close(self) -> None:
        self.kernel.close()


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


# -- report --------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "unknown"


def machine(load_before: str, load_after: str, watch: LoadWatch, code: str, changed: list[str]) -> list[str]:
    cpu, ram = "unknown", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jd = "not installed"
    if not JD_MISSING:
        jd = f"{jupyter_distributed.__version__} (from {Path(jupyter_distributed.__file__).parent.parent})"
    return [
        f"- Date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- CPU: {cpu}; {os.cpu_count()} logical cores ({usable} usable by this process); RAM {ram}",
        f"- OS: {platform.system()} {platform.release()}; Python {platform.python_version()}",
        f"- torch {torch.__version__}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), "
        f"ipyparallel {ipyparallel.__version__}, jupyter-distributed {jd}, "
        f"jupyter_client {version('jupyter_client')}, ipykernel {version('ipykernel')}",
        f"- Load average (1, 5, 15 min) before the run: {load_before}; after: {load_after}; "
        f"1-min load during the run: {watch.describe()}. The run's own ranks, engines and kernels "
        "load the cores too; other processes skew the numbers, so compare ratios "
        "within one run",
        "- Other benchmarks seen running during the run: "
        + ("; ".join(sorted(watch.others)) if watch.others else "none"),
        f"- Code at the start: revision {code}"
        + (
            f"; changed during the run (later starts may have used the new code): {', '.join(changed)}"
            if changed
            else "; unchanged during the run"
        ),
    ]


ROOT = Path(__file__).resolve().parent.parent


def code_state() -> str:
    """The revision, and the package's files that differ from it (others edit the tree meanwhile)."""

    def git(*argv: str) -> str:
        with contextlib.suppress(OSError):
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.rstrip()
        return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "jupyter_shard").splitlines()
    return head + (f" with uncommitted changes in {', '.join(line[3:] for line in dirty)}" if dirty else "")


def changed_since(t0: float) -> list[str]:
    """Files of the package written after ``t0`` (epoch seconds)."""
    package = ROOT / "jupyter_shard"
    return sorted(str(f.relative_to(ROOT)) for f in package.rglob("*.py") if f.stat().st_mtime > t0)


def met(ok: bool) -> str:
    return "met" if ok else "not met"


@dataclass
class Target:
    name: str
    value: str
    ok: bool | None  # None: not measured


def targets(res: Results) -> list[Target]:
    """Issue 8's dispatch targets, computed from the numbers."""
    out: list[Target] = []
    t4 = res.trips.get(4, {})
    for key, path in (("shard", "`Pool.run`"), ("shard-nb", "`%%distributed` in a kernel")):
        if key in t4:
            p50 = percentile(t4[key], 50)
            out.append(Target(f"Round trip p50 ≤ 1 ms, 4 ranks, {path}", f"{ms(p50)} ms", p50 <= 1e-3))
        else:
            out.append(Target(f"Round trip p50 ≤ 1 ms, 4 ranks, {path}", "not measured", None))
    for ours, theirs, what in (
        ("shard", "ipp", "`Pool.run` vs `view.execute`"),
        ("shard-nb", "ipp-nb", "`%%distributed` vs `%%px`"),
    ):
        name = f"Round trip ≥ 10× faster than ipyparallel, 4 ranks p50, {what}"
        if ours in t4 and theirs in t4:
            ratio = percentile(t4[theirs], 50) / percentile(t4[ours], 50)
            out.append(Target(name, f"{ratio:.1f}×", ratio >= 10))
        else:
            out.append(Target(name, "not measured", None))
    for ours, what in (("shard", "`Pool.run`"), ("shard-nb", "`%%distributed` in a kernel")):
        name = f"Round trip ≤ 3× the pyzmq floor, 4 ranks p50, {what}"
        if ours in t4 and "floor" in t4:
            ratio = percentile(t4[ours], 50) / percentile(t4["floor"], 50)
            out.append(Target(name, f"{ratio:.1f}×", ratio <= 3))
        else:
            out.append(Target(name, "not measured", None))
    w4 = res.warm.get(4, {})
    for key, what in (("shard", "`Pool.restart` + first run"), ("shard-nb", "`%dist_restart` + first cell")):
        name = f"Warm restart to first result ≤ 1 s, 4 CPU ranks, {what} (median)"
        if key in w4:
            out.append(Target(name, f"{w4[key].median:.2f} s", w4[key].median <= 1.0))
        else:
            out.append(Target(name, "not measured", None))
    for n, trips in sorted(res.trips.items()):
        extra = magic_overhead(trips)
        if extra is not None:
            name = f"`%%distributed` no-op p50 ≤ ipykernel `pass` + `Pool.run` + 1 ms, {n} ranks (issue 23)"
            out.append(Target(name, f"{extra * 1e3:+.2f} ms", extra <= 1e-3))
        own = magic_overhead(trips, run="shard-nb-run")
        if own is not None:
            name = f"`%%distributed` no-op p50 ≤ a cell calling `Pool.run` + 1 ms, {n} ranks"
            out.append(Target(name, f"{own * 1e3:+.2f} ms", own <= 1e-3))
    for n, cold in sorted(res.cold.items()):
        name = f"Cold start no slower than ipyparallel, {n} ranks (median, zygote)"
        if "shard" in cold and "ipp" in cold:
            shard_s, ipp_s = cold["shard"].median, cold["ipp"].median
            out.append(Target(name, f"{shard_s:.2f} s vs {ipp_s:.2f} s", shard_s <= ipp_s))
    return out


def magic_overhead(trips: dict[str, list[float]], run: str = "shard") -> float | None:
    """What a no-op ``%%distributed`` cell costs (p50s, seconds) over ipykernel's own ``pass`` cell
    and ``Pool.run`` run back to back (``run="shard"``, issue 23's measure) or after the ranks sat idle
    (``run="shard-paced"``), or over a kernel cell that calls ``Pool.run`` on the same pool
    (``run="shard-nb-run"``: the magic's own work, the wake-up of ranks idle between cells counted on
    both sides); None when one of them was not measured."""
    if run == "shard-nb-run":
        keys: tuple[str, ...] = ("shard-nb", "shard-nb-run")
    else:
        keys = ("shard-nb", "kernel", run)
    if not all(k in trips for k in keys):
        return None
    cell, *rest = (percentile(trips[k], 50) for k in keys)
    return cell - sum(rest)


def overhead_lines(res: Results) -> list[str]:
    """Issue 23's line: the ``%%distributed`` cell against ``pass`` + ``Pool.run``, per rank count."""
    out = []
    for n, trips in sorted(res.trips.items()):
        extra = magic_overhead(trips)
        if extra is not None:
            out.append(
                f"- {n} ranks: `%%distributed` overhead p50 {extra * 1e3:+.2f} ms "
                f"(= {ms(percentile(trips['shard-nb'], 50))} − ipykernel `pass` "
                f"{ms(percentile(trips['kernel'], 50))} − `Pool.run` {ms(percentile(trips['shard'], 50))})"
            )
        own = magic_overhead(trips, run="shard-nb-run")
        if own is not None:
            cell, run, kernel = (percentile(trips[k], 50) for k in ("shard-nb", "shard-nb-run", "kernel"))
            out.append(
                f"- {n} ranks: the magic's own work p50 {own * 1e3:+.2f} ms (= {ms(cell)} − a cell calling "
                f"`Pool.run` {ms(run)}; that cell − ipykernel `pass` = {ms(run - kernel)}: `Pool.run` once "
                "per cell, after the ranks sat idle)"
            )
        paced = magic_overhead(trips, run="shard-paced")
        if paced is not None:
            run, b2b = (percentile(trips[k], 50) for k in ("shard-paced", "shard"))
            out.append(
                f"- {n} ranks: `Pool.run` with no kernel, ranks idle {IDLE * 1e3:g} ms before each run, p50 "
                f"{ms(run)} against {ms(b2b)} back to back ({(run - b2b) * 1e3:+.2f} ms); the cell over "
                f"ipykernel `pass` + that run: {paced * 1e3:+.2f} ms"
            )
    return [*out, ""] if out else []


def ab_lines(res: Results) -> list[str]:
    """This tree against ``--baseline``: the ratio of their p50s, per rank count."""
    out = []
    for n, trips in sorted(res.trips.items()):
        if "shard-tree" in trips and "shard-base" in trips:
            tree, base = percentile(trips["shard-tree"], 50), percentile(trips["shard-base"], 50)
            out.append(
                f"- {n} ranks: this tree p50 {ms(tree)} ms, baseline p50 {ms(base)} ms; "
                f"baseline / this tree = {base / tree:.3f}"
            )
    return [*out, ""] if out else []


def trip_table(res: Results) -> list[str]:
    out = [
        "| ranks | system | p50 | p90 | p50 / pyzmq floor | p50 / ipykernel `pass` "
        "| ipyparallel / this, p50 (same path) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    pair = {"shard": "ipp", "jd": "ipp", "shard-nb": "ipp-nb", "shard-nb-bare": "ipp-nb", "jd-nb": "ipp-nb"}
    for n, trips in sorted(res.trips.items()):
        floor = percentile(trips["floor"], 50) if "floor" in trips else None
        kernel = percentile(trips["kernel"], 50) if "kernel" in trips else None
        for name in (k for k in ROUND_TRIP if k in trips):
            p50, p90 = percentile(trips[name], 50), percentile(trips[name], 90)
            vs_floor = f"{p50 / floor:.1f}×" if floor else ""
            vs_kernel = f"{p50 / kernel:.1f}×" if kernel and (name.endswith(("-nb", "-bare"))) else ""
            other = pair.get(name, "")
            vs_ipp = f"{percentile(trips[other], 50) / p50:.1f}×" if other in trips else ""
            out.append(
                f"| {n} | {ROUND_TRIP[name]} | {ms(p50)} | {ms(p90)} | {vs_floor} | {vs_kernel} | {vs_ipp} |"
            )
    return out


def start_table(
    table: dict[int, dict[str, Starts]], labels: dict[str, str], parts: tuple[str, str]
) -> list[str]:
    out = [
        f"| ranks | system | total, median (min–max) | {parts[0]} + {parts[1]} (medians) "
        "| vs jupyter_shard |",
        "|---:|---|---:|---:|---:|",
    ]
    for n, rows in sorted(table.items()):
        ours = rows.get("shard")
        for name, s in rows.items():
            total = s.total
            ratio = f"{s.median / ours.median:.2f}×" if ours and name != "shard" else ""
            out.append(
                f"| {n} | {labels[name]} "
                f"| {statistics.median(total):.2f} ({min(total):.2f}–{max(total):.2f}) "
                f"| {statistics.median(s.startup):.2f} + {statistics.median(s.first_cell):.3f} | {ratio} |"
            )
    return out


def report(res: Results, plots: list[str], stem: str = "dispatch") -> str:
    settings = res.settings
    out = [
        "# Dispatch: round trip, cold start and warm restart against ipyparallel and jupyter-distributed",
        "",
        f"Produced by `{res.command}`; how to read it: `benchmarks/README.md`. "
        f"Raw samples: `{stem}.json` beside this file.",
        "",
        "## Machine",
        "",
        *res.machine,
        "",
    ]
    if res.skipped:
        out += [f"- `{name}` has no numbers: {why}" for name, why in res.skipped.items()] + [""]
    if res.trips:
        out += [
            f"## No-op cell round trip (`{NOOP}`), ms: {settings['repeats']} timed "
            f"after {settings['warmup']} warm-up",
            "",
            "The kernel rows include the frontend hop (execute_request → iopub idle); "
            "the ratio column compares each system with ipyparallel on the same path "
            "(API with `view.execute`, kernel with `%%px`).",
            "",
            *trip_table(res),
            "",
            *overhead_lines(res),
            *ab_lines(res),
        ]
        out += [
            f"![Round trip p50 and p90 by rank count]({n})" for n in plots if n.endswith("-roundtrip.png")
        ]
        out += [""]
    if any(res.cold.values()):
        out += [
            f"## Cold start to first result, s: {settings['cold_repeats']} each, alternated",
            "",
            f"First cell `{FIRST_CELL}`; start = until every rank/engine answers, then the first cell.",
            "",
            *start_table(res.cold, COLD, ("start", "first cell")),
            "",
        ]
    if any(res.warm.values()):
        out += [
            f"## Warm restart to first result, s: {settings['warm_repeats']} each, alternated",
            "",
            *start_table(res.warm, WARM, ("restart", "first cell")),
            "",
        ]
    starts = [n for n in plots if n.endswith("-start.png")]
    out += [f"![Cold start and warm restart to first result]({n})" for n in starts] + ([""] if starts else [])
    goals = targets(res)
    out += [
        "## Targets (issue 8), computed from the numbers above",
        "",
        "| target | measured | |",
        "|---|---:|---|",
    ]
    out += [f"| {t.name} | {t.value} | {'n/a' if t.ok is None else met(t.ok)} |" for t in goals]
    out += [""]
    out += [f"<!-- target: {t.name} | {t.value} | {'n/a' if t.ok is None else met(t.ok)} -->" for t in goals]
    if res.leftovers:
        out += ["", "Processes still alive after their system was stopped (killed by the benchmark):", ""]
        out += [f"- {line}" for line in res.leftovers]
    return "\n".join(out) + "\n"


# One colour per system in every figure: jupyter_shard in blues, peers in warm colours, floors in grey.
COLOURS = {
    "floor": "0.45",
    "kernel": "0.7",
    "shard": "tab:blue",
    "shard-paced": "tab:blue",
    "shard-nb": "tab:cyan",
    "shard-nb-bare": "tab:purple",
    "shard-nb-run": "tab:brown",
    "shard-spawn": "tab:purple",
    "ipp": "tab:red",
    "ipp-nb": "tab:orange",
    "jd": "tab:green",
    "jd-nb": "tab:olive",
    "shard-tree": "tab:blue",
    "shard-base": "tab:gray",
}


def plot(res: Results, folder: Path, stem: str = "dispatch") -> list[str]:
    """Draw the two figures into ``folder``; their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if res.trips:
        fig, ax = plt.subplots(figsize=(9, 5.5))
        ranks = sorted(res.trips)
        for name, label in ROUND_TRIP.items():
            xs = [n for n in ranks if name in res.trips[n]]
            if not xs:
                continue
            p50 = [percentile(res.trips[n][name], 50) * 1e3 for n in xs]
            p90 = [percentile(res.trips[n][name], 90) * 1e3 for n in xs]
            ax.plot(xs, p50, "o-", color=COLOURS[name], label=label.replace("`", ""))
            ax.plot(xs, p90, "v--", color=COLOURS[name], alpha=0.5)
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(n) for n in ranks])
        ax.set_xlabel("ranks / engines")
        ax.set_ylabel("no-op round trip, ms (solid: p50, dashed: p90)")
        ax.axhline(1.0, color="black", lw=0.8, ls=":", label="1 ms target (4 ranks)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        fig.savefig(folder / f"{stem}-roundtrip.png", dpi=120)
        plt.close(fig)
        written.append(f"{stem}-roundtrip.png")
    if any(res.cold.values()) or any(res.warm.values()):
        fig, axes = plt.subplots(1, 2, figsize=(13, 6.5))
        for ax, table, labels, title in (
            (axes[0], res.cold, COLD, "cold start"),
            (axes[1], res.warm, WARM, "warm restart"),
        ):
            ranks = sorted(n for n in table if table[n])
            names = [k for k in labels if any(k in table[n] for n in ranks)]
            width = 0.8 / max(len(names), 1)
            for i, name in enumerate(names):
                left = [j + i * width for j, n in enumerate(ranks) if name in table[n]]
                ys = [table[n][name].median for n in ranks if name in table[n]]
                bars = ax.bar(left, ys, width, label=labels[name].replace("`", ""), color=COLOURS[name])
                ax.bar_label(bars, fmt="%.2f", fontsize=7)
            ax.set_xticks(
                [j + width * (len(names) - 1) / 2 for j in range(len(ranks))], [str(n) for n in ranks]
            )
            ax.set_xlabel("ranks / engines")
            ax.set_ylabel(f"{title} to first result, s (median)")
            ax.set_yscale("log")
            ax.set_ylim(bottom=0.05)
            if title == "warm restart":
                ax.axhline(1.0, color="black", lw=0.8, ls=":", label="1 s target (4 ranks)")
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(folder / f"{stem}-start.png", dpi=120)
        plt.close(fig)
        written.append(f"{stem}-start.png")
    return written


def write(res: Results, results: str) -> None:
    """The report (and, unless only printing, its plots and raw samples beside it)."""
    plots: list[str] = []
    if results != "-":
        folder = Path(results).parent
        folder.mkdir(parents=True, exist_ok=True)
        stem = Path(results).stem  # dispatch.md: dispatch.json, dispatch-roundtrip.png, ...
        plots = plot(res, folder, stem)
        (folder / f"{stem}.json").write_text(res.to_json())
    text = report(res, plots, Path(results).stem if results != "-" else "dispatch")
    print()
    print(text)
    if results != "-":
        Path(results).write_text(text)
        print(f"written to {results}")


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
    parser.add_argument("--results", default=str(RESULTS), help="markdown file to write (- only prints)")
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
    res = Results(" ".join([".venv/bin/python", "benchmarks/dispatch.py", *sys.argv[1:]]), settings)
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
