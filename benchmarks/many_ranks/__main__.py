"""A notebook at many ranks: what a cell shows and stores, its error, its status, the kernel's cost.

A real kernel (as Jupyter starts one) loads the extension and starts ``%%distributed --nproc N
--device cpu`` for each N of ``--ranks`` (real CPU rank processes). At each size, in one kernel:

* **no-op**: ``pass`` on every rank, ``--repeats`` times after 3 warm-up: the median wall time, and
  that time per rank;
* **printing**: every rank prints ``step i loss x`` (its own ``x``) for ``--steps`` steps, once as
  the notebook shows it by default (``auto``: the summary from 9 ranks) and once with
  ``%dist_output all`` (every line as it comes): the lines the cell shows and the bytes a saved
  notebook holds for the cell (its outputs as nbformat JSON after every display update is applied,
  as JupyterLab saves them);
* **error**: every rank raises ``ValueError(f"bad {rank}")``: the lines of the error shown;
* **status**: ``%dist_status``: its lines and its longest line.

A plain frontend (no JupyterLab extension): what nbclient, VS Code and a saved notebook see.
Then the same in a kernel of simulated ranks for each N of ``--simulated`` (128 to 1,024), with the
kernel's own CPU time per no-op cell and the size of the live dashboard's updates while every rank
logs. Writes ``benchmarks/results/many_ranks.md``.
Run: ``.venv/bin/python -m benchmarks.many_ranks [--ranks 16 32 64 --steps 30 --repeats 20]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.kernel import start_kernel
from benchmarks.common.machine import RESULTS, cpu, load_average
from benchmarks.common.report import target_table, write_section
from jupyter_shard.notebook.dashboard import LIVE_MIME

PRINTING = (
    "%%distributed\nimport torch.distributed as dist\nrank = dist.get_rank()\n"
    "for step in range({steps}):\n    print(f'step {{step}} loss {{0.5 + rank / 1000 - step / 100:.3f}}')"
)
FAILING = "%%distributed\nraise ValueError(f'bad {dist.get_rank()}')"


@dataclass
class Cell:
    outputs: list[dict[str, Any]]
    seconds: float
    ok: bool

    def saved_bytes(self) -> int:
        """The cell's outputs as a saved notebook holds them (nbformat JSON)."""
        return len(json.dumps(self.outputs, ensure_ascii=False).encode())

    def text(self) -> str:
        """What the cell shows as text: streams, and each display's or error's text."""
        parts = []
        for out in self.outputs:
            if out["output_type"] == "stream":
                parts.append(out["text"])
            elif out["output_type"] == "error":
                parts.append("\n".join(out["traceback"]) + "\n")
            else:
                parts.append(str(out.get("data", {}).get("text/plain", "")) + "\n")
        return "".join(parts)


def run(kc: Any, code: str, timeout: float = 600.0) -> Cell:
    """Execute ``code``; its outputs as a notebook ends up holding them (updates applied in place)."""
    started = time.perf_counter()
    msg_id = kc.execute(code, allow_stdin=False)
    outputs: list[dict[str, Any]] = []
    by_display: dict[str, int] = {}
    ok = True
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            break
        if kind == "stream":
            if outputs and outputs[-1]["output_type"] == "stream" and outputs[-1]["name"] == content["name"]:
                outputs[-1]["text"] += content["text"]
            else:
                outputs.append({"output_type": "stream", "name": content["name"], "text": content["text"]})
        elif kind in ("display_data", "execute_result"):
            out = {"output_type": kind, "data": content["data"], "metadata": content.get("metadata", {})}
            display_id = content.get("transient", {}).get("display_id")
            if display_id:
                by_display[display_id] = len(outputs)
            outputs.append(out)
        elif kind == "update_display_data":
            index = by_display.get(content.get("transient", {}).get("display_id", ""))
            if index is not None:
                outputs[index]["data"] = content["data"]
        elif kind == "error":
            ok = False
            error = {"output_type": "error", "ename": content["ename"], "traceback": content["traceback"]}
            outputs.append(error)
    seconds = time.perf_counter() - started
    kc.get_shell_msg(timeout=timeout)
    return Cell(outputs, seconds, ok)


@dataclass
class Size:
    ranks: int
    start_s: float
    noop_ms: float
    summary: Cell
    every_line: Cell
    error: Cell
    status: Cell


