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
Writes ``benchmarks/results/many_ranks.md``.
Run: ``.venv/bin/python -m benchmarks.many_ranks [--ranks 16 32 64 --steps 30 --repeats 20]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.kernel import start_kernel
from benchmarks.common.machine import RESULTS, cpu, load_average
from benchmarks.common.report import target_table, write_section

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
        "Not measured here: the kernel at 128 to 1,024 ranks (that needs simulated ranks, which do not",
        "exist yet), and the JupyterLab extension's bundle, which still carries every line for its tabs.",
        "",
    ]
    return "\n".join([*head, *rows, "", *target_table(targets), *tail])


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--results", default=str(RESULTS / "many_ranks.md"))
    args = parser.parse_args()
    sizes = []
    with tempfile.TemporaryDirectory(prefix="js-many-") as logs:
        for ranks in args.ranks:
            print(f"measuring {ranks} ranks …", flush=True)
            sizes.append(measure(ranks, args.steps, args.repeats, Path(logs) / str(ranks)))
    write_section(report(sizes, args.steps, args.repeats), args.results)


if __name__ == "__main__":
    main()
