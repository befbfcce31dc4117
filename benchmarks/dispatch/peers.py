"""The peers, each started with N engines or kernels: ipyparallel (``ipp``, and ``ipp-nb``: ``%%px``
in a kernel) and jupyter-distributed (``jd``, and ``jd-nb``: its notebook kernel). jupyter-distributed
is kept out of the venv (see ``benchmarks/README.md``); without it those rows say why they are
missing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ipyparallel

from benchmarks.dispatch.results import ENGINE_TIMEOUT, FIRST_CELL, NOOP
from benchmarks.dispatch.timing import INTERRUPTS, KernelProbe, time_loops

try:  # the report names jupyter_distributed's version and where it came from
    import jupyter_distributed  # noqa: F401
    from jupyter_distributed.kernel_group import DistributedKernelGroup

    JD_MISSING = ""
except ImportError as exc:  # kept out of the venv (its server extension takes over %%rank in JupyterLab)
    JD_MISSING = (
        f"jupyter-distributed is not importable ({exc}); see benchmarks/README.md for running with it "
        "from a folder outside the venv"
    )


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
