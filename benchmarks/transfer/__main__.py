"""Moving values between the kernel and the ranks: jupyter_shard against ipyparallel and memcpy, in one run.

For each rank count N (``--ranks``, default 2 4) and size S (``--sizes`` in MiB, default 64 256
1024), all on this machine, median of ``--repeats`` timed runs (``--big-repeats`` at 1 GiB) after
one untimed run:

* **push**: ``Pool.push(x=x)`` of a float32 CPU tensor of S bytes to all N ranks; ipyparallel:
  ``view.push({"x": a}, block=True)`` of a numpy array of the same bytes over a DirectView of N
  engines (numpy is ipyparallel's zero-copy path; a tensor would be pickled). Rate: N × S / time,
  what every rank received together.
* **pull**: ``Pool.pull("y")`` of a tensor rank 0 made itself; ipyparallel: ``client[0].pull("y")``
  of an array engine 0 made. Rate: S / time.
* **push, messages** / **pull, messages**: the same with ``JUPYTER_SHARD_SHARED_MEMORY=0``, the path
  of ranks on other machines (the values in signed message frames over the pool's socket, in 16 MiB
  parts); **over TCP**: that path on a torchrun pool of two one-rank "nodes" on this machine.
* **gathered pull**: ``Pool.pull("model", gather=True)`` of a model of S bytes of fp32 parameters
  prepared with ``fsdp`` and with DeepSpeed ZeRO-3 (``--gather-sizes``); the all-gather's own time,
  as rank 0 measured it, is reported beside the transfer's (the rest of the call), and the first
  call's rest on its own (it is left out of the median as every first run is).
* **memcpy floor**: ``dst.copy_(src)`` into memory touched before (warm) and into a fresh tensor,
  which is what a transfer must fill.
* **after idle**: at 256 MiB, the push, the pull and the fresh memcpy again, each run after 5 s of
  nothing (medians of 3), as cells in a notebook are spaced: on a VM that hands freed memory back to
  its host, memory that lay free that long fills several times slower than memory freed just before,
  so back-to-back medians alone would flatter every row.

Kernel peak RSS: this process is the kernel; its peak (``VmHWM``, reset through ``/proc/self/clear_refs``)
above its RSS before one push of the largest size to N ranks, and one pull of it. Writes ``--results``
(default ``benchmarks/results/transfer.md``) and ``transfer-rates.png`` beside it.
Run: ``.venv/bin/python -m benchmarks.transfer [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, LoadWatch, format_loads, write_section
from benchmarks.transfer.report import IDLE, IDLE_SIZE, plot, report

MIB = 1 << 20
GB = 1e9

MODEL = """
import time, torch
from torch import nn
def _bench_model(nbytes):
    width = 1024
    layers = max(1, nbytes // (4 * width * (width + 1)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
torch.manual_seed(0)
net = _bench_model({nbytes})
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model, opt = shard.prepare(net, opt)
del net
"""


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # untimed: first-touch and caches
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def peak_rise(fn: Callable[[], object]) -> float:
    """Bytes by which this process's peak RSS rose above its RSS while ``fn`` ran."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status()["VmRSS"]
    kept = fn()
    rise = _status()["VmHWM"] - before
    del kept
    return float(rise)


def touched(value: Any) -> Any:
    """``value``, every page of it read (a mapped value's pages count in RSS once touched)."""
    float(value.sum())
    return value


@contextlib.contextmanager
def shared_memory(on: bool) -> Iterator[None]:
    from jupyter_shard.env import SHARED_MEMORY_VAR

    old = os.environ.get(SHARED_MEMORY_VAR)
    os.environ[SHARED_MEMORY_VAR] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SHARED_MEMORY_VAR, None)
        else:
            os.environ[SHARED_MEMORY_VAR] = old


def repeats_for(size: int, args: argparse.Namespace) -> int:
    return int(args.big_repeats if size >= 1024 else args.repeats)


