"""The runtime a script written by ``%dist_export`` imports: ``shard`` as a rank has it, under torchrun.

``shard = start(strategy="ddp", device="cpu", options={...})`` reads torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), joins the default process group
(``env://``; NCCL on CUDA, gloo on CPU) with the pool's collective timeout and builds the same
:class:`~jupyter_shard.rank.shard.Shard` a rank builds from the same options, so ``prepare``,
``backward``, ``step``, ``save`` and ``print0`` behave as in the notebook. Run without torchrun
(``python train.py``) the script is a world of one rank. :func:`finish` ends the run cleanly: it
leaves the process group and exits the process (after the exit handlers) the way ranks do.

``shard.log`` scalars go to JSON Lines files, one per rank, a record per call:
``{"rank": 0, "step": 1, "time": 1700000000.0, "loss": 0.25}`` (the records of
``jupyter_shard.history()``). The directory is ``$JUPYTER_SHARD_METRICS_DIR`` if set, else
``<script>.metrics/`` beside the script; each run writes ``<run id>/rank-<k>.jsonl`` in it (torchrun's
run id: the SLURM job id in an exported sbatch job), so runs never overwrite each other. Records are
written at least every :data:`FLUSH_EVERY` seconds, at :func:`finish` and at exit; a record that
cannot be written is reported on stderr with the reason.

Cells that use IPython syntax (``%magic``, ``!cmd``) run through ``get_ipython = ipython(globals())``:
an ``InteractiveShell`` whose namespace is the script's own.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import pickle
import sys
import time
import uuid
from array import array
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from jupyter_shard.env import METRICS_DIR_VAR
from jupyter_shard.rank import shard as shard_module
from jupyter_shard.rank.device import select_device
from jupyter_shard.rank.shard import Shard

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = ["finish", "ipython", "start", "unpickle", "unpickle_file"]

METRICS_ENV = METRICS_DIR_VAR
FLUSH_EVERY = 1.0  # seconds between writes of queued ``shard.log`` records

_current: _ScriptShard | None = None


def start(
    strategy: str = "none",
    device: str = "cpu",
    options: dict[str, Any] | None = None,
    timeout: float = 60.0,
) -> Shard:
    """Join the process group torchrun describes and return this rank's ``shard`` (call once)."""
    global _current
    if _current is not None:
        raise RuntimeError("jupyter_shard.rank.script.start() was called twice; call it once per process")
    _default_to_one_rank()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    where, backend = select_device(
        rank, local_rank, device, "start as many ranks per node as it has GPUs (torchrun --nproc-per-node)"
    )
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        device_id=where if where.type == "cuda" else None,  # NCCL starts (and fails) here
    )
    metrics = _MetricsFile(_metrics_path(rank))
    helper = _ScriptShard(rank, local_rank, world_size, where, strategy, metrics, options)
    shard_module.set_current(helper)
    _current = helper
    atexit.register(helper.flush_metrics)
    return helper


def finish() -> None:
    """Write the last ``shard.log`` records and leave the process group (the script's last line)."""
    if _current is not None:
        _current.flush_metrics()
        _current.metrics.close()
    if dist.is_initialized():
        # Every rank is past its last collective before any tears its group down: a rank that left
        # while a peer's gloo threads still talked to it aborted the peer ("terminate called
        # without an active exception").
        dist.barrier()
        dist.destroy_process_group()
        _exit_without_teardown()


def _exit_without_teardown() -> None:
    """End the process as the pool's ranks end: exit handlers run and output is flushed, then
    ``os._exit(0)``. torch 2.13's gloo can abort a process while its interpreter tears down, after
    the script returned ("terminate called without an active exception", pytorch/pytorch#190489),
    and torchrun then reports the run as failed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0)


def ipython(namespace: dict[str, Any]) -> Callable[[], InteractiveShell]:
    """``get_ipython`` for cells with IPython syntax: a shell that runs in ``namespace`` (``globals()``)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    if not InteractiveShell.initialized():
        config = Config()
        config.HistoryManager.enabled = False
        config.InteractiveShell.colors = "nocolor"
        module = sys.modules.get(str(namespace.get("__name__", "")))
        if module is None or vars(module) is not namespace:
            module = None
        InteractiveShell.instance(config=config, user_ns=namespace, user_module=module)
    shell: InteractiveShell = InteractiveShell.instance()
    return shell.get_ipython


