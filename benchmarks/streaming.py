"""Ranks flooding output while they train: what reaches the notebook, what the kernel pays, what is on disk.

A real kernel (jupyter_client ``KernelManager``, as in ``tests/conftest.py``) loads the extension and
starts ``%%distributed --nproc 2 --device cpu --strategy ddp``. Every rank trains a small MLP with DDP
in its main thread. Each cell has three blocks, their order rotated from cell to cell:

* **baseline**: training steps alone;
* **flood**: the same training while a thread on each rank prints ``--lines`` numbered lines (about
  60 bytes each, one ``print`` per line, paced over ``--seconds``) to the rank's ``sys.stdout`` and
  calls ``shard.log`` ``--log-rate`` times a second for as long as it prints;
* **plain**: the same flood with ``print`` writing to a plain buffered file, as a torchrun worker
  with redirected output would (``shard.log`` unchanged): what printing this much costs anywhere.

Every block trains until every rank's flood has ended (an ``all_reduce`` of a flag every 25 steps,
in all blocks alike). The cells run twice: first as a plain notebook sees them (rank lines as cell
streams), then with a stand-in for the JupyterLab extension (the ``jupyter_shard`` comm opened and
polled every 2 s as its panel does - never with a request still unanswered - rank lines as one
display updated in place).

Measured in the same run: training step time in each block (slowdown); iopub messages
a notebook receives (``stream``, ``display_data``, ``update_display_data``, ``comm_msg``) per
1-second bin; the kernel process's CPU time (psutil, its own threads, not the ranks); every flood
line counted in each rank's log file; ``shard.log`` records in ``jupyter_shard.history()``. Writes
``benchmarks/results/streaming.md`` and ``streaming-timeline.png``.
Run: ``.venv/bin/python benchmarks/streaming.py [--lines 1000000 --seconds 15 --repeats 2]``.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import zmq
from _running import other_runs
from jupyter_client.manager import KernelManager

RESULTS = Path(__file__).resolve().parent / "results"
UI_TYPES = ("stream", "display_data", "update_display_data", "comm_msg")
MODES = {"notebook": "plain notebook (cell streams)", "lab": "JupyterLab extension attached"}
TARGET_MSGS, TARGET_CPU = 20, 10.0

SETUP = """%%distributed --nproc {nproc} --device cpu --strategy ddp --no-dashboard
import json, psutil, threading, time, torch, torch.distributed as dist
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear({width}, {width}), nn.ReLU(), nn.Linear({width}, {width}), nn.ReLU(),
                      nn.Linear({width}, 1))
model, opt = shard.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
x, y = torch.randn({batch}, {width}), torch.randn({batch}, 1)
TEXT = " loss=0.693147 lr=3.0e-04 grad_norm=1.234567 tok/s=123456.7"

def train_step():
    loss = (model(x) - y).pow(2).mean()
    shard.backward(loss)
    shard.step()

def flood(tag, lines, seconds, log_rate, out, file=None):
    out["start"] = time.time()
    t0 = time.perf_counter()
    printed = logged = 0
    while printed < lines:
        now = time.perf_counter() - t0
        due_lines = min(lines, int(lines * now / seconds) + 1)
        upto = min(due_lines, printed + 1000)  # behind schedule: catch up in slices, keep logging
        for i in range(printed, upto):
            print(f"{{tag}} {{i:07d}}{{TEXT}}", file=file)
        printed = upto
        due = int(now * log_rate)
        for _ in range(logged, due):
            shard.log(flood_loss=0.5)
        logged = max(logged, due)
        if printed >= due_lines:
            time.sleep(0.0005)
    if file is not None:
        file.close()
    out.update(end=time.time(), printed=printed, logged=logged)

