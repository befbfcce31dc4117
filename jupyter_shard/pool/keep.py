"""Kept pools: list them, attach to one from another kernel, stop one, and ``--keep``'s durations.

A pool started with ``keep`` (``%%distributed --keep 30m``) writes a record into its private 0700
directory (``kept.json``, 0600: it holds the pool's key), so only its user can read it. When its
kernel exits, restarts or is killed, the ranks live on for the lease and end by themselves when it
runs out with no kernel attached (:mod:`jupyter_shard.rank.keep`). :func:`attach` binds the pool's
socket again in this process: the ranks reconnect by themselves, every message stays signed with
the key, and the ranks' namespaces, prepared model and process group are as they were. The history
the dashboard shows comes back from the ranks' own copies of what they logged.

A pool has one kernel at a time. Attaching to a pool whose kernel is alive is refused, naming that
kernel, unless the caller asks to take it over: the record then names the new kernel, and the old
one lets go (its watcher thread reads the record) before the new one binds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_shard._util.atomic import write_private
from jupyter_shard._util.private_files import read_private_json
from jupyter_shard._util.record_lock import RecordBusy, record_lock
from jupyter_shard.errors import PoolError, SpecError
from jupyter_shard.launchers import get_launcher
from jupyter_shard.launchers.base import KEPT_RECORD, started_at
from jupyter_shard.launchers.spec_record import from_record
from jupyter_shard.pool.launches import warm_zygote
from jupyter_shard.pool.lifecycle import DIR_PREFIX, runtime_root
from jupyter_shard.pool.pool import Pool
from jupyter_shard.pool.ranks import RankRecord, RankState
from jupyter_shard.spec import LaunchSpec
from jupyter_shard.wire.messages import HISTORY, STATUS

__all__ = ["KeptPool", "attach", "kept_pools", "parse_duration", "pools_table", "stop"]

CONNECT_WAIT = 5.0  # seconds for every rank to reconnect to the attaching kernel
RELEASE_WAIT = 5.0  # seconds the owner of a pool being taken over has to let go
_DURATION = re.compile(
    r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$"
)


def parse_duration(text: str) -> float:
    """``30m``, ``2h``, ``1h30m``, ``90s``, ``90`` (seconds) or ``0``: seconds."""
    match = _DURATION.fullmatch(text.strip().lower())
    if not text.strip() or match is None:
        raise SpecError(
            f"--keep {text}: give a duration such as 30m, 2h, 1h30m or 90s (0: end with the kernel)"
        )
    days, hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    return days * 86400 + hours * 3600 + minutes * 60 + seconds


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass(frozen=True)
class KeptPool:
    """A kept pool as its record describes it, and whether its processes live."""

    id: str
    directory: Path
    record: dict[str, Any]

    @property
    def world_size(self) -> int:
        return len(self.record["ranks"])

    @property
    def spec(self) -> LaunchSpec:
        return from_record(self.record["spec"])

    @property
    def owner(self) -> int | None:
        """The pid of the kernel attached to it, if that kernel lives."""
        owner = self.record.get("owner")
        if not owner:
            return None
        pid, started = owner
        return int(pid) if _alive(int(pid), started) else None

    @property
    def processes(self) -> list[tuple[int, float | None]]:
        """What on this machine the pool's life hangs on (its ranks, or its node agents' tethers)."""
        return [(int(pid), started) for pid, started in self.record["processes"]]

    def alive(self) -> bool:
        return any(_alive(pid, started) for pid, started in self.processes)

    def time_left(self, now: float | None = None) -> float | None:
        """Seconds until the lease runs out; None while a kernel is attached."""
        if self.owner is not None:
            return None
        since = self.record.get("orphaned_at") or _mtime(self.directory / KEPT_RECORD)
        return max(0.0, float(self.record["keep"]) - ((now or time.time()) - since))

    def row(self, now: float) -> list[str]:
        left = self.time_left(now)
        owner = self.owner
        attached = f"kernel pid {owner}" if owner is not None else "none"
        return [
            self.id,
            str(self.world_size),
            self.spec.strategy,
            self.spec.device.value,
            format_duration(now - float(self.record["created"])),
            "while attached" if left is None else format_duration(left),
            attached,
            os.path.basename(str(self.record.get("notebook", ""))),
        ]


def kept_pools() -> list[KeptPool]:
    """This user's kept pools on this machine with at least one rank alive."""
    found = []
    for record_path in sorted(runtime_root().glob(f"{DIR_PREFIX}*/{KEPT_RECORD}")):
        directory = record_path.parent
        try:  # through the opened directory and file, owner and mode checked on them: no link race
            kept = KeptPool(
                directory.name.removeprefix(DIR_PREFIX), directory, read_private_json(record_path)
            )
            if kept.alive():
                found.append(kept)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def find(pool_id: str | None) -> KeptPool:
    """The kept pool ``pool_id`` (a unique prefix will do), or the only one there is."""
    pools = kept_pools()
    if not pools:
        raise PoolError(
            "there is no kept pool on this machine: start one with %%distributed --keep 30m "
            "(or one whose lease ran out has ended)"
        )
    if pool_id is None:
        if len(pools) > 1:
            ids = ", ".join(p.id for p in pools)
            raise PoolError(f"there are {len(pools)} kept pools ({ids}); name one: %dist_attach ID")
        return pools[0]
    chosen = [p for p in pools if p.id.startswith(pool_id)]
    if len(chosen) != 1:
        ids = ", ".join(p.id for p in pools)
        what = "no" if not chosen else "more than one"
        raise PoolError(f"{what} kept pool has the id {pool_id!r}; the kept pools are {ids} (%dist_pools)")
    return chosen[0]