def unpickle(data: str) -> Any:
    """A value ``%dist_push``-ed in the notebook, embedded in the script as base64 cloudpickle."""
    return pickle.loads(base64.b64decode(data))


def unpickle_file(script: str, name: str) -> Any:
    """A pushed value too large to embed: the file ``name``, relative to the directory of ``script``."""
    with open(Path(script).resolve().parent / name, "rb") as fh:
        return pickle.load(fh)


def _default_to_one_rank() -> None:
    """Run as ``python train.py`` (no torchrun): a world of one rank on this machine."""
    if "RANK" in os.environ:
        return
    from jupyter_shard._util.net import free_port

    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    defaults |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    print("jupyter_shard: no torchrun environment (RANK unset); running as 1 rank", file=sys.stderr)


def _metrics_path(rank: int) -> Path:
    root = os.environ.get(METRICS_ENV)
    if root:
        base = Path(root)
    else:
        script = Path(sys.argv[0] or "script").resolve()
        base = script.with_name(script.stem + ".metrics")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    return base / run_id / f"rank-{rank}.jsonl"


class _MetricsFile:
    """Turns the ``metrics`` messages a ``Shard`` sends (float64 columns, one message per set of names
    logged together) into JSON Lines records, written in the order they were logged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: IO[str] | None = None
        self._failed = False
        self._pending: list[dict[str, Any]] = []

    def collect(self, kind: str, body: Mapping[str, Any], buffers: list[bytes]) -> None:
        """``Shard``'s ``send``: keep the records of one flush until :meth:`write`."""
        if kind != "metrics":
            print(f"jupyter_shard: a {kind!r} message has no place in a script; dropped", file=sys.stderr)
            return
        steps, times, *values = (array("d", buf) for buf in buffers)
        names, rank = [str(n) for n in body["names"]], int(body["rank"])
        for i, step in enumerate(steps):
            record: dict[str, Any] = {"rank": rank, "step": int(step) if step.is_integer() else step}
            record["time"] = times[i]
            record.update((name, column[i]) for name, column in zip(names, values, strict=True))
            self._pending.append(record)

    def write(self) -> None:
        records, self._pending = sorted(self._pending, key=lambda r: float(r["time"])), []
        lines = [json.dumps(record) + "\n" for record in records]
        if not lines:
            return
        try:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
            self._fh.writelines(lines)
            self._fh.flush()
        except OSError as exc:
            if not self._failed:
                print(f"jupyter_shard: shard.log records not written to {self.path}: {exc}", file=sys.stderr)
            self._failed = True
            for line in lines:
                print(f"jupyter_shard: metrics {line}", end="", file=sys.stderr)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class _ScriptShard(Shard):
    """``Shard`` whose ``log`` records go to a file, written from the training loop at most every
    :data:`FLUSH_EVERY` seconds (in a rank, an I/O thread sends them to the kernel instead)."""

    _flushed = 0.0

    def __init__(
        self,
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
        strategy: str,
        metrics: _MetricsFile,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(rank, local_rank, world_size, device, strategy, metrics.collect, options)
        self.metrics = metrics

    def log(self, step: int | None = None, **scalars: float | torch.Tensor) -> None:
        super().log(step, **scalars)
        now = time.monotonic()
        if now - self._flushed >= FLUSH_EVERY:
            self._flushed = now
            self.flush_metrics()

    def flush_metrics(self) -> None:
        super().flush_metrics()
        self.metrics.write()