def measure(ranks: int, steps: int, repeats: int, log_dir: Path) -> Size:
    km, kc = start_kernel({"JUPYTER_SHARD_LOG_DIR": str(log_dir), "JUPYTER_SHARD_OUTPUT": "auto"})
    try:
        assert run(kc, "%load_ext jupyter_shard").ok
        started = run(kc, f"%%distributed --nproc {ranks} --device cpu\nimport torch.distributed as dist")
        assert started.ok, started.text()[-2000:]
        for _ in range(3):
            run(kc, "%%distributed\npass")
        noop = statistics.median(run(kc, "%%distributed\npass").seconds for _ in range(repeats))
        summary = run(kc, PRINTING.format(steps=steps))
        assert run(kc, "%dist_output all").ok
        every_line = run(kc, PRINTING.format(steps=steps))
        assert run(kc, "%dist_output auto").ok
        error = run(kc, FAILING)
        status = run(kc, "%dist_status")
        run(kc, "%dist_shutdown")
        return Size(ranks, started.seconds, noop * 1000, summary, every_line, error, status)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


SIM_REGISTER = "from jupyter_shard.launchers.simulated import register\nregister()"
SIM_START = "%%distributed --nproc {ranks} --launcher simulated --strategy none --device cpu\nx = shard.rank"
SIM_PRINTING = (
    "%%distributed\nfor step in range({steps}):\n"
    "    print(f'step {{step}} loss {{0.5 + shard.rank / 1000 - step / 100:.3f}}')"
)
PANEL_SIZE = (
    "import json\nfrom jupyter_shard.notebook.panel import status_reply\n"
    "from jupyter_shard.pool.pool import latest_pool\n"
    "print('PANEL', len(json.dumps(status_reply(latest_pool()))))"
)
SIM_FAILING = "%%distributed\nraise ValueError(f'bad {shard.rank}')"
SIM_LOGGING = (
    "%%distributed\nimport time\nfor step in range(40):\n"
    "    shard.log(loss=1.0 / (step + 1) + shard.rank / 1e4, lr=0.1, step=step)\n    time.sleep(0.05)"
)


@dataclass
class Simulated:
    ranks: int
    start_s: float
    noop_ms: float
    kernel_cpu_ms: float  # the kernel process's CPU time per no-op cell
    summary: Cell
    error: Cell
    status: Cell
    update_bytes: int  # the largest live dashboard update, as a frontend without the extension gets it
    update_bytes_extension: int  # the same, where the extension draws it (no HTML table)
    updates: int
    panel_bytes: int  # the side panel's status reply (one row per rank)


def measure_simulated(ranks: int, steps: int, repeats: int, log_dir: Path) -> Simulated:
    """Simulated ranks (``--launcher simulated``: 128 per process, no torch) in a real kernel: the
    kernel's own CPU time per no-op cell, what a printing cell shows and stores, the error, the
    status, and the live dashboard's updates while every rank logs."""
    import psutil

    km, kc = start_kernel({"JUPYTER_SHARD_LOG_DIR": str(log_dir), "JUPYTER_SHARD_OUTPUT": "auto"})
    kernel = psutil.Process(int(km.provisioner.process.pid))  # type: ignore[union-attr]
    try:
        assert run(kc, "%load_ext jupyter_shard").ok and run(kc, SIM_REGISTER).ok
        started = run(kc, SIM_START.format(ranks=ranks))
        assert started.ok, started.text()[-2000:]
        for _ in range(3):
            run(kc, "%%distributed\npass")
        before = kernel.cpu_times()
        walls = [run(kc, "%%distributed\npass").seconds for _ in range(repeats)]
        after = kernel.cpu_times()
        cpu = (after.user + after.system - before.user - before.system) / repeats
        summary = run(kc, SIM_PRINTING.format(steps=steps))
        error = run(kc, SIM_FAILING)
        status = run(kc, "%dist_status")
        updates = _updates(kc, SIM_LOGGING)
        panel = run(kc, PANEL_SIZE).text()
        run(kc, "%dist_shutdown")
        plain = max((len(json.dumps(u)) for u in updates), default=0)
        bare = max(
            (len(json.dumps({k: v for k, v in u.items() if k != "text/html"})) for u in updates), default=0
        )
        return Simulated(
            ranks,
            started.seconds,
            statistics.median(walls) * 1000,
            cpu * 1000,
            summary,
            error,
            status,
            plain,
            bare,
            len(updates),
            int(panel.split("PANEL")[-1].split()[0]),
        )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _updates(kc: Any, code: str) -> list[dict[str, Any]]:
    """The data of every live dashboard redraw while ``code`` runs (``update_display_data``), not
    the saved form the display becomes when the cell ends."""
    msg_id = kc.execute(code, allow_stdin=False)
    found = []
    while True:
        msg = kc.get_iopub_msg(timeout=600)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        data = msg["content"].get("data", {})
        # a live redraw carries the figure itself; the saved form at the cell's end points to Plotly's
        if msg["msg_type"] == "update_display_data" and isinstance(
            data.get(LIVE_MIME, {}).get("figure"), dict
        ):
            found.append(data)
    kc.get_shell_msg(timeout=600)
    return found