def block(kind, tag, lines, seconds, log_rate, out_dir):
    stats, stamps, thread = {{}}, [], None
    if kind != "baseline":
        plain = open(f"{{out_dir}}/plain-rank-{{shard.rank}}.log", "w") if kind == "plain" else None
        args = (f"{{tag}}-{{kind}}", lines, seconds, log_rate, stats, plain)
        thread = threading.Thread(target=flood, args=args, daemon=True)
        thread.start()
    start, step, going = time.time(), 0, torch.ones(1)
    while going.item() > 0:
        t = time.perf_counter()
        train_step()
        stamps.append((time.time(), time.perf_counter() - t))
        step += 1
        if step % 25 == 0:
            going = torch.tensor([float(thread is not None and thread.is_alive() or step < BASE_STEPS)])
            dist.all_reduce(going, op=dist.ReduceOp.MAX)
    if thread is not None:
        thread.join()
    end = stats.get("end", time.time())
    return {{"start": start, "end": end, "times": [d for t, d in stamps if t <= end], **stats}}

def repeat(tag, order, lines, seconds, log_rate, out_dir):
    blocks = {{kind: block(kind, tag, lines, seconds, log_rate, out_dir) for kind in order}}
    rss = psutil.Process().memory_info().rss
    with open(f"{{out_dir}}/rank-{{shard.rank}}-{{tag}}.json", "w") as fh:
        json.dump({{"rank": shard.rank, "tag": tag, "rss": rss, "rss_setup": RSS_SETUP, **blocks}}, fh)

for _ in range(100):
    train_step()
t0 = time.perf_counter()
for _ in range(200):
    train_step()
per_step = torch.tensor([(time.perf_counter() - t0) / 200])
dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
BASE_STEPS = max(25, int({baseline_s} / per_step.item()) // 25 * 25)
RSS_SETUP = psutil.Process().memory_info().rss
"""
REPEAT = "%%distributed\nrepeat({tag!r}, {order!r}, {lines}, {seconds}, {log_rate}, {out!r})\n"
BLOCKS = ("baseline", "flood", "plain")


@dataclass
class Kernel:
    """A kernel subprocess and one client; every iopub message is kept with its arrival time."""

    log_root: Path
    messages: list[tuple[float, str, str]] = field(default_factory=list)  # time, type, what it carried

    def __post_init__(self) -> None:
        self.km = KernelManager(kernel_name="python3")
        cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        self.km.kernel_cmd = cmd  # type: ignore[attr-defined]
        env = {
            **os.environ,
            "JUPYTER_SHARD_LOG_DIR": str(self.log_root),
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        }
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.poller = zmq.Poller()
        self.poller.register(self.kc.iopub_channel.socket, zmq.POLLIN)
        self.poller.register(self.kc.shell_channel.socket, zmq.POLLIN)
        self.panel: str | None = None
        self.panel_waiting = False

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.process.pid)  # type: ignore[union-attr]

    def open_panel(self) -> None:
        """Open the ``jupyter_shard`` comm as the JupyterLab extension's panel does."""
        self.panel = uuid.uuid4().hex
        content = {"comm_id": self.panel, "target_name": "jupyter_shard", "data": {"request": "status"}}
        self.kc.shell_channel.send(self.kc.session.msg("comm_open", content))
        self.panel_waiting = True

    def _poll_panel(self) -> None:
        """Ask for the status, unless a request is still unanswered (labextension/src/client.ts)."""
        if self.panel_waiting:
            return
        content = {"comm_id": self.panel, "data": {"request": "status"}}
        self.kc.shell_channel.send(self.kc.session.msg("comm_msg", content))
        self.panel_waiting = True

    def execute(self, code: str, timeout: float = 900.0) -> str:
        """Run a cell and return its stdout; raise on an error. Polls the panel every 2 s if open."""
        msg_id = self.kc.execute(code)
        out: list[str] = []
        replied = idle = False
        deadline, next_poll = time.monotonic() + timeout, time.monotonic() + 2.0
        while not (replied and idle):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell still running after {timeout:.0f} s:\n{code}")
            if self.panel is not None and time.monotonic() >= next_poll:
                self._poll_panel()
                next_poll += 2.0
            self.poller.poll(100)
            while self.kc.shell_channel.msg_ready():
                reply = self.kc.shell_channel.get_msg(timeout=0)
                replied = replied or reply["parent_header"].get("msg_id") == msg_id
            while self.kc.iopub_channel.msg_ready():
                msg = self.kc.iopub_channel.get_msg(timeout=0)
                kind, content = msg["msg_type"], msg["content"]
                self.messages.append((time.time(), kind, _detail(kind, content)))
                if kind == "comm_msg" and content.get("comm_id") == self.panel:
                    self.panel_waiting = False
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if kind == "error":
                    raise RuntimeError("\n".join(content["traceback"]))
                if kind == "stream" and content["name"] == "stdout":
                    out.append(content["text"])
                idle = idle or (kind == "status" and content["execution_state"] == "idle")
        return "".join(out)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _detail(kind: str, content: dict[str, Any]) -> str:
    """What a UI message carried: a widget method or panel reply, a display's kind, a stream's name."""
    if kind == "comm_msg":
        data = content.get("data", {})
        return str(data.get("method") or data.get("reply") or "")
    if kind in ("display_data", "update_display_data"):
        data = content.get("data", {})
        if "application/vnd.jupyter-shard.rank-output+json" in data:
            return "rank lines"
        if "application/vnd.jupyter-shard.figure+json" in data:
            return "dashboard figure"
        return (
            "widget"
            if "application/vnd.jupyter.widget-view+json" in data
            else "text/html" * ("text/html" in data)
        )
    return str(content.get("name", "")) if kind == "stream" else ""


class CpuSampler(threading.Thread):
    """The kernel process's CPU seconds (user + system, all its threads), sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []
        self.loads: list[float] = []  # 1-minute load average, every 5 s
        self.others: set[str] = set()  # other test or benchmark runs seen meanwhile
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            times = self.proc.cpu_times()
            self.samples.append((time.time(), times.user + times.system))
            if len(self.samples) % 25 == 1:
                self.loads.append(os.getloadavg()[0])
                self.others |= other_runs()
            self.stopped.wait(0.2)

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds the kernel used between two wall-clock times (linear between samples)."""
        return _interp(self.samples, end) - _interp(self.samples, start)


def _interp(samples: list[tuple[float, float]], t: float) -> float:
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0 or 1.0)
    return samples[-1][1] if t > samples[-1][0] else samples[0][1]


