"""Files a pool leaves on disk: its private directory record, its logs, and stale-pool clean-up.

Each pool writes ``pool.json`` (kernel and rank pids with their start times) into its private
directory. A later start removes directories whose kernel is gone, killing their recorded ranks
only when pid *and* start time still match - never by process name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from jupyter_shard.launchers.local import kill_recorded

DIR_PREFIX = "jupyter_shard-"
_POOL_DIR_NAME = re.compile(re.escape(DIR_PREFIX) + r"[a-z0-9_]{8}")


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def runtime_root() -> Path:
    """Where private pool directories go: $JUPYTER_SHARD_RUNTIME_DIR, else the temp directory."""
    return Path(os.environ.get("JUPYTER_SHARD_RUNTIME_DIR") or tempfile.gettempdir())


def new_pool_dir() -> Path:
    """A fresh private (0700) directory for one pool's socket, store and record."""
    return Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir=runtime_root()))


def record_pool(directory: Path, rank_pids: list[int]) -> None:
    record = {
        "kernel": [os.getpid(), _start_time(os.getpid())],
        "ranks": [[pid, _start_time(pid)] for pid in rank_pids],
    }
    tmp = directory / "pool.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(directory / "pool.json")


def clean_stale_pools(base: Path | None = None) -> list[Path]:
    """Remove pool directories left by kernels that died; returns what was removed."""
    root = base or runtime_root()
    removed = []
    for directory in root.glob(DIR_PREFIX + "*"):
        try:
            # Only what new_pool_dir makes (mkdtemp: the prefix and 8 random characters), never
            # another program's directory that happens to share the prefix.
            if not _POOL_DIR_NAME.fullmatch(directory.name):
                continue
            if not directory.is_dir() or directory.stat().st_uid != os.getuid():
                continue
            record = json.loads((directory / "pool.json").read_text())
            kernel_pid, kernel_start = _pid_and_start(record["kernel"])
            ranks = [_pid_and_start(item) for item in record["ranks"]]
        except (OSError, ValueError, KeyError, TypeError):
            # unreadable, or written by another version: nothing in it can be trusted to kill by
            if _older_than(directory, 3600):
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
            continue
        if kernel_start is not None and _start_time(kernel_pid) == kernel_start:
            continue
        for pid, started in ranks:
            if started is not None and _start_time(pid) == started:
                kill_recorded(pid)
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


def _pid_and_start(item: object) -> tuple[int, float | None]:
    """``[pid, start time or null]`` from a pool record; TypeError/ValueError for anything else."""
    if not isinstance(item, list) or len(item) != 2:
        raise TypeError(f"not [pid, start time]: {item!r}")
    pid, started = item
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise TypeError(f"not a pid: {pid!r}")
    return pid, None if started is None else float(started)


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False


def new_log_dir(root: Path | None) -> Path:
    base = root or Path(
        os.environ.get("JUPYTER_SHARD_LOG_DIR", Path.home() / ".cache" / "jupyter_shard" / "logs")
    )
    path = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path