def _lines(cell: Cell) -> int:
    return len(cell.text().splitlines())


def report(sizes: list[Size], steps: int, repeats: int) -> str:
    head = [
        "## Many ranks: what a cell shows and stores, its error and status, the kernel's cost",
        "",
        f"Machine: {cpu()}; load average before: {load_average()}. Real CPU ranks in a real kernel, a plain",
        "frontend (no JupyterLab extension): what nbclient, VS Code and a saved notebook see. "
        f"`python -m benchmarks.many_ranks`; no-op: median of {repeats}.",
        "",
        "| ranks | start, s | no-op cell, ms | per rank, ms "
        "| printing cell, lines shown (summary / every line) "
        "| saved bytes of that cell (summary / every line) "
        "| error, lines | `%dist_status`, lines / longest |",
        "|---:|---:|---:|---:|---|---|---:|---|",
    ]
    rows = []
    for s in sizes:
        status_lines = s.status.text().splitlines()
        rows.append(
            f"| {s.ranks} | {s.start_s:.1f} | {s.noop_ms:.1f} | {s.noop_ms / s.ranks:.3f} "
            f"| {_lines(s.summary)} / {_lines(s.every_line)} "
            f"| {s.summary.saved_bytes():,} / {s.every_line.saved_bytes():,} | {_lines(s.error)} "
            f"| {len(status_lines)} / {max(map(len, status_lines))} |"
        )
    biggest = max(sizes, key=lambda s: s.ranks)
    screens = _lines(biggest.summary) / 50
    targets = [
        (
            f"a {steps}-step printing loop at {biggest.ranks} ranks shows at most a few screens "
            "(50 lines each)",
            f"{_lines(biggest.summary)} lines, {screens:.1f} screens",
            screens <= 3,
        ),
        (
            f"an error raised on every one of {biggest.ranks} ranks reads in one block",
            f"{_lines(biggest.error)} lines",
            biggest.error.text().count("──── rank ") == 1,
        ),
        (
            f"`%dist_status` at {biggest.ranks} ranks: a row per rank on one line (≤ 120 characters)",
            f"longest line {max(map(len, biggest.status.text().splitlines()))}",
            max(map(len, biggest.status.text().splitlines())) <= 120,
        ),
    ]
    sample = biggest.summary.text().splitlines()[:3]
    tail = [
        "",
        f"The first lines of the printing cell at {biggest.ranks} ranks, as shown:",
        "",
        "```",
        *sample,
        "```",
        "",
        "The JupyterLab extension's bundle carries at most 2,000 lines of a cell (the first and last",
        "1,000), measured in `tests/unit/notebook/test_display.py` (1,024 ranks × 30 lines: under 200 KB).",
        "",
    ]
    return "\n".join([*head, *rows, "", *target_table(targets), *tail])