def count_flood_lines(log: Path, tags: list[str], lines: int) -> dict[str, int]:
    """Distinct flood line numbers per tag found in one rank's log file."""
    seen = {tag: bytearray(lines) for tag in tags}
    prefixes = tuple(tag.encode() + b" " for tag in tags)
    with log.open("rb") as fh:
        for line in fh:
            if line.startswith(prefixes):
                tag, number = line.split(b" ", 2)[:2]
                seen[tag.decode()][int(number)] = 1
    return {tag: marks.count(1) for tag, marks in seen.items()}


def busiest_window(stamps: list[float], start: float, end: float) -> tuple[float, int]:
    """Where the 1-second window holding the most stamps starts (at a stamp in the span), and how many."""
    inside = sorted(t for t in stamps if start <= t < end)
    counts = [(bisect.bisect_left(inside, t + 1.0) - i, -t) for i, t in enumerate(inside)]
    n, at = max(counts, default=(0, -start))
    return -at, n


def per_second(stamps: list[float], start: float, end: float) -> list[int]:
    bins = [0] * max(1, int(end - start + 0.999))
    for t in stamps:
        if start <= t < end:
            bins[int(t - start)] += 1
    return bins


def machine_line(load_before: tuple[float, float, float], load_after: tuple[float, float, float]) -> str:
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {platform.platform()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; load average (1 min) before "
        f"{load_before[0]:.2f}, after {load_after[0]:.2f}"
    )


