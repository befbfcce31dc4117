"""Room for the kernel's connections to many ranks: each rank holds two ZeroMQ connections and a
direct link to the kernel, so a pool of 1,024 ranks needs over 3,000 file descriptors in the kernel,
where many systems start a process with a soft limit of 1,024."""

from __future__ import annotations

import resource

PER_RANK = 4  # the rank's two sockets, its direct link, and room for a pull's shared segment
SPARE = 256  # the kernel's own files, sockets and pipes


def make_room(ranks: int) -> str:
    """Raise this process's soft limit on open files to what ``ranks`` ranks need, up to the hard
    limit; "" when there is room, else one line saying what is short and what to do."""
    need = ranks * PER_RANK + SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return ""
    raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    except (ValueError, OSError):
        raised = soft
    if raised >= need:
        return ""
    return (
        f"{ranks} ranks need about {need} open files in the kernel and its limit is {raised} "
        f"(`ulimit -n`, hard limit {hard}); raise the hard limit before starting Jupyter"
    )
