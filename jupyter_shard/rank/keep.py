"""When a rank ends with its kernel, and its lease: how long it lives on after that (``--keep``).

By default a rank ends as soon as its kernel is gone: for a rank started on this machine, when the
lifeline pipe closes or the zygote it was forked from ends (:func:`watch_owner`); for one started by a
node agent (torchrun, SLURM), when the agent ends, or when the connection to the kernel (TCP, with
ZMTP heartbeats) stays down for ``KERNEL_LOST_AFTER`` seconds or never comes up within
``START_WAIT`` seconds (:func:`watch_kernel`). No process outlives its kernel.

A kept pool's ranks instead start a countdown of ``LEASE.seconds`` and wait for a kernel to attach:
a kernel binding the pool's socket again is seen as the connection coming back (ZeroMQ reconnects by
itself), which stops the countdown; a lost connection starts it again. When it runs out with no
kernel attached, rank 0 removes the pool's private directory (socket, store, the record with the
key) and every rank kills its own process group, so nothing is left behind.

A node agent's rank whose agent ends still ends at once (the agent's tether leaves the agent alive
for a kept pool). Rank 0 also writes into the pool's record when the kernel went, where the record is
on its machine, so that ``%dist_pools`` in another kernel can say how long the pool has left.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import zmq

from jupyter_shard._util.atomic import write_private
from jupyter_shard._util.record_lock import record_lock

__all__ = ["LEASE", "Lease", "set_lease", "watch_kernel", "watch_owner"]

POLL = 0.25  # seconds between looks at the lifeline and the connection
KERNEL_LOST_AFTER = 10.0  # a rank started by an agent ends this long after losing the kernel
START_WAIT = 120.0  # ... or when it cannot reach the kernel this long after starting
HEARD_GRACE = 2.0  # seconds a lease set after the kernel's loss waits for a kernel's connection event


class Lease:
    """The rank's current lease; set by the kernel through :func:`set_lease`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.record: Path | None = None  # the pool's kept.json (rank 0 writes when the kernel went)
        self.heard = 0.0  # monotonic time a kernel last set the lease: one was attached then
        self.lock = threading.Lock()


LEASE = Lease()


def set_lease(seconds: float, record: str | None) -> None:
    """Keep this rank for ``seconds`` after its kernel is gone (0: end with it)."""
    with LEASE.lock:
        LEASE.seconds = max(0.0, float(seconds))
        LEASE.record = Path(record) if record else None
        LEASE.heard = time.monotonic()


def watch_owner(lifeline: int, parent_pid: int, events: zmq.Socket[bytes], rank: int) -> None:
    """End this rank when its kernel is gone and the lease (if any) runs out with none attached."""
    from zmq.utils.monitor import recv_monitor_message

    def run() -> None:
        lifeline_open = True
        lost_at: float | None = None
        while True:
            if lifeline_open:
                readable, _, _ = select.select([lifeline], [], [], POLL)
                gone = os.getppid() != parent_pid
                if readable:
                    try:
                        gone = gone or os.read(lifeline, 1) == b""
                    except OSError:
                        gone = True
                if gone:
                    lifeline_open = False
                    lost_at = time.monotonic()
                    _kernel_went(rank)
                    _check(lost_at)
            while events.poll(0 if lifeline_open else int(POLL * 1000)):
                event = recv_monitor_message(events)["event"]
                if lifeline_open:
                    continue  # the first kernel's own pipe says whether it lives
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    lost_at = None
                elif event == zmq.EVENT_DISCONNECTED and lost_at is None:
                    lost_at = time.monotonic()
                    _kernel_went(rank)
            if lost_at is not None:
                _check(lost_at)

    def _check(lost_at: float) -> None:
        with LEASE.lock:
            seconds, record, heard = LEASE.seconds, LEASE.record, LEASE.heard
        if heard > lost_at:
            # The lease was set after the loss: by a kernel that has just attached, whose connection's
            # event has not been read yet, or by the kernel that went, in a cell the rank ran late.
            # Only the event tells them apart: wait for it a little, then count from the setting.
            if time.monotonic() - heard <= HEARD_GRACE:
                return
            lost_at = heard
        if seconds <= 0:
            _end(rank, None, "")
        if time.monotonic() - lost_at > seconds:
            _end(rank, record, f"no kernel attached for {seconds:g} s, the lease of this kept pool")

    threading.Thread(target=run, name="jupyter_shard-lifeline", daemon=True).start()


