"""Was a rank killed by the out-of-memory killer? Its memory cgroup's ``oom_kill`` counter says.

A SIGKILL nobody in the pool sent is most often the OOM killer. The kernel counts the processes it
killed for memory in the cgroup's ``memory.events`` (cgroup v2) or ``memory.oom_control`` (v1), as
``oom_kill N``. The pool finds that file for each rank when it starts (the process is gone by the
time it matters) and reads the counter then and after a SIGKILL.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple


class _Mount(NamedTuple):
    root: str  # the cgroup path that the mount point shows
    point: Path
    fstype: str
    options: set[str]


def _mounts(mountinfo: str) -> list[_Mount]:
    mounts = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mounts.append(_Mount(fields[3], Path(fields[4]), tail[0], set(tail[2].split(","))))
    return mounts


def counter_file(pid: int, proc: Path = Path("/proc")) -> Path | None:
    """The file holding the ``oom_kill`` count of ``pid``'s memory cgroup, if there is one to read."""
    try:
        cgroups = (proc / str(pid) / "cgroup").read_text()
        mounts = _mounts((proc / str(pid) / "mountinfo").read_text())
    except OSError:
        return None
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates = [(m, "memory.events") for m in mounts if m.fstype == "cgroup2"]
        elif "memory" in controllers.split(","):
            candidates = [
                (m, "memory.oom_control") for m in mounts if m.fstype == "cgroup" and "memory" in m.options
            ]
        else:
            continue
        for mount, name in candidates:
            if path != mount.root and not path.startswith(mount.root.rstrip("/") + "/"):
                continue
            relative = path[len(mount.root) :].lstrip("/")
            file = mount.point / relative / name
            if read_count(file) is not None:
                return file
    return None


def read_count(file: Path | None) -> int | None:
    """The ``oom_kill`` count in ``file``; None if it cannot be read."""
    if file is None:
        return None
    try:
        match = re.search(r"^oom_kill (\d+)$", file.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def explain_sigkill(file: Path | None, before: int | None) -> str:
    """What the counter says about a SIGKILL: the OOM killer, or "" when it cannot tell."""
    after = read_count(file)
    if before is None or after is None or after <= before:
        return ""
    return (
        f"by the out-of-memory killer (the oom_kill count of its memory cgroup, {file}, went from "
        f"{before} to {after})"
    )
