"""A pool's life: its private directory, socket and key, its rank processes; start, stop, clean-up.

:class:`Lifecycle` starts a pool (a 0700 directory, the ROUTER socket and key, a lifeline pipe whose
write end only this process holds, the launcher's rank processes) and waits until every rank joined
the process group; it stops it the same way back. When the kernel dies, every rank sees the lifeline
close and kills its own process group. Each pool writes ``pool.json`` (kernel and rank pids with
their start times) into its private directory. A later start removes directories whose kernel is
gone, killing their recorded ranks only when pid *and* start time still match - never by process name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import astuple
from pathlib import Path
from typing import Any

import zmq

from jupyter_shard._util.atomic import write_private
from jupyter_shard._util.net import free_port
from jupyter_shard._util.open_files import make_room
from jupyter_shard._util.private_files import read_private_json
from jupyter_shard._util.record_lock import record_lock
from jupyter_shard.env import LOG_DIR_VAR, RUNTIME_DIR_VAR, START_TIMEOUT_VAR
from jupyter_shard.errors import PoolError
from jupyter_shard.launchers import Launcher, get_launcher
from jupyter_shard.launchers.base import KEPT_RECORD, KeptRank, RankHandle, started_at
from jupyter_shard.launchers.local import kill_recorded
from jupyter_shard.launchers.spec_record import to_record
from jupyter_shard.pool.connection import Connection
from jupyter_shard.pool.launches import rank_launch
from jupyter_shard.pool.ranks import RankRecord, RankState, RankTable
from jupyter_shard.spec import LaunchSpec, format_ranks
from jupyter_shard.wire.curve import CurveKeys, CurveServer
from jupyter_shard.wire.messages import SHUTDOWN
from jupyter_shard.wire.protocol import KERNEL, MAX_FRAME, Wire, new_key

START_TIMEOUT = float(os.environ.get(START_TIMEOUT_VAR, "180"))

DIR_PREFIX = "jupyter_shard-"
SEEN_RECORD = "seen.json"  # a kept pool's: the last seq its kernel took from each rank (0600)
_POOL_DIR_NAME = re.compile(re.escape(DIR_PREFIX) + r"[a-z0-9_]{8}")


def runtime_root() -> Path:
    """Where private pool directories go: $JUPYTER_SHARD_RUNTIME_DIR, else ``jupyter_shard-UID`` in
    the temp directory, this user's alone (0700), made on first use and refused in one line if it is
    a link or another user's (someone could otherwise plant records there). Not ``$XDG_RUNTIME_DIR``:
    logind removes it at the user's last logout, under a kept pool a server left running."""
    configured = os.environ.get(RUNTIME_DIR_VAR)
    if configured:
        return Path(configured)
    root = Path(tempfile.gettempdir()) / f"jupyter_shard-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PoolError(
            f"{root} is not this user's private directory (a link, another user's, or open to others); "
            f"remove it, or set {RUNTIME_DIR_VAR} to a directory of your own"
        )
    return root


def new_pool_dir() -> Path:
    """A fresh private (0700) directory for one pool's socket, store and record."""
    return Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir=runtime_root()))


def record_pool(directory: Path, rank_pids: list[int]) -> None:
    record = {
        "kernel": [os.getpid(), started_at(os.getpid())],
        "ranks": [[pid, started_at(pid)] for pid in rank_pids],
    }
    write_private(directory / "pool.json", json.dumps(record))  # 0600: read back by read_private_json


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
            record = read_private_json(directory / "pool.json")  # no link race: see private_files
            kernel_pid, kernel_start = _pid_and_start(record["kernel"])
            ranks = [_pid_and_start(item) for item in record["ranks"]]
        except (OSError, ValueError, KeyError, TypeError):
            # unreadable, or written by another version: nothing in it can be trusted to kill by
            if _older_than(directory, 3600):
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
            continue
        if kernel_start is not None and started_at(kernel_pid) == kernel_start:
            continue
        if (directory / KEPT_RECORD).exists() and any(
            started is not None and started_at(pid) == started for pid, started in ranks
        ):
            continue  # a kept pool (--keep) waiting for a kernel: its ranks end it when its lease runs out
        for pid, started in ranks:
            if started is not None and started_at(pid) == started:
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
    base = root or Path(os.environ.get(LOG_DIR_VAR, Path.home() / ".cache" / "jupyter_shard" / "logs"))
    path = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


