"""Execute a notebook headlessly with a real Jupyter kernel and print what each cell printed.

Usage: ``python notebooks/run_headless.py NOTEBOOK [--output PATH] [--timeout SECONDS]``

The kernel is always an ipykernel running on *this* Python interpreter (the one running this
script), whatever kernelspec the notebook names, so ``%load_ext jupyter_shard`` finds the package
installed here. After each cell finishes, its text output is printed to the terminal: the
``[rank k] ...`` lines the ranks wrote, and anything the kernel itself wrote. The exit status is 1
if any cell raised an error, else 0. ``--output`` saves the executed notebook with its outputs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
from ipykernel.kernelspec import RESOURCES, get_kernel_dict
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


class CurrentPythonSpecs(KernelSpecManager):
    """Every kernel name resolves to an ipykernel on this interpreter (``sys.executable``)."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())


def output_lines(output: Any) -> list[str]:
    """The plain-text lines of one cell output (stream text, text/plain, or an error's name)."""
    kind = output.get("output_type")
    if kind == "stream":
        return str(output.get("text", "")).splitlines()
    if kind in ("display_data", "execute_result"):
        return str(output.get("data", {}).get("text/plain", "")).splitlines()
    if kind == "error":
        return [f"{output.get('ename')}: {output.get('evalue')}"]
    return []


def report_cell(cell: Any, cell_index: int, **_: Any) -> None:
    """nbclient hook: print the cell's first line and its output lines."""
    head = next((ln for ln in str(cell.source).splitlines() if ln.strip()), "")
    print(f"--- cell {cell_index}: {head}", flush=True)
    for output in cell.get("outputs", []):
        for line in output_lines(output):
            print(f"    {line}", flush=True)


def run(path: Path, output: Path | None, timeout: int) -> int:
    """Execute ``path``; return 0 if every cell ran without error, else 1."""
    nb = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
    # ipc sockets in a private directory, not TCP ports: only this user can reach the kernel.
    sockets = Path(tempfile.mkdtemp(prefix="run_headless-"))
    km = KernelManager(
        kernel_spec_manager=CurrentPythonSpecs(),
        kernel_name="python3",
        transport="ipc",
        ip=str(sockets / "kernel"),
    )
    client = NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        record_timing=False,
        resources={"metadata": {"path": str(path.parent.resolve())}},
        on_cell_executed=report_cell,
    )
    started = time.monotonic()
    status = 0
    try:
        client.execute()
    except CellExecutionError as exc:
        print(f"error: a cell failed:\n{exc}", file=sys.stderr)
        status = 1
    finally:
        if km.has_kernel:  # nbclient leaves a kernel manager it was given running
            km.shutdown_kernel()
        shutil.rmtree(sockets, ignore_errors=True)
        if output is not None:
            nbformat.write(nb, output)  # type: ignore[no-untyped-call]
    verdict = "ok" if status == 0 else "FAILED"
    print(f"--- {path}: {verdict} in {time.monotonic() - started:.1f} s", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--output", type=Path, help="save the executed notebook (with outputs) here")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        parser.error(f"{args.notebook} is not a file")
    return run(args.notebook, args.output, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
