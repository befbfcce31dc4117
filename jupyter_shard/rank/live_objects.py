"""What a suspend cannot carry as a value: open files, sockets, pipes, locks, threads, processes,
CUDA streams and events; and the open regular files it reopens instead.

Why it exists: cloudpickle pickles a text file opened for reading as an in-memory copy of its whole
content (writes after the resume never reach the disk, and every rank's pickle holds the file), and
other live objects either fail with a message that does not say what to do or come back as dead
copies. A suspend keeps an open regular file named in the namespace by its path, mode and position
and reopens it on resume, saying so (:func:`file_record`, :func:`reopen`); any other live object, or
a file held inside another value, is listed as not kept with why (:func:`not_kept_reason`).
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import threading
from typing import Any

_LOCKS = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Semaphore)
#: how a file is opened again: never truncating what it wrote ("w" and "x" become "r+")
_REOPEN = {"w": "r+", "w+": "r+", "x": "r+", "x+": "r+", "r": "r", "r+": "r+", "a": "a", "a+": "a+"}


def not_kept_reason(obj: object) -> str | None:
    """Why ``obj`` cannot be kept by value, or None if it can be pickled as it is."""
    if isinstance(obj, io.BytesIO | io.StringIO):
        return None  # in memory: pickled with its content, as it is
    if isinstance(obj, io.IOBase):
        name = getattr(obj, "name", None)
        what = f"an open file ({name})" if isinstance(name, str) else "an open file or pipe"
        return f"{what} is not kept inside another value; open it again after the resume"
    if isinstance(obj, socket.socket):
        return "a socket is not kept; connect again after the resume"
    if isinstance(obj, _LOCKS):
        return "a lock is not kept; make it again after the resume"
    if isinstance(obj, threading.Thread):
        return "a thread is not kept; start it again after the resume"
    if isinstance(obj, subprocess.Popen):
        return "a running process is not kept; start it again after the resume"
    kind = type(obj)
    if kind.__module__.startswith("torch.cuda") and kind.__name__ in ("Stream", "Event", "ExternalStream"):
        return f"a CUDA {kind.__name__.lower()} is not kept; make it again after the resume"
    return None


def file_record(obj: object) -> dict[str, Any] | None:
    """Path, mode, position and encoding of an open regular file, to reopen it on resume; None for
    anything else (a pipe, a closed file, a file without a path)."""
    if not isinstance(obj, io.IOBase) or obj.closed:
        return None
    name, mode = getattr(obj, "name", None), getattr(obj, "mode", None)
    if not isinstance(name, str) or not isinstance(mode, str) or not os.path.isfile(name):
        return None
    if obj.writable():
        obj.flush()
    plain = mode.replace("b", "").replace("t", "")
    if plain not in _REOPEN:
        return None
    return {
        "path": os.path.abspath(name),
        "mode": mode,
        "position": obj.tell(),
        "encoding": getattr(obj, "encoding", None) if "b" not in mode else None,
    }


def reopen(record: dict[str, Any]) -> tuple[io.IOBase, str]:
    """The file ``record`` describes, opened again at its position (never truncated), and a line
    saying what was reopened."""
    mode: str = record["mode"]
    binary = "b" in mode
    plain = mode.replace("b", "").replace("t", "")
    again = _REOPEN[plain] + ("b" if binary else "")
    handle: Any = open(  # noqa: SIM115 (the user's own open file, handed back to the namespace)
        record["path"], again, encoding=None if binary else record.get("encoding")
    )
    if not plain.startswith("a"):
        handle.seek(int(record["position"]))
    where = f"at byte {record['position']}" if not plain.startswith("a") else "appending"
    return handle, f"{record['path']} (opened {mode!r}, reopened {again!r}, {where})"