class Lifecycle:
    """Starts and stops one pool's processes and what they share with the kernel."""

    def __init__(self, conn: Connection, ranks: RankTable, log_root: Path | None) -> None:
        self.conn = conn
        self.ranks = ranks
        self.log_root = log_root
        self.directory: Path | None = None  # the pool's private 0700 directory (socket, stores, record)
        self.log_dir: Path | None = None
        self.address = ""  # where ranks connect: ipc:// here, tcp:// for a multi-node pool
        self.launcher: Launcher | None = None
        self.curve: CurveServer | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._lifeline_w: int | None = None
        self.key = b""  # the pool's signing key (a kept pool's record holds it)
        self.taken_by = ""  # the kernel that took this kept pool over, until the next start says so
        self.started_at = 0.0

    def start(self, spec: LaunchSpec, signal_sender: Callable[[int, int], None]) -> list[RankRecord]:
        """Spawn every rank (not waiting for them); the records of the ranks started."""
        if short := make_room(spec.world_size):
            raise PoolError(short)
        clean_stale_pools()
        launcher = self.launcher = get_launcher(spec.launcher)
        launcher.set_signal_sender(signal_sender)
        key = self.key = new_key()
        self.started_at = time.time()
        self.directory = new_pool_dir()
        self.log_dir = new_log_dir(self.log_root)
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        curve: CurveKeys | None = None
        direct: str | None = None  # where local ranks open their direct links
        try:
            if launcher.remote:
                # Ranks elsewhere dial back over TCP, on the address the user chose, and only through
                # an encrypted channel that admits the pool's own client key.
                curve = CurveKeys.new()
                self.curve = CurveServer(self._ctx, curve)
                self.curve.secure(sock)
                sock.bind(f"tcp://{launcher.bind_address(spec)}:0")
                self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self.address = f"ipc://{self.directory / 'pool.sock'}"
                sock.bind(self.address)
                direct = self._listen_for_links(self.directory / "direct.sock")
        except BaseException:  # an option only the launcher checks (no --interface): nothing left open
            sock.close(linger=0)
            self.teardown()
            raise
        self.conn.attach(sock, Wire(key, KERNEL))
        lifeline_r, self._lifeline_w = os.pipe()
        # One MASTER_PORT for the whole pool, as torchrun gives: code that meets on it finds one place.
        port = free_port()
        launches = [
            rank_launch(
                spec,
                rank,
                address=self.address,
                key=key,
                lifeline_fd=lifeline_r,
                master_port=port,
                curve=curve,
                pool_dir=self.directory,
                log_dir=self.log_dir,
                direct=direct,
            )
            for rank in range(spec.world_size)
        ]
        try:
            handles = launcher.start(spec, launches, lifeline_r)
        except BaseException:
            os.close(lifeline_r)
            self.teardown()
            raise
        os.close(lifeline_r)
        records = []
        for handle, launch in zip(handles, launches, strict=True):
            record = RankRecord(handle, launch.log_path)
            self.ranks.add(record)
            records.append(record)
        record_pool(self.directory, [h.pid for h in handles if h.pid] + launcher.local_pids())
        return records

    def _listen_for_links(self, path: Path) -> str | None:
        """Where local ranks open their direct links; ``None`` (they use the socket) if it cannot be."""
        try:
            return self.conn.links.listen(path)
        except OSError as exc:  # e.g. a runtime directory whose path is too long for a Unix socket
            print(f"jupyter_shard: ranks talk over the pool socket only ({path}: {exc})", file=sys.__stderr__)
            return None

    def wait_ready(self, notice: Callable[[str], None], progress: Callable[[], None] = lambda: None) -> None:
        """Receive until every rank said ``ready``; a rank that failed or took too long raises.
        ``progress`` is called every 0.1 s meanwhile (the side panel shows how many are ready)."""
        deadline = time.monotonic() + START_TIMEOUT
        shown = ""
        while self.ranks.starting():
            self.conn.pump(0.1)
            progress()
            for r in self.ranks:
                code = r.handle.poll()
                if code is not None and r.state is RankState.STARTING:
                    self.conn.pump(0.2)
                    raise PoolError(self._startup_failure(r, r.handle.exit_reason(code)))
            waiting = self.launcher.waiting() if self.launcher is not None else None
            if waiting:  # a queued job or nodes yet to join: the start-up clock has not started
                deadline = time.monotonic() + START_TIMEOUT
                if waiting != shown:
                    notice(waiting)
                    shown = waiting
            if time.monotonic() > deadline:
                slow = [r.rank for r in self.ranks.starting()]
                raise PoolError(
                    f"rank {format_ranks(slow)} did not start within {START_TIMEOUT:.0f} s; "
                    f"see the logs in {self.log_dir}"
                )

    def _startup_failure(self, r: RankRecord, how: str) -> str:
        tb = r.exit or _tail(r.log_path)
        if not r.exit and not r.log_path.exists():
            tb = r.handle.startup_tail() or tb  # the rank never got as far as its own log: say why
        return f"rank {r.rank} failed to start ({how}); its log {r.log_path} ends with:\n{tb}"

    def stop(self) -> None:
        """Stop every rank (and its children) and release the socket, key and private directory."""
        if self.conn.open:
            for r in self.ranks.live():
                with contextlib.suppress(PoolError):  # one not (yet) connected: it is killed below
                    self.conn.send([r], *SHUTDOWN({}))
        deadline = time.monotonic() + 1.0
        for r in self.ranks:
            r.handle.wait(max(0.0, deadline - time.monotonic()))
            r.handle.kill_tree()
        self.ranks.clear()
        if self.launcher is not None:
            self.launcher.stop()
            self.launcher = None
        self.teardown()

    # -- kept pools (--keep) ---------------------------------------------------------------------

    def keep(self, seconds: float, spec: LaunchSpec, let_go: Callable[[str], bool] | None = None) -> Path:
        """Let the ranks outlive this kernel (or no longer, for 0): the launcher leaves them alive and
        the record (0600, with the key) says how to attach; its path."""
        assert self.directory is not None and self.launcher is not None and self.key
        if seconds > 0 and not self.launcher.keeps:
            raise PoolError(f"--launcher {spec.launcher} cannot keep a pool; start it with another launcher")
        if seconds > 0 and not self._local_processes():
            raise PoolError(
                "--keep: no process of this pool runs from this machine (its nodes joined by hand), so "
                "no kernel here could attach to it; start it with --hosts to keep it"
            )
        pids = [r.handle.pid for r in self.ranks]
        self.launcher.keep(pids, seconds > 0)
        path = self.directory / KEPT_RECORD
        if seconds <= 0:
            path.unlink(missing_ok=True)
            return path
        record = {
            "format": 2,
            "created": self.started_at,
            "keep": seconds,
            "notebook": os.environ.get("JPY_SESSION_NAME") or os.path.basename(sys.argv[0] or "python"),
            "owner": [os.getpid(), started_at(os.getpid())],
            "orphaned_at": None,
            "address": self.address,
            "key": self.key.hex(),
            "curve": self._curve_keys(),
            "launcher": spec.launcher,
            "launcher_state": self.launcher.kept_state(),
            # what on this machine the pool's life hangs on: its ranks, or the node agents' tethers
            "processes": [[pid, started_at(pid)] for pid in self._local_processes()],
            "log_dir": str(self.log_dir or ""),
            "options": spec.describe(),
            "spec": to_record(spec),  # JSON: reading a record never unpickles
            "ranks": [_rank_entry(r, not self.launcher.remote) for r in self.ranks],
        }
        write_private(path, json.dumps(record))
        if let_go is not None:
            threading.Thread(target=_watch_take_over, args=(path, let_go), daemon=True).start()
        return path

    def _curve_keys(self) -> list[str] | None:
        if self.curve is None:
            return None
        keys = self.curve.keys
        return [k.decode() for k in astuple(keys)]

    def _local_processes(self) -> list[int]:
        assert self.launcher is not None
        ranks = [] if self.launcher.remote else [r.handle.pid for r in self.ranks]
        return ranks + self.launcher.local_pids()

    def note_seen(self) -> None:
        """For a kept pool: write down the last message taken from each rank, so that a kernel that
        attaches later refuses those messages, replayed (written when a cell ends and on release)."""
        wire, directory = self.conn.wire, self.directory
        if wire is None or directory is None or not (directory / KEPT_RECORD).exists():
            return
        with contextlib.suppress(OSError):
            write_private(directory / SEEN_RECORD, json.dumps(wire.seen()))

    def release(self) -> None:
        """Let go of the ranks without stopping them (the kernel exits, or another kernel takes the
        pool over): the socket closes and the lifeline with it, and the private directory stays."""
        with self.conn.lock:
            if self.directory is not None:
                self.note_seen()
                _let_go_of(self.directory / KEPT_RECORD)
            self.ranks.clear()
            self.launcher = None
            self.directory = None  # kept: the ranks remove it when their lease runs out
            self.teardown()

    def adopt(
        self, directory: Path, record: Mapping[str, Any], signal_sender: Callable[[int, int], None]
    ) -> list[RankHandle]:
        """Become the kernel of a kept pool's ranks: bind their socket again (they reconnect, through
        the same Curve keys if they dial back over TCP); the ranks' handles."""
        self.directory, self.address = directory, str(record["address"])
        self.log_dir = Path(record["log_dir"]) if record.get("log_dir") else None
        self.key, self.started_at = bytes.fromhex(record["key"]), float(record["created"])
        ranks = [
            KeptRank(int(r["rank"]), int(r["pid"]), r["started"], str(r.get("host", "")), r.get("node"))
            for r in record["ranks"]
        ]
        launcher, handles = get_launcher(record["launcher"]).adopt(record["launcher_state"], ranks)
        launcher.set_signal_sender(signal_sender)
        self.launcher = launcher
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        try:
            if record.get("curve"):
                self.curve = CurveServer(self._ctx, CurveKeys(*(k.encode() for k in record["curve"])))
                self.curve.secure(sock)
            sock.bind(self.address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self.directory = None
            self.teardown()
            taken = "tcp://" in self.address and exc.errno == errno.EADDRINUSE
            why = (
                "another program took its port while no kernel held the pool; free the port (ss -ltnp "
                "shows who holds it) and attach again, or end the pool: python -m jupyter_shard stop "
                + directory.name.removeprefix(DIR_PREFIX)
                if taken
                else str(exc)
            )
            raise PoolError(f"cannot bind the kept pool's socket {self.address}: {why}") from None
        wire = Wire(self.key, KERNEL)
        with contextlib.suppress(OSError, ValueError):  # none yet: the kernel before died before a cell ended
            wire.refuse_up_to(read_private_json(directory / SEEN_RECORD))
        self.conn.attach(sock, wire)
        _own_pool_record(directory)
        return handles

    def teardown(self) -> None:
        if self.curve is not None:
            self.curve.stop()
            self.curve = None
        self.conn.detach()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._lifeline_w is not None:
            os.close(self._lifeline_w)
            self._lifeline_w = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return "(no log)"
    return data.decode(errors="replace").strip() or "(the log is empty)"


def _rank_entry(r: RankRecord, here: bool) -> dict[str, object]:
    """One rank in a kept pool's record: enough to attach to it (by pid and start time ``here``)."""
    pid = r.handle.pid
    return {
        "rank": r.rank,
        "pid": pid,
        "started": started_at(pid) if here else None,
        "host": r.handle.host,
        "node": r.handle.node,
        "device": r.device,
        "log": str(r.log_path),
    }


def _own_pool_record(directory: Path) -> None:
    """``pool.json`` names this kernel from now: the stale-pool clean-up of another kernel, finding
    the first kernel dead, would otherwise kill the ranks of a pool this kernel attached to once its
    kept record is gone (``--keep 0``)."""
    try:
        record = read_private_json(directory / "pool.json")
    except (OSError, ValueError):
        return
    record["kernel"] = [os.getpid(), started_at(os.getpid())]
    write_private(directory / "pool.json", json.dumps(record))


def _let_go_of(path: Path) -> None:
    """The record of a kept pool this process lets go of names no kernel, from now (its lease starts)."""
    try:
        with record_lock(path.parent, wait=5.0):
            data = read_private_json(path)
            if data.get("owner") and data["owner"][0] == os.getpid():
                data["owner"], data["orphaned_at"] = None, time.time()
                write_private(path, json.dumps(data))
    except (OSError, ValueError):
        return


def _watch_take_over(path: Path, let_go: Callable[[str], bool]) -> None:
    """While ``path`` (a kept pool's record) names this process as its kernel: when another kernel
    asks to take the pool over, ``let_go(who)`` (true once this kernel has let go)."""
    me = os.getpid()
    while True:
        time.sleep(0.1)
        try:
            data = read_private_json(path)
        except (OSError, ValueError):
            return  # the pool stopped, or its record went with --keep 0
        owner, taker = data.get("owner"), data.get("take_over")
        if not owner or owner[0] != me:
            return
        asked = bool(taker) and taker[0] != me and started_at(int(taker[0])) == taker[1]
        if asked and let_go(f"kernel pid {taker[0]}"):
            return  # it released the pool, which says so in the record
