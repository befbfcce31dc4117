"""Files the kernel writes for the user (metrics CSV, strategy configs) appear whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


def write_atomic(path: str | os.PathLike[str], content: str | Callable[[TextIO], None]) -> Path:
    """Write ``content`` (text, or a function writing to the file) through a temporary file beside
    ``path``, then rename it into place: readers see the old file or the new one, never a part."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as fh:
            if isinstance(content, str):
                fh.write(content)
            else:
                content(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