def pools_table(pools: list[KeptPool]) -> str:
    """``%dist_pools`` and ``python -m jupyter_shard pools``: a row per kept pool."""
    if not pools:
        return "no kept pools (start one with %%distributed --keep 30m)"
    now = time.time()
    head = ["id", "ranks", "strategy", "device", "age", "time left", "kernel", "notebook"]
    rows = [head, *(p.row(now) for p in pools)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def attach(
    pool_id: str | None = None,
    take_over: bool = False,
    pool: Pool | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> Pool:
    """Make a kept pool this process's: its ranks, namespaces, prepared model and process group.

    ``pool``, if given, becomes it; if it runs, it is let go first (:func:`let_go`, told to ``say``).
    The record is changed under its lock (:mod:`~jupyter_shard._util.record_lock`): of two kernels
    attaching at once one gets the pool and the other a refusal naming it."""
    kept = find(pool_id)
    _check_attachable(kept)
    owner = kept.owner
    if owner is not None:
        if not take_over:
            raise PoolError(
                f"pool {kept.id} is attached to kernel pid {owner} ({kept.record.get('notebook', '')}); "
                f"%dist_attach {kept.id} --take-over makes it this kernel's"
            )
        _take_over(kept, owner)
    try:
        with record_lock(kept.directory):
            kept = _read_again(kept)  # as it is now that no one else can change it
            _check_attachable(kept)
            if kept.owner is not None:
                raise PoolError(
                    f"pool {kept.id} was attached by kernel pid {kept.owner} a moment ago; "
                    f"%dist_attach {kept.id} --take-over makes it this kernel's"
                )
            return _adopt(kept, pool, say)
    except RecordBusy:
        raise PoolError(
            f"pool {kept.id} is being attached by another kernel; %dist_pools shows which, in a moment"
        ) from None


def _check_attachable(kept: KeptPool) -> None:
    """Refused before anything is let go: this kernel's already, a process gone, an unreadable spec."""
    if kept.owner == os.getpid():
        raise PoolError(f"pool {kept.id} is this kernel's already")
    gone = [pid for pid, started in kept.processes if not _alive(pid, started)]
    if gone:
        raise PoolError(
            f"pool {kept.id} cannot be attached: its process {', '.join(map(str, gone))} has ended; "
            f"python -m jupyter_shard stop {kept.id} clears it (this kernel's pool is untouched)"
        )
    try:
        kept.spec  # noqa: B018  (read to check it)
    except (ValueError, KeyError, TypeError) as exc:
        raise PoolError(f"pool {kept.id}'s record does not read back ({exc}); nothing was changed") from None


def _read_again(kept: KeptPool) -> KeptPool:
    try:
        return KeptPool(kept.id, kept.directory, read_private_json(kept.directory / KEPT_RECORD))
    except (OSError, ValueError) as exc:
        raise PoolError(
            f"pool {kept.id} ended while attaching ({exc}); %dist_pools lists the others"
        ) from None


def _adopt(kept: KeptPool, pool: Pool | None, say: Callable[[str], None]) -> Pool:
    """Bind the kept pool's socket in this process and wait for its ranks (under the record's lock)."""
    record, spec = kept.record, kept.spec
    if pool is not None and pool.started:
        let_go(pool, say)
    pool = pool or Pool(spec=spec)
    pool.spec = spec
    handles = pool.adopt(kept.directory, record)
    for handle, entry in zip(handles, record["ranks"], strict=True):
        rank = RankRecord(handle, Path(entry["log"]))
        rank.state, rank.device, rank.heartbeat = RankState.IDLE, str(entry["device"]), time.monotonic()
        rank.recount = True  # its I/O count goes on from the kernel that had it (see _wait_connected)
        pool.ranks.add(rank)
        pool.sink.log_paths[rank.rank] = str(entry["log"])
    try:
        statuses = _wait_connected(pool)
        pool.hold(float(record["keep"]))  # the ranks' lease goes on; the record names this kernel now
        _restore_history(pool)
        running = {k: body for k, body in statuses.items() if body.get("executing") and body.get("cell_id")}
        if running:  # a cell a kernel before this one left running: followed as a background run
            first = running[min(running)]
            pool.follow(str(first["cell_id"]), sorted(running), str(first.get("cell", "")))
    except BaseException:
        pool.release()
        raise
    with contextlib.suppress(Exception):  # only a head start: a restart starts one anyway
        warm_zygote(spec)  # for a restart of the pool this kernel now holds
    return pool


def let_go(pool: Pool, say: Callable[[str], None]) -> None:
    """Before this kernel's running pool is replaced: a kept one is released (it waits out its lease
    for a kernel to attach), any other stopped, and ``say`` is told which."""
    if pool.keep > 0:
        described = pool.spec.describe()
        say(f"jupyter_shard: letting go of this kernel's kept pool ({described}); %dist_pools lists it")
        pool.release()
    else:
        say("jupyter_shard: stopping this kernel's pool; its rank state is lost")
        pool.shutdown()


def stop(pool_id: str, force: bool = False) -> str:
    """End a kept pool's ranks and remove its directory; refused while a kernel holds it (``force``)."""
    kept = find(pool_id)
    owner = kept.owner
    if owner is not None and not force:
        raise PoolError(f"pool {kept.id} is attached to kernel pid {owner}; stop it there, or use --force")
    get_launcher(kept.record["launcher"]).end_kept(kept.record["launcher_state"], kept.processes)
    shutil.rmtree(kept.directory, ignore_errors=True)
    return f"stopped kept pool {kept.id} ({kept.world_size} ranks, {kept.spec.strategy})"


def _take_over(kept: KeptPool, owner: int) -> None:
    """Ask the owning kernel to let go (it reads the record), and wait until it has. If it does not
    within :data:`RELEASE_WAIT` (a cell runs there), the request is withdrawn, so that the owner
    does not let go later for a kernel that gave up."""
    path = kept.directory / KEPT_RECORD
    me = [os.getpid(), started_at(os.getpid())]
    with record_lock(kept.directory):
        write_private(path, json.dumps(dict(read_private_json(path), take_over=me)))
    deadline = time.monotonic() + RELEASE_WAIT
    while time.monotonic() < deadline:
        if _nobody_holds(path):
            return
        time.sleep(0.05)
    with record_lock(kept.directory):
        current = read_private_json(path)
        if _nobody_holds(path):
            return  # it let go as the wait ran out
        if current.get("take_over") == me:
            write_private(path, json.dumps({k: v for k, v in current.items() if k != "take_over"}))
    raise PoolError(
        f"kernel pid {owner} did not let go of pool {kept.id} within {RELEASE_WAIT:.0f} s (a cell runs "
        "there); the request was withdrawn and the pool stays that kernel's; try again when its cell ends"
    )


def _nobody_holds(path: Path) -> bool:
    """Whether the record names no living kernel."""
    current = read_private_json(path)
    return not current.get("owner") or not _alive(int(current["owner"][0]), current["owner"][1])


def _wait_connected(pool: Pool) -> dict[int, dict[str, Any]]:
    """Every rank's status, once each answers on both its threads' connections (ZeroMQ reconnects
    every 0.1 s). A rank still running a cell cannot answer on its main thread's: it is not asked."""
    deadline = time.monotonic() + CONNECT_WAIT
    statuses: dict[int, dict[str, Any]] = {}
    while len(statuses) < len(pool.ranks.records):
        for r in pool.ranks:
            if r.rank in statuses:
                continue
            try:
                replies = pool.connection.request(*STATUS({}), [r], timeout=0.2)
            except PoolError:
                replies = {}
            if r.rank in replies:
                statuses[r.rank] = dict(replies[r.rank].body)
        if len(statuses) < len(pool.ranks.records):
            if time.monotonic() > deadline:
                pending = [r for r in pool.ranks if r.rank not in statuses]
                gone = [r.rank for r in pending if r.handle.poll() is not None]
                why = f"rank {gone} ended" if gone else f"rank {[r.rank for r in pending]} did not reconnect"
                raise PoolError(f"could not attach: {why} within {CONNECT_WAIT:.0f} s")
            time.sleep(0.05)
    if not any(body.get("executing") for body in statuses.values()):
        for _ in range(int(CONNECT_WAIT / 0.05)):  # the main threads' sockets reconnect on their own time
            try:
                pool.run_own("pass")
                break
            except PoolError:
                time.sleep(0.05)
        else:
            pool.run_own("pass")
    return statuses


def _restore_history(pool: Pool) -> None:
    """The dashboard's history, from what each rank logged (its own copy, sent by its I/O thread)."""
    replies = pool.connection.request(*HISTORY({}), list(pool.ranks), timeout=CONNECT_WAIT)
    pool.history.clear()
    for rank, reply in sorted(replies.items()):
        records = ({"step": s, "ts": ts, "values": v} for s, ts, v in reply.body["records"])
        pool.history.extend(rank, records)


def _alive(pid: int, started: float | None) -> bool:
    now = started_at(pid)
    return now is not None and started in (None, now)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()