def report_simulated(sizes: list[Simulated], steps: int, repeats: int) -> str:
    head = [
        "### The kernel at 128 to 1,024 ranks (simulated ranks)",
        "",
        "Simulated ranks (`--launcher simulated`: 128 per process, the wire protocol without torch, each",
        "cell on a thread of its own) in a real kernel, a plain frontend. The kernel's CPU is its own",
        f"process's user + system time over {repeats} no-op cells (the ranks' processes are not in it).",
        "A dashboard update is the largest `update_display_data` while every rank logs 40 steps of two",
        "scalars: as a frontend without the extension gets it (figure, HTML status, text) and where the",
        "extension draws it (no HTML).",
        "",
        "| ranks | start, s | no-op cell, ms | kernel CPU per cell, ms | per rank, ms "
        "| printing cell, lines / saved bytes | error, lines | `%dist_status`, lines / longest "
        "| dashboard update, bytes (plain / extension) | updates | panel status, bytes |",
        "|---:|---:|---:|---:|---:|---|---:|---|---|---:|---:|",
    ]
    rows = []
    for s in sizes:
        status_lines = s.status.text().splitlines()
        rows.append(
            f"| {s.ranks} | {s.start_s:.1f} | {s.noop_ms:.1f} | {s.kernel_cpu_ms:.1f} "
            f"| {s.kernel_cpu_ms / s.ranks:.3f} | {_lines(s.summary)} / {s.summary.saved_bytes():,} "
            f"| {_lines(s.error)} | {len(status_lines)} / {max(map(len, status_lines))} "
            f"| {s.update_bytes:,} / {s.update_bytes_extension:,} | {s.updates} | {s.panel_bytes:,} |"
        )
    big = max(sizes, key=lambda s: s.ranks)
    targets = [
        (
            f"the kernel's own cost per rank and cell ≤ 0.1 ms at {big.ranks} ranks",
            f"{big.kernel_cpu_ms / big.ranks:.3f} ms",
            big.kernel_cpu_ms / big.ranks <= 0.1,
        ),
        (
            f"what the notebook stores for a {steps}-step printing cell at {big.ranks} ranks ≤ 200 KB",
            f"{big.summary.saved_bytes() / 1000:.1f} KB",
            big.summary.saved_bytes() <= 200_000,
        ),
        (
            f"a dashboard update at {big.ranks} ranks ≤ 50 KB (a frontend without the extension)",
            f"{big.update_bytes / 1000:.1f} KB",
            0 < big.update_bytes <= 50_000,
        ),
    ]
    return "\n".join([*head, *rows, "", *target_table(targets), ""])


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--ranks", type=int, nargs="*", default=[16, 32, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--simulated", type=int, nargs="*", default=[128, 256, 512, 1024])
    parser.add_argument("--results", default=str(RESULTS / "many_ranks.md"))
    parser.add_argument("--browser", type=int, default=0, help="the browser test at this many real ranks")
    args = parser.parse_args()
    sizes, simulated = [], []
    with tempfile.TemporaryDirectory(prefix="js-many-") as logs:
        for ranks in args.ranks:
            print(f"measuring {ranks} ranks …", flush=True)
            sizes.append(measure(ranks, args.steps, args.repeats, Path(logs) / str(ranks)))
        for ranks in args.simulated:
            print(f"measuring {ranks} simulated ranks …", flush=True)
            simulated.append(measure_simulated(ranks, args.steps, args.repeats, Path(logs) / f"sim{ranks}"))
    text = report(sizes, args.steps, args.repeats) if sizes else ""
    if simulated:
        text += "\n" + report_simulated(simulated, args.steps, args.repeats)
    if args.browser:
        print(f"the browser test at {args.browser} ranks …", flush=True)
        if not text and Path(args.results).exists():  # the browser alone: kept under the last run's tables
            text = Path(args.results).read_text().split(BROWSER_HEAD)[0].rstrip() + "\n"
        text += "\n" + browser(args.browser)
    write_section(text, args.results)


BROWSER_HEAD = "### In JupyterLab at"


def browser(ranks: int) -> str:
    """``tests/ui/test_many_ranks.py`` at ``ranks`` real CPU ranks in JupyterLab and headless
    Chromium: whether every check held, how long it took, and where its screenshots are."""
    env = {**os.environ, "JUPYTER_SHARD_UI_RANKS": str(ranks)}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ui/test_many_ranks.py"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.monotonic() - began
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    verdict = "every check held" if done.returncode == 0 else f"FAILED (exit {done.returncode}): {last}"
    return "\n".join(
        [
            f"{BROWSER_HEAD} {ranks} ranks",
            "",
            f"`tests/ui/test_many_ranks.py` with `JUPYTER_SHARD_UI_RANKS={ranks}` (real CPU ranks, "
            f"headless Chromium): {verdict}, in {took:.0f} s. Its screenshots (summary, every line, by "
            "rank, the grouped error, the dashboard, the status, the side panel) are in "
            "`test-artifacts/ui/`.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