def target_line(name: str, value: str, met: bool) -> str:
    """The machine-readable target line that benchmarks/README.md describes."""
    return f"<!-- target: {name} | {value} | {'met' if met else 'not met'} -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines each rank prints per flood")
    parser.add_argument("--seconds", type=float, default=15.0, help="what one flood is paced to last")
    parser.add_argument("--log-rate", type=int, default=10_000, help="shard.log calls per second per rank")
    parser.add_argument("--baseline-seconds", type=float, default=5.0, help="length of a no-flood block")
    parser.add_argument("--repeats", type=int, default=2, help="cells per mode")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--results", default=str(RESULTS / "streaming.md"), help="'-' prints only")
    parser.add_argument("--quick", action="store_true", help="smoke run: 50k lines over 3 s, 1 cell per mode")
    parser.add_argument("--keep", action="store_true", help="keep the rank logs (~0.75 GB) and raw samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.lines, args.seconds, args.repeats, args.baseline_seconds = 50_000, 3.0, 1, 1.0
    began, load_before = time.monotonic(), os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="jsbench-stream-"))
    (scratch / "out").mkdir()
    kernel = Kernel(scratch / "logs")
    sampler = CpuSampler(kernel.pid)
    sampler.start()
    tags: dict[str, list[str]] = {mode: [] for mode in args.modes}
    spans: dict[str, tuple[float, float]] = {}
    try:
        kernel.execute("%load_ext jupyter_shard")
        setup = SETUP.format(
            nproc=args.nproc, width=args.width, batch=args.batch, baseline_s=args.baseline_seconds
        )
        kernel.execute(setup)
        for mode in args.modes:
            if mode == "lab":
                kernel.open_panel()
            started = time.time()
            for i in range(args.repeats):
                tag = f"{mode}{i}"
                tags[mode].append(tag)
                shift = sum(map(len, tags.values())) - 1  # rotate the block order from cell to cell
                order = BLOCKS[shift % 3 :] + BLOCKS[: shift % 3]
                print(f"[{mode}] cell {i + 1}/{args.repeats}: {', '.join(order)} …", flush=True)
                cell = REPEAT.format(
                    tag=tag,
                    order=order,
                    lines=args.lines,
                    seconds=args.seconds,
                    log_rate=args.log_rate,
                    out=str(scratch / "out"),
                )
                kernel.execute(cell)
            spans[mode] = (started, time.time())
        history = kernel.execute("import jupyter_shard\nprint(len(jupyter_shard.history()))")
    finally:
        sampler.stopped.set()
        kernel.close()
    records = [
        json.loads((scratch / "out" / f"rank-{r}-{t}.json").read_text())
        for ts in tags.values()
        for t in ts
        for r in range(args.nproc)
    ]
    flood_tags = [f"{t}-flood" for ts in tags.values() for t in ts]
    logs = sorted((scratch / "logs").glob("*/rank-*.log"))
    on_disk = {int(p.stem.split("-")[1]): count_flood_lines(p, flood_tags, args.lines) for p in logs}
    (scratch / "messages.json").write_text(json.dumps(kernel.messages))
    (scratch / "cpu.json").write_text(json.dumps(sampler.samples))
    summary = {
        "modes": {mode: summarise_mode(tags[mode], spans[mode], records, kernel, sampler) for mode in tags},
        "on_disk": on_disk,
        "lost": {rank: sum(args.lines - n for n in counts.values()) for rank, counts in on_disk.items()},
        "history": int(history.strip()),
        "rss_growth": {  # records are in cell order: the last of a rank is its last cell
            rank: [r["rss"] - r["rss_setup"] for r in records if r["rank"] == rank][-1]
            for rank in range(args.nproc)
        },
        "logged": sum(r[k]["logged"] for r in records for k in ("flood", "plain")),
        "spans": spans,
        "tags": tags,
        "run_s": time.monotonic() - began,
        "loads": sampler.loads or [os.getloadavg()[0]],
        "others": sampler.others,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    text = report(args, summary)
    print(text)
    if args.results != "-":
        path = Path(args.results)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        plot(summary, kernel.messages, sampler.samples, path.with_name("streaming-timeline.png"))
    if args.keep:
        print(f"rank logs, per-cell records, iopub messages and CPU samples: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _windows(records: list[dict[str, Any]], tags: list[str], kind: str) -> list[tuple[float, float]]:
    """Per cell, from the first rank's start of a block to the last rank's end of it."""
    return [
        (
            min(r[kind]["start"] for r in records if r["tag"] == t),
            max(r[kind]["end"] for r in records if r["tag"] == t),
        )
        for t in tags
    ]


def _ratio(records: list[dict[str, Any]], over: str, under: str) -> list[float]:
    return [statistics.median(r[over]["times"]) / statistics.median(r[under]["times"]) for r in records]


def summarise_mode(
    tags: list[str],
    span: tuple[float, float],
    all_records: list[dict[str, Any]],
    kernel: Kernel,
    sampler: CpuSampler,
) -> dict[str, Any]:
    records = [r for r in all_records if r["tag"] in tags]
    ui = [m for m in kernel.messages if m[1] in UI_TYPES]
    stamps = [t for t, _, _ in ui]
    floods = _windows(records, tags, "flood")
    flood_s = sum(b - a for a, b in floods)
    busiest_at, busiest = busiest_window(stamps, *span)
    in_floods = Counter(kind for t, kind, _ in ui if any(a <= t < b for a, b in floods))
    flood_records = [r["flood"] for r in records]
    return {
        "step": {k: statistics.median(d for r in records for d in r[k]["times"]) for k in BLOCKS},
        "slowdown": _ratio(records, "flood", "baseline"),
        "plain_slowdown": _ratio(records, "plain", "baseline"),
        "capture": _ratio(records, "flood", "plain"),
        "flood_s": statistics.median(f["end"] - f["start"] for f in flood_records),
        "plain_s": statistics.median(r["plain"]["end"] - r["plain"]["start"] for r in records),
        "lines_per_s": statistics.median(f["printed"] / (f["end"] - f["start"]) for f in flood_records),
        "logs_per_s": statistics.median(f["logged"] / (f["end"] - f["start"]) for f in flood_records),
        "msg_max": max(busiest_window(stamps, a, b)[1] for a, b in floods),
        "msg_median": statistics.median(n for a, b in floods for n in per_second(stamps, a, b)),
        "kinds": {k: v / flood_s for k, v in in_floods.items()},
        "msg_max_all": busiest,
        "busiest_kinds": Counter(
            f"{kind} {detail}".strip() for t, kind, detail in ui if busiest_at <= t < busiest_at + 1.0
        ),
        "busiest_at": busiest_at,
        "cpu": {
            k: 100
            * sum(sampler.cpu_between(a, b) for a, b in _windows(records, tags, k))
            / sum(b - a for a, b in _windows(records, tags, k))
            for k in BLOCKS
        },
        "cpu_all": 100 * sampler.cpu_between(*span) / (span[1] - span[0]),
        "windows": floods,
        "plain_windows": _windows(records, tags, "plain"),
    }


def report(args: argparse.Namespace, s: dict[str, Any]) -> str:
    modes: dict[str, dict[str, Any]] = s["modes"]
    msg_max = max(m["msg_max_all"] for m in modes.values())
    cpu_max = max(m["cpu"]["flood"] for m in modes.values())
    lost = sum(s["lost"].values())

    targets = [
        (
            f"≤ {TARGET_MSGS} UI messages per second (busiest 1-s window, cell ends included)",
            f"{msg_max} msg/s",
            msg_max <= TARGET_MSGS,
        ),
        (
            f"kernel CPU ≤ {TARGET_CPU:g}% of one core while ranks flood (worse mode)",
            f"{cpu_max:.1f}% of one core",
            cpu_max <= TARGET_CPU,
        ),
        ("nothing lost on disk (every rank's log holds every line)", f"{lost} lines lost", lost == 0),
    ]

    def cells(fmt: str, get: Any) -> list[str]:
        return [fmt.format(get(m)) for m in modes.values()]

    rows = [
        ("step time, training alone (median ms)", cells("{:.2f}", lambda m: m["step"]["baseline"] * 1e3)),
        (
            "step time, flood captured by jupyter_shard (median ms)",
            cells("{:.2f}", lambda m: m["step"]["flood"] * 1e3),
        ),
        (
            "step time, same flood to a plain file (median ms)",
            cells("{:.2f}", lambda m: m["step"]["plain"] * 1e3),
        ),
        (
            "**training slowdown, captured flood** (median over ranks and cells)",
            cells("**{:+.1f}%**", lambda m: (statistics.median(m["slowdown"]) - 1) * 100),
        ),
        (
            "training slowdown, flood to a plain file (what any process printing this much pays)",
            cells("{:+.1f}%", lambda m: (statistics.median(m["plain_slowdown"]) - 1) * 100),
        ),
        (
            "captured / plain-file step time (jupyter_shard's own share)",
            cells("{:.3f}", lambda m: statistics.median(m["capture"])),
        ),
        (
            "flood duration, captured / plain file (median s)",
            cells("{}", lambda m: f"{m['flood_s']:.1f} / {m['plain_s']:.1f}"),
        ),
        ("lines printed per second per rank, captured flood", cells("{:,.0f}", lambda m: m["lines_per_s"])),
        ("shard.log calls per second per rank, captured flood", cells("{:,.0f}", lambda m: m["logs_per_s"])),
        ("UI messages, busiest 1-s window during a flood", cells("{}", lambda m: m["msg_max"])),
        ("UI messages per second, median of the floods' 1-s bins", cells("{:g}", lambda m: m["msg_median"])),
        (
            "UI messages per second during floods, by type (mean)",
            cells("{}", lambda m: ", ".join(f"{k} {v:.2f}" for k, v in sorted(m["kinds"].items())) or "none"),
        ),
        (
            "**UI messages, busiest 1-s window of the whole mode**",
            cells("**{}**", lambda m: m["msg_max_all"]),
        ),
        (
            "… what that window held",
            cells("{}", lambda m: ", ".join(f"{k} {v}" for k, v in m["busiest_kinds"].most_common())),
        ),
        ("**kernel CPU, captured floods (% of one core)**", cells("**{:.1f}**", lambda m: m["cpu"]["flood"])),
        (
            "kernel CPU, plain-file floods: shard.log records only (%)",
            cells("{:.1f}", lambda m: m["cpu"]["plain"]),
        ),
        ("kernel CPU, training alone (%)", cells("{:.1f}", lambda m: m["cpu"]["baseline"])),
        ("kernel CPU over the whole mode (%)", cells("{:.1f}", lambda m: m["cpu_all"])),
    ]
    table = [
        "| measure | " + " | ".join(MODES[m] for m in modes) + " |",
        "|---|" + "---:|" * len(modes),
        *[f"| {a} | " + " | ".join(b) + " |" for a, b in rows],
    ]
    disk = [
        f"| {rank} | {sum(counts.values()):,} | {len(counts) * args.lines:,} | {s['lost'][rank]} |"
        for rank, counts in sorted(s["on_disk"].items())
    ]
    per_cell = "; ".join(
        f"{mode}: "
        + ", ".join(f"{r:.2f}" for r in m["slowdown"])
        + " (plain file: "
        + ", ".join(f"{r:.2f}" for r in m["plain_slowdown"])
        + ")"
        for mode, m in modes.items()
    )
    lines = [
        "# Streaming: ranks flooding output while they train",
        "",
        machine_line(s["load_before"], s["load_after"])
        + f"; during the run mean {statistics.mean(s['loads']):.2f}, max {max(s['loads']):.2f}"
        + (f" (also running: {', '.join(sorted(s['others']))})" if s["others"] else "")
        + f"; whole run {s['run_s']:.0f} s.",
        "",
        f"{args.nproc} CPU ranks (gloo, ddp), MLP {args.width}-{args.width}-{args.width}-1, "
        f"batch {args.batch}, "
        f"training in each rank's main thread. {args.repeats} cells per mode; each cell has three blocks, "
        "their order rotated from cell to cell: training alone; training while a thread on each rank "
        f"prints {args.lines:,} numbered lines (~60 bytes, one `print` each, paced over {args.seconds:g} s, "
        "caught up in slices of 1,000 when behind) and calls `shard.log` "
        f"{args.log_rate:,} times a second as long as it prints (**captured flood**: `sys.stdout` of the "
        "rank, which jupyter_shard tees to the rank log and the kernel); and the same flood with `print` "
        "writing to a plain buffered file instead (**plain file**: what a torchrun worker with redirected "
        "output does; `shard.log` unchanged). UI messages: `stream`, `display_data`, "
        "`update_display_data` and `comm_msg` on iopub, as the client receives them.",
        "",
        *table,
        "",
        "Lines on disk (each rank's log file; every captured flood line counted by its number):",
        "",
        "| rank | flood lines found | printed | lost |",
        "|---|---:|---:|---:|",
        *disk,
        "",
        f"`shard.log` records in `jupyter_shard.history()`: {s['history']:,} of {s['logged']:,} logged.",
        "",
        "Rank RSS growth from the end of the setup cell to the end of the last cell (MB): "
        + ", ".join(f"rank {k} {v / 1e6:+.0f}" for k, v in sorted(s["rss_growth"].items()))
        + f" (after {sum(map(len, s['tags'].values()))} cells, each printing {args.lines:,} captured lines "
        "per rank).",
        "",
        f"Per rank and cell, flood / training-alone step time: {per_cell}.",
        "",
        "![UI messages per second and kernel CPU over the run](streaming-timeline.png)",
        "",
        "## Targets",
        "",
        "| target (issue 8) | measured | |",
        "|---|---|---|",
        *[f"| {name} | {value} | {'met' if met else 'not met'} |" for name, value, met in targets],
        "",
        *[target_line(name, value, met) for name, value, met in targets],
    ]
    return "\n".join(lines) + "\n"


def plot(
    s: dict[str, Any], messages: list[tuple[float, str, str]], cpu: list[tuple[float, float]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(a for a, _ in s["spans"].values())
    end = max(b for _, b in s["spans"].values())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for kind in UI_TYPES:
        bins = per_second([t for t, k, _ in messages if k == kind], start, end)
        if any(bins):
            top.step(range(len(bins)), bins, where="post", label=kind, linewidth=1)
    total = per_second([t for t, k, _ in messages if k in UI_TYPES], start, end)
    top.step(range(len(total)), total, where="post", color="black", linewidth=1.5, label="all four")
    top.axhline(TARGET_MSGS, color="red", linestyle="--", linewidth=1, label=f"target {TARGET_MSGS}/s")
    top.set_ylabel("iopub messages / s")
    top.legend(loc="upper right", fontsize=8)
    seconds = range(int(end - start))
    used = [100 * (_interp(cpu, start + i + 1) - _interp(cpu, start + i)) for i in seconds]
    bottom.step(seconds, used, where="post", linewidth=1, label="kernel CPU, 1-s bins")
    bottom.axhline(TARGET_CPU, color="red", linestyle="--", linewidth=1, label=f"target {TARGET_CPU:g}%")
    bottom.set_ylabel("% of one core")
    bottom.set_xlabel("seconds since the first timed cell")
    bottom.legend(loc="upper right", fontsize=8)
    for m in s["modes"].values():
        for a, b in m["plain_windows"]:
            for ax in (top, bottom):
                ax.axvspan(a - start, b - start, alpha=0.08, color="gray")
    for mode, m in s["modes"].items():
        for a, b in m["windows"]:
            for ax in (top, bottom):
                ax.axvspan(
                    a - start, b - start, alpha=0.12, color="tab:orange" if mode == "lab" else "tab:blue"
                )
    top.set_title(
        "Captured floods shaded (blue: plain notebook, orange: JupyterLab extension attached), "
        "plain-file floods grey; "
        "1-s bins from the first timed cell",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
