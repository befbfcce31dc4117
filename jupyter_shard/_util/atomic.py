"""Files appear whole or not at all: those the kernel writes for the user (metrics CSV, strategy configs,
exported scripts) with the mode a plain ``open()`` would have given them (the file replaced keeps its
own), and private ones (a kept pool's record, which holds its key; the parts of a suspend) as 0600."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


def write_atomic(path: str | os.PathLike[str], content: str | Callable[[TextIO], None]) -> Path:
    """Write ``content`` (text, or a function writing to the file) through a temporary file beside
    ``path``, then rename it into place: readers see the old file or the new one, never a part."""
    target = Path(path)

    def write(fh: TextIO) -> None:
        fh.write(content) if isinstance(content, str) else content(fh)

    return _replace(target, "w", write, _mode_for(target))


def write_private(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` readable by this user only (0600), synced, renamed into place when whole."""
    return _replace(
        Path(path), "wb", lambda fh: fh.write(data.encode() if isinstance(data, str) else data), 0o600
    )


def _replace(target: Path, mode: str, write: Callable[[Any], object], bits: int) -> Path:
    """Write through a temporary file beside ``target`` (mode ``bits``), synced, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, newline=None if "b" in mode else "") as fh:
            write(fh)
            fh.flush()
            if bits != 0o600:
                os.fchmod(fh.fileno(), bits)  # mkstemp made it 0600
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _mode_for(target: Path) -> int:
    """The permission bits of the file being replaced, else what ``open()`` gives a new file."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~umask()


def umask() -> int:
    """This process's umask, read without changing it (``os.umask`` can only be read by setting it,
    which would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