def watch_kernel(events: zmq.Socket[bytes], parent_pid: int, rank: int) -> None:
    """For a rank started by a node agent: end it when the agent is gone, or when the kernel is gone
    and the lease (if any) runs out with none attached."""
    from zmq.utils.monitor import recv_monitor_message

    def run() -> None:
        lost_since: float | None = time.monotonic()
        ever = noted = False
        while True:
            if events.poll(int(POLL * 1000)):
                event = recv_monitor_message(events)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    lost_since, ever, noted = None, True, False
                elif event == zmq.EVENT_DISCONNECTED and lost_since is None:
                    lost_since = time.monotonic()
            if os.getppid() != parent_pid:
                _end(rank, None, "its node agent is gone", kept=False)
            if lost_since is None:
                continue
            with LEASE.lock:
                seconds, record = LEASE.seconds, LEASE.record
            lost = time.monotonic() - lost_since
            if ever and seconds > 0:
                if not noted:
                    _kernel_went(rank)
                    noted = True
                if lost > seconds:
                    _end(rank, record, f"no kernel attached for {seconds:g} s, the lease of this kept pool")
            elif lost > (KERNEL_LOST_AFTER if ever else START_WAIT):
                why = "the connection to the kernel is gone" if ever else "the kernel could not be reached"
                _end(rank, None, why, kept=False)

    threading.Thread(target=run, name="jupyter_shard-lifeline", daemon=True).start()


def _kernel_went(rank: int) -> None:
    """Rank 0 notes in the pool's record when the kernel went (for ``%dist_pools``' time left)."""
    with LEASE.lock:
        record, seconds = LEASE.record, LEASE.seconds
    if rank != 0 or record is None or seconds <= 0 or not record.exists():
        return  # (on another machine than the kernel's, the tether of node 0's agent notes it)
    try:
        with record_lock(record.parent, wait=5.0):  # attaching kernels change it under the same lock
            data = json.loads(record.read_text())
            data["orphaned_at"], data["owner"] = time.time(), None
            write_private(record, json.dumps(data))
    except (OSError, ValueError) as exc:
        print(f"jupyter_shard: could not note the kernel's end in {record}: {exc}", file=sys.__stderr__)


def _end_peers(record: Path) -> None:
    """Rank 0, ending a kept pool whose lease ran out, ends the other ranks the record names on this
    machine (by pid and start time): one stopped by SIGSTOP or a SLURM suspend cannot end itself,
    and once the record is gone nothing would find it."""
    try:
        ranks = json.loads(record.read_text())["ranks"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for entry in ranks:
        try:
            pid, started = int(entry["pid"]), entry.get("started")
            if pid == os.getpid() or started is None:
                continue
            process = psutil.Process(pid)
            if abs(process.create_time() - float(started)) > 1e-6:
                continue  # the pid names another process now
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)  # its workers too; SIGKILL ends a stopped process
            else:
                os.kill(pid, signal.SIGKILL)
        except (psutil.Error, OSError, KeyError, TypeError, ValueError):
            continue


def _end(rank: int, record: Path | None, why: str, kept: bool = True) -> None:
    """Rank 0 removes the pool's directory (where it is on its machine); every rank kills its own
    process group, or (a rank that is not its group's leader) itself."""
    if why:
        ran_out = " ran out" if kept else ""
        print(f"jupyter_shard: ending this rank: {why}{ran_out}", file=sys.__stderr__, flush=True)
    if rank == 0 and record is not None:
        _end_peers(record)
        shutil.rmtree(record.parent, ignore_errors=True)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)
