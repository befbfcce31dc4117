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
Run: ``.venv/bin/python -m benchmarks.streaming [--lines 1000000 --seconds 15 --repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import zmq

from benchmarks.common import RESULTS, LoadWatch, write_section
from benchmarks.common.kernel import start_kernel
from benchmarks.streaming.report import BLOCKS, MODES, interpolate, plot, report, summarise_mode

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


@dataclass
class Kernel:
    """A kernel subprocess and one client; every iopub message is kept with its arrival time."""

    log_root: Path
    messages: list[tuple[float, str, str]] = field(default_factory=list)  # time, type, what it carried

    def __post_init__(self) -> None:
        env = {"JUPYTER_SHARD_LOG_DIR": str(self.log_root), "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
        self.km, self.kc = start_kernel(env)
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
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            times = self.proc.cpu_times()
            self.samples.append((time.time(), times.user + times.system))
            self.stopped.wait(0.2)

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds the kernel used between two wall-clock times (linear between samples)."""
        return interpolate(self.samples, end) - interpolate(self.samples, start)


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
    watch = LoadWatch().start()
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
        watch.stop()
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
        "modes": {
            mode: summarise_mode(tags[mode], spans[mode], records, kernel.messages, sampler.cpu_between)
            for mode in tags
        },
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
        "run_s": watch.seconds,
        "loads": watch.loads,
        "others": watch.others,
        "load_before": watch.before,
        "load_after": watch.after,
    }
    write_section(report(args, summary), args.results)
    if args.results != "-":
        path = Path(args.results)
        plot(summary, kernel.messages, sampler.samples, path.with_name("streaming-timeline.png"))
    if args.keep:
        print(f"rank logs, per-cell records, iopub messages and CPU samples: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