def measure_shard(n: int, args: argparse.Namespace, res: dict[Any, Any]) -> None:
    import torch

    from jupyter_shard import Pool
    from jupyter_shard.pool.output import ConsoleSink

    with (
        tempfile.TemporaryDirectory(prefix="jsbench-") as tmp,
        Pool(nproc=n, device="cpu", log_dir=tmp, sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool,
    ):
        for size in args.sizes:
            x = torch.randn(size * MIB // 4)
            pool.run(f"import torch; y = torch.randn({size * MIB // 4})", ranks=[0])
            reps = repeats_for(size, args)
            row = res.setdefault(n, {}).setdefault(size, {})
            push, pull = partial(pool.push, x=x), partial(pool.pull, "y")
            row["push"] = n * size * MIB / median_time(push, reps) / GB
            row["pull"] = size * MIB / median_time(pull, reps) / GB
            if size == IDLE_SIZE:
                row["push-idle"] = n * size * MIB / after_idle(push) / GB
                row["pull-idle"] = size * MIB / after_idle(pull) / GB
            if args.messages and size <= 256:
                with shared_memory(False):
                    row["push-msg"] = n * size * MIB / median_time(push, reps) / GB
                    row["pull-msg"] = size * MIB / median_time(pull, reps) / GB
            if size == max(args.sizes):
                pool.run("del x")
                row["rss-push"] = peak_rise(push)
                row["rss-pull"] = peak_rise(lambda: touched(pool.pull("y")))
            pool.run("del x")
            pool.run("del y", ranks=[0])
            del x
            print(f"shard, {n} ranks, {size} MiB: {row}", flush=True)


def measure_tcp(args: argparse.Namespace, res: dict[Any, Any]) -> None:
    """Push and pull over TCP: a torchrun pool of two one-rank "nodes" on this machine, with shared
    memory off, so the values take the path of ranks on other machines (in parts, CurveZMQ-encrypted)."""
    import torch

    from jupyter_shard import Pool
    from jupyter_shard.launchers import resolve_spec
    from jupyter_shard.pool.output import ConsoleSink

    spec = resolve_spec(nproc=1, device="cpu", launcher="torchrun", hosts="localhost,localhost")
    with (
        shared_memory(False),
        tempfile.TemporaryDirectory(prefix="jsbench-") as tmp,
        Pool(spec=spec, log_dir=tmp, sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool,
    ):
        for size in [s for s in args.sizes if s <= 256]:
            x = torch.randn(size * MIB // 4)
            pool.run(f"import torch; y = torch.randn({size * MIB // 4})", ranks=[0])
            push, pull = partial(pool.push, x=x), partial(pool.pull, "y")
            row = res.setdefault("tcp", {}).setdefault(size, {})
            row["push"] = 2 * size * MIB / median_time(push, args.repeats) / GB
            row["pull"] = size * MIB / median_time(pull, args.repeats) / GB
            pool.run("del x")
            print(f"TCP (torchrun, 2 nodes here), {size} MiB: {row}", flush=True)


def measure_gather(n: int, args: argparse.Namespace, res: dict[Any, Any]) -> None:
    from jupyter_shard import Pool
    from jupyter_shard.errors import PoolError
    from jupyter_shard.pool.output import ConsoleSink
    from jupyter_shard.spec import LaunchSpec

    for label, strategy, options in (("fsdp", "fsdp", {}), ("ZeRO-3", "deepspeed", {"zero_stage": 3})):
        spec = LaunchSpec.create(nproc=n, device="cpu", strategy=strategy, **options)  # type: ignore[arg-type]
        with (
            tempfile.TemporaryDirectory(prefix="jsbench-") as tmp,
            Pool(spec=spec, log_dir=tmp, sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool,
        ):
            for size in args.gather_sizes:
                pool.run(MODEL.format(nbytes=size * MIB), timeout=900)
                totals, gathers, nbytes = [], [], 0
                for _ in range(repeats_for(size, args) + 1):
                    t0 = time.perf_counter()
                    try:
                        model = pool.pull("model", gather=True)
                    except PoolError as exc:  # no room on a busy machine: said, not measured
                        res.setdefault("refused", []).append(f"{label}, {n} ranks, {size} MiB: {exc}")
                        break
                    totals.append(time.perf_counter() - t0)
                    last = pool.values.last
                    assert last is not None
                    gathers.append(last.gather)
                    nbytes = sum(p.nbytes for p in model.parameters())
                    del model
                pool.run("del model, opt", timeout=300)
                if len(totals) < 2:
                    continue
                total, gather = statistics.median(totals[1:]), statistics.median(gathers[1:])
                row = res.setdefault(n, {}).setdefault(size, {})
                first = totals[0] - gathers[0]  # the model's first pull: the kernel's first huge pages too
                row[f"gather-{label}"] = (nbytes / max(total - gather, 1e-9) / GB, gather, total, first)
                print(f"{label}, {n} ranks, {size} MiB: {row[f'gather-{label}']}", flush=True)


def measure_ipp(n: int, args: argparse.Namespace, res: dict[Any, Any]) -> None:
    import ipyparallel
    import numpy as np

    profile = Path(tempfile.mkdtemp(prefix="ipp-profile-"))
    cluster = ipyparallel.Cluster(n=n, profile_dir=str(profile), log_level=logging.WARNING)
    client: Any = None
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(n, timeout=180)
        view, first = client[:], client[0]
        for size in args.sizes:
            a = np.random.default_rng(0).standard_normal(size * MIB // 4, dtype=np.float32)
            first.execute(f"import numpy as np; y = np.ones({size * MIB // 4}, dtype=np.float32)", block=True)
            reps = repeats_for(size, args)
            row = res.setdefault(n, {}).setdefault(size, {})
            push = partial(view.push, {"x": a}, block=True)
            row["ipp-push"] = n * size * MIB / median_time(push, reps) / GB
            row["ipp-pull"] = size * MIB / median_time(lambda: first.pull("y", block=True), reps) / GB
            view.execute("x = y = None", block=True)
            del a
            print(f"ipyparallel, {n} engines, {size} MiB: {row}", flush=True)
    finally:
        if client is not None:
            client.close()
        cluster.stop_cluster_sync()
        shutil.rmtree(profile, ignore_errors=True)


def fresh_copy(src: Any) -> Any:
    import torch

    return torch.empty_like(src).copy_(src)


def after_idle(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of ``fn`` run after :data:`IDLE` s of nothing each time, as between notebook
    cells: on some machines (a VM that hands freed memory back to its host) memory that lay free
    that long costs several times more to fill again than memory freed just before."""
    samples = []
    for _ in range(repeats):
        time.sleep(IDLE)
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_memcpy(args: argparse.Namespace, res: dict[Any, Any]) -> None:
    import torch

    for size in args.sizes:
        src = torch.randn(size * MIB // 4)
        warm = torch.empty_like(src)
        reps = repeats_for(size, args)
        res.setdefault("memcpy", {})[size] = (
            size * MIB / median_time(partial(warm.copy_, src), reps) / GB,
            size * MIB / median_time(partial(fresh_copy, src), reps) / GB,
        )
        if size == IDLE_SIZE:
            res["memcpy-idle"] = size * MIB / after_idle(partial(fresh_copy, src)) / GB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="MiB")
    parser.add_argument(
        "--gather-sizes", type=int, nargs="*", default=[64, 256, 1024], help="MiB; none skips"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--big-repeats", type=int, default=3, help="repeats at 1 GiB and over")
    parser.add_argument("--no-messages", dest="messages", action="store_false", help="skip the message path")
    parser.add_argument("--no-ipp", dest="ipp", action="store_false", help="skip ipyparallel")
    parser.add_argument("--no-tcp", dest="tcp", action="store_false", help="skip the TCP (torchrun) pool")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, 64 MiB, 2 repeats")
    parser.add_argument(
        "--results", default=str(RESULTS / "transfer.md"), help="markdown file to write; - only prints"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.sizes, args.gather_sizes, args.repeats, args.big_repeats = [2], [64], [64], 2, 1
    args.sizes.sort()
    res: dict[Any, Any] = {}
    with LoadWatch() as watch:
        measure_memcpy(args, res)
        if args.tcp:
            measure_tcp(args, res)
        for n in args.ranks:
            measure_shard(n, args, res)
            if args.ipp:
                measure_ipp(n, args, res)
            if args.gather_sizes:
                measure_gather(n, args, res)
    machine = {
        "argv": sys.argv[1:] if argv is None else argv,
        "loads": f"{format_loads(watch.before)} / {format_loads(watch.after)}",
        "others": ", ".join(sorted(watch.others)),
        "seconds": watch.seconds,
    }
    plots: list[str] = []
    if args.results != "-":
        folder = Path(args.results).parent
        folder.mkdir(parents=True, exist_ok=True)
        plots = plot(res, args, folder, Path(args.results).stem)
    write_section(report(res, args, machine, plots), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
