"""Reading a record from a directory that other users can reach, without following their links.

Why it exists: pool directories and their records (``pool.json``, ``kept.json``) may sit in a shared
temporary directory. Checking a path's owner with ``stat()`` and then reading the path again leaves a
window in which another user swaps a symbolic link (the directory or the file) for one of their own,
so a forged record is read as this user's: a kept pool's to attach to, or a list of processes for the
stale-pool clean-up to kill. :func:`read_private_json` opens the directory and then the file through
the opened directory, each with ``O_NOFOLLOW``, checks owner and mode on what it opened (``fstat``),
and reads from that same descriptor.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any


class NotPrivate(OSError):
    """The record is not this user's alone (another owner, a link, or readable or writable by others)."""


def read_private_json(path: Path) -> Any:
    """The JSON in ``path``, whose directory and file are this user's, not links, and closed to
    others (no group or other access); :class:`NotPrivate` otherwise, :class:`OSError` or
    :class:`ValueError` for a missing or unreadable record."""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _own(os.fstat(directory), path.parent, directory=True)
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory)
    finally:
        os.close(directory)
    with os.fdopen(fd, "rb") as fh:
        _own(os.fstat(fh.fileno()), path, directory=False)
        return json.loads(fh.read())


def _own(info: os.stat_result, path: Path, directory: bool) -> None:
    kind = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise NotPrivate(f"{path} is not this user's private {'directory' if directory else 'file'}")
