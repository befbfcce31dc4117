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
Run: ``.venv/bin/python benchmarks/transfer.py [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from _running import other_runs
from run_all import cpu

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "transfer.md"
MIB = 1 << 20
GB = 1e9
RATE_TARGET = 4.0  # GB/s, issue 23, at 256 MiB
RATIO_TARGET = 10.0  # × ipyparallel's rate
RSS_TARGET = 1.2  # GiB of kernel peak RSS for 1 GiB to 4 ranks, or from one
IDLE, IDLE_SIZE = 5.0, 256  # s of pause before each "after idle" run, and at what size (MiB)

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


def report(res: dict[Any, Any], args: argparse.Namespace, machine: dict[str, Any], plots: list[str]) -> str:
    import ipyparallel
    import torch

    lines = [
        "# Moving values: push and pull against ipyparallel and memcpy",
        "",
        f"Produced by `.venv/bin/python benchmarks/transfer.py {' '.join(machine['argv'])}`; rates in GB/s "
        f"(10^9 bytes/s), median of {args.repeats} ({args.big_repeats} at 1 GiB) after one untimed run; "
        "push counts what all ranks received (N × size). How to read it: the docstring of the script.",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; whole run {machine['seconds']:.0f} s",
        f"- CPU: {cpu()}; {platform.platform()}; Python {platform.python_version()}",
        f"- torch {torch.__version__}, ipyparallel {ipyparallel.__version__}",
        f"- Load average before / after: {machine['loads']}; other runs seen: {machine['others'] or 'none'}",
        "",
    ]
    for n in args.ranks:
        lines += [
            f"## {n} ranks",
            "",
            "| size | push | ipyparallel push | ratio | pull | ipyparallel pull | ratio | push, messages | "
            "pull, messages | memcpy warm / fresh |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for size in args.sizes:
            row = res.get(n, {}).get(size, {})
            warm, fresh = res.get("memcpy", {}).get(size, (0.0, 0.0))
            lines.append(
                f"| {size} MiB | {_f(row, 'push')} | {_f(row, 'ipp-push')} | {_ratio(row, 'push')} | "
                f"{_f(row, 'pull')} | {_f(row, 'ipp-pull')} | {_ratio(row, 'pull')} | "
                f"{_f(row, 'push-msg')} | {_f(row, 'pull-msg')} | {warm:.1f} / {fresh:.1f} |"
            )
        lines.append("")
        idle = res.get(n, {}).get(IDLE_SIZE, {})
        if "push-idle" in idle:
            lines += [
                f"After {IDLE:.0f} s idle before each (as between notebook cells), {IDLE_SIZE} MiB: push "
                f"{idle['push-idle']:.2f} GB/s, pull {idle['pull-idle']:.2f} GB/s; memcpy into fresh "
                f"memory {res.get('memcpy-idle', 0.0):.2f} GB/s (back to back: {_f(idle, 'push')}, "
                f"{_f(idle, 'pull')} and {res.get('memcpy', {}).get(IDLE_SIZE, (0.0, 0.0))[1]:.2f}).",
                "",
            ]
        gathered = [(s, res.get(n, {}).get(s, {})) for s in args.gather_sizes]
        if any(any(k.startswith("gather-") for k in row) for _, row in gathered):
            lines += [
                "| gathered pull | to the kernel, GB/s | all-gather on the ranks, s | whole call, s | "
                "first call past its all-gather, s |",
                "|---|---:|---:|---:|---:|",
            ]
            for size, row in gathered:
                for label in ("fsdp", "ZeRO-3"):
                    if f"gather-{label}" in row:
                        rate, gather, total, first = row[f"gather-{label}"]
                        lines.append(
                            f"| {label}, {size} MiB | {rate:.2f} | {gather:.2f} | {total:.2f} | {first:.2f} |"
                        )
            lines.append("")
        big = res.get(n, {}).get(max(args.sizes), {})
        if "rss-push" in big:
            lines += [
                f"Kernel peak RSS above its RSS before, {max(args.sizes)} MiB: push to {n} ranks "
                f"{big['rss-push'] / 2**30:.2f} GiB, pull {big['rss-pull'] / 2**30:.2f} GiB "
                "(the pulled value itself included, every page read). A push is copied from the value "
                "itself into memory each rank offers: the kernel holds no copy of it.",
                "",
            ]
    tcp = res.get("tcp", {})
    if tcp:
        lines += [
            "## Over TCP: a torchrun pool of two one-rank nodes on this machine, shared memory off",
            "",
            "The path of ranks on other machines: values in 16 MiB parts, each acknowledged, over the "
            "pool's CurveZMQ-encrypted TCP socket.",
            "",
            "| size | push to 2 ranks | pull |",
            "|---|---:|---:|",
            *[f"| {size} MiB | {_f(row, 'push')} | {_f(row, 'pull')} |" for size, row in sorted(tcp.items())],
            "",
        ]
    if res.get("refused"):
        lines += ["Not measured: the pull was refused (the machine had no room for it then):", ""]
        lines += [f"- {line}" for line in res["refused"]] + [""]
    lines += [f"![Transfer rates]({p})" for p in plots] + [""]
    goals = targets(res, args)
    lines += [
        "## Targets (issue 23), computed from the numbers above",
        "",
        "| target | measured | |",
        "|---|---:|---|",
    ]
    lines += [f"| {name} | {value} | {ok} |" for name, value, ok in goals]
    lines += [""] + [f"<!-- target: {name} | {value} | {ok} -->" for name, value, ok in goals]
    return "\n".join(lines) + "\n"


def _f(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "–"


def _ratio(row: dict[str, Any], what: str) -> str:
    if what in row and f"ipp-{what}" in row and row[f"ipp-{what}"] > 0:
        return f"{row[what] / row[f'ipp-{what}']:.1f}×"
    return "–"


def targets(res: dict[Any, Any], args: argparse.Namespace) -> list[tuple[str, str, str]]:
    out = []
    for n in args.ranks:
        row = res.get(n, {}).get(256, {})
        for what, label in (("push", f"push to {n} ranks"), ("pull", f"pull ({n}-rank pool)")):
            if what not in row or (what == "pull" and n != args.ranks[0]):
                continue
            rate = row[what]
            out.append(
                (f"256 MiB {label} ≥ {RATE_TARGET:.0f} GB/s", f"{rate:.2f} GB/s", _met(rate >= RATE_TARGET))
            )
            if f"ipp-{what}" in row:
                ratio = rate / row[f"ipp-{what}"]
                out.append(
                    (f"256 MiB {label} ≥ 10× ipyparallel", f"{ratio:.1f}×", _met(ratio >= RATIO_TARGET))
                )
        big = res.get(n, {}).get(1024, {})
        if n == 4 and "rss-push" in big:
            for what in ("push", "pull"):
                rise = big[f"rss-{what}"] / 2**30
                out.append(
                    (
                        f"Kernel peak RSS, 1 GiB {what}, 4 ranks ≤ {RSS_TARGET} GiB",
                        f"{rise:.2f} GiB",
                        _met(rise <= RSS_TARGET),
                    )
                )
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def plot(res: dict[Any, Any], args: argparse.Namespace, folder: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for ax, what in zip(axes, ("push", "pull"), strict=True):
        for n, style in zip(args.ranks, ("o-", "s--", "^:"), strict=False):
            rows = res.get(n, {})
            sizes = [s for s in args.sizes if what in rows.get(s, {})]
            for key, colour, label in (
                (what, "tab:blue", "jupyter_shard"),
                (f"ipp-{what}", "tab:red", "ipyparallel"),
                (f"{what}-msg", "tab:cyan", "jupyter_shard, messages"),
            ):
                xs = [s for s in sizes if key in rows[s]]
                if xs:
                    ax.plot(xs, [rows[s][key] for s in xs], style, color=colour, label=f"{label}, {n} ranks")
        memcpy = res.get("memcpy", {})
        xs = sorted(memcpy)
        ax.plot(xs, [memcpy[s][0] for s in xs], "k-", lw=0.8, label="memcpy, warm")
        ax.plot(xs, [memcpy[s][1] for s in xs], "k--", lw=0.8, label="memcpy, fresh memory")
        ax.axhline(RATE_TARGET, color="black", ls=":", lw=0.8, label=f"{RATE_TARGET:.0f} GB/s target")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(args.sizes, [f"{s} MiB" for s in args.sizes])
        ax.set_title("push: what all ranks received together" if what == "push" else "pull from rank 0")
        ax.set_ylabel("GB/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / f"{stem}-rates.png", dpi=120)
    plt.close(fig)
    return [f"{stem}-rates.png"]


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
    parser.add_argument("--results", default=str(RESULTS), help="markdown file to write; - only prints")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.sizes, args.gather_sizes, args.repeats, args.big_repeats = [2], [64], [64], 2, 1
    args.sizes.sort()
    loads, others, t0 = os.getloadavg(), other_runs(), time.monotonic()
    res: dict[Any, Any] = {}
    measure_memcpy(args, res)
    if args.tcp:
        measure_tcp(args, res)
    for n in args.ranks:
        measure_shard(n, args, res)
        if args.ipp:
            measure_ipp(n, args, res)
        if args.gather_sizes:
            measure_gather(n, args, res)
        others |= other_runs()
    machine = {
        "argv": sys.argv[1:] if argv is None else argv,
        "loads": " / ".join(" ".join(f"{v:.2f}" for v in pair) for pair in (loads, os.getloadavg())),
        "others": ", ".join(sorted(others)),
        "seconds": time.monotonic() - t0,
    }
    plots: list[str] = []
    if args.results != "-":
        folder = Path(args.results).parent
        folder.mkdir(parents=True, exist_ok=True)
        plots = plot(res, args, folder, Path(args.results).stem)
    text = report(res, args, machine, plots)
    print(text)
    if args.results != "-":
        Path(args.results).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
