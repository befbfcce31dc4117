"""The life of a rank process: start up, join the process group, then run cells until told to stop.

Start-up reads its orders from the environment the launcher set (the pool key is removed from
``os.environ`` as soon as it is read, so cells and the processes they start do not see it; the
process's initial environment in ``/proc/<pid>/environ`` still holds it, readable only by the same
user and root, as the 0700 pool directory is), connects to the kernel, joins the default process group
through a FileStore in the pool's private directory, and says ``ready``. A failure at any point is
reported with its traceback and the process exits, so a pool start never waits on a dead rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from types import FrameType
from typing import Any

import zmq

from jupyter_shard._curve import CURVE_ENV
from jupyter_shard.protocol import KEY_ENV, MAX_FRAME, Message, cell_head, io_identity, rank_identity
from jupyter_shard.rank.channel import Channel, ShellSocket, watch_kernel, watch_lifeline
from jupyter_shard.rank.output import RankStream

ENV_PREFIX = "JUPYTER_SHARD_"


class RankState:
    """What the main thread is doing, readable from the I/O thread."""

    def __init__(self) -> None:
        self.executing = False
        self.cell_id = ""
        self.cell_head = ""
        self.started = 0.0

    def begin(self, cell_id: str, code: str) -> None:
        self.cell_id = cell_id
        self.cell_head = cell_head(code)
        self.started = time.time()
        self.executing = True

    def end(self) -> None:
        self.executing = False
        self.cell_head = ""


def _env(name: str) -> str:
    return os.environ[ENV_PREFIX + name]


def _log_path(rank: int) -> str:
    """The rank's log file: named by the pool, or (started by an agent) in the pool's log directory."""
    own = os.environ.get(ENV_PREFIX + "LOG")
    return own or os.path.join(_env("RANK_LOGS"), f"rank-{rank}.log")


def _log_to_own_file(path: str) -> None:
    """A rank started by an agent writes its output (native too) to its own log, as local ranks do."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    key = bytes.fromhex(os.environ.pop(KEY_ENV))
    curve = os.environ.pop(CURVE_ENV, None)  # set for ranks that dial back over TCP
    rank = int(os.environ["RANK"])
    if curve:
        _log_to_own_file(_log_path(rank))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    channel = Channel(ctx, _env("ADDRESS"), key, io_identity(rank), curve)
    shell_sock = ShellSocket(ctx, _env("ADDRESS"), key, rank_identity(rank), curve)
    if ENV_PREFIX + "LIFELINE_FD" in os.environ:
        watch_lifeline(int(_env("LIFELINE_FD")), int(_env("PARENT_PID")))
    else:  # started by an agent: live while the agent and the kernel connection do
        watch_kernel(shell_sock.monitor(), os.getppid())
    state = RankState()
    log = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace")
    lock = threading.Lock()
    sys.stdout = RankStream("stdout", log, channel.enqueue, lambda: state.cell_id, lock)
    sys.stderr = RankStream("stderr", log, channel.enqueue, lambda: state.cell_id, lock)
    channel.flushers.extend([sys.stdout.flush, sys.stderr.flush])
    channel.io_handlers["stacks"] = lambda msg: _reply_stacks(channel, msg)
    channel.io_handlers["status"] = lambda msg: _reply_status(channel, msg, state)
    channel.io_handlers["signal"] = _signal_self
    channel.heartbeat = lambda: _status_body(state)
    channel.start()
    sys.argv = [""]
    try:
        runner = _start_up(rank, channel, shell_sock, state)
    except BaseException:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        channel.close()
        shell_sock.send("startup_failed", {"rank": rank, "traceback": tb})
        time.sleep(0.2)
        os._exit(1)
    runner.loop()


def _start_up(rank: int, channel: Channel, shell_sock: ShellSocket, state: RankState) -> _Runner:
    import torch
    import torch.distributed as dist

    from jupyter_shard.rank import shard as shard_module
    from jupyter_shard.rank.shell import RankShell

    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if _env("DEVICE") == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise RuntimeError(
                f"rank {rank} needs CUDA device {local_rank} but {torch.cuda.device_count()} are visible"
            )
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=float(_env("TIMEOUT")))
    if ENV_PREFIX + "STORE" in os.environ:
        dist.init_process_group(
            backend, init_method="file://" + _env("STORE"), rank=rank, world_size=world_size, timeout=timeout
        )
    else:  # started by torchrun: its store (c10d rendezvous), a prefix per process group
        from torch._C._distributed_c10d import PrefixStore
        from torch.distributed.rendezvous import rendezvous

        store, _, _ = next(rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        _agent_store.append(store)
        dist.init_process_group(
            backend,
            store=PrefixStore("jupyter_shard/group-0/", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    options = json.loads(os.environ.get(ENV_PREFIX + "OPTIONS", "{}"))
    helper = shard_module.Shard(
        rank, local_rank, world_size, device, _env("STRATEGY"), channel.enqueue, options
    )
    shard_module.set_current(helper)
    channel.flushers.append(helper.flush_metrics)
    shell = RankShell.create(channel, {"shard": helper, "__name__": "__main__"})
    shell_sock.send(
        "ready",
        {
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": str(device),
            "log_path": _log_path(rank),
            "node": int(os.environ.get(ENV_PREFIX + "NODE") or os.environ.get("GROUP_RANK") or 0),
            "job": os.environ.get("SLURM_JOB_ID", ""),
        },
    )
    return _Runner(rank, channel, shell_sock, state, shell)


class _Runner:
    """The main thread's loop: one handler per message type, an unknown type is logged."""

    def __init__(self, rank: int, channel: Channel, sock: ShellSocket, state: RankState, shell: Any) -> None:
        self.rank = rank
        self.channel = channel
        self.sock = sock
        self.state = state
        self.shell = shell
        self.handlers = {
            "execute": self.execute,
            "push": self.push,
            "pull": self.pull,
            "shutdown": self.shutdown,
            "release": self.release,
            "regroup": self.regroup,
        }
        # One SIGINT handler for the rank's life: it interrupts a running cell and is a no-op between
        # cells, so a cell costs no sigaction calls; a cell that installs its own is undone after it.
        self._sigint = self._on_sigint
        signal.signal(signal.SIGINT, self._sigint)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """Between cells nothing is interrupted (a no-op handler, not SIG_IGN, which children inherit)."""
        if self.state.executing:
            raise KeyboardInterrupt

    def _own_sigint(self) -> None:
        if signal.getsignal(signal.SIGINT) is not self._sigint:
            signal.signal(signal.SIGINT, self._sigint)

    def loop(self) -> None:
        while True:
            msg = self.sock.recv()
            handler = self.handlers.get(msg.type)
            if handler is None:
                print(f"jupyter_shard: rank {self.rank} ignored a {msg.type!r} message", file=sys.__stderr__)
                continue
            handler(msg)

    def execute(self, msg: Message) -> None:
        body = msg.body
        cell_id, code = str(body["cell_id"]), str(body["code"])
        started = time.perf_counter()
        self.state.begin(cell_id, code)
        try:  # the handler is put back after every cell, so it is ours here
            error = self.shell.run(code, cell_id, int(body.get("exec_count", 0)))
        except KeyboardInterrupt:
            error = ("KeyboardInterrupt", "", ["KeyboardInterrupt"])
        finally:
            self.state.end()
            self._own_sigint()
        name, value, tb = error or ("", "", [])
        self.sock.send(
            "done",
            {
                "io_count": self.channel.flush(),
                "cell_id": cell_id,
                "status": "error" if error else "ok",
                "ename": name,
                "evalue": value,
                "traceback": tb,
                "duration": time.perf_counter() - started,
            },
        )

    def push(self, msg: Message) -> None:
        import cloudpickle

        names = [str(n) for n in msg.body["names"]]
        try:
            values = [cloudpickle.loads(buf) for buf in msg.buffers]
            self.shell.user_ns.update(zip(names, values, strict=True))
            reply: dict[str, Any] = {"req_id": msg.body["req_id"], "ok": True, "error": ""}
        except Exception as exc:
            reply = {"req_id": msg.body["req_id"], "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self.sock.send("push_reply", reply)

    def pull(self, msg: Message) -> None:
        import cloudpickle

        name = str(msg.body["name"])
        reply: dict[str, Any] = {"req_id": msg.body["req_id"], "ok": False, "error": ""}
        buffers: list[bytes] = []
        if name not in self.shell.user_ns:
            reply["error"] = f"name {name!r} is not defined on rank {self.rank}"
        else:
            try:
                value = self.shell.user_ns[name]
                if msg.body.get("gather"):
                    value = self._gathered(name, value)
            except Exception as exc:
                reply["error"] = f"rank {self.rank}: {exc}"
                self.sock.send("pull_reply", reply, buffers)
                return
            try:
                data = cloudpickle.dumps(value)
                if len(data) > MAX_FRAME:
                    reply["error"] = (
                        f"{name!r} is {len(data) / 2**20:.0f} MiB pickled, over the "
                        f"{MAX_FRAME / 2**20:.0f} MiB message limit; save it to a file instead"
                    )
                else:
                    reply["ok"], buffers = True, [data]
            except Exception as exc:
                reply["error"] = f"{name!r} could not be pickled: {type(exc).__name__}: {exc}"
        self.sock.send("pull_reply", reply, buffers)

    def _gathered(self, name: str, value: Any) -> Any:
        """The plain, unsharded model behind ``value`` (a collective: every rank takes part)."""
        from jupyter_shard.rank.shard import current

        helper = current()
        if helper is None or value is not helper.prepared_model:
            raise ValueError(f"--gather applies to the model returned by shard.prepare; {name!r} is not it")
        return helper.full_model()

    def release(self, msg: Message) -> None:
        """Close this idle rank's process groups, so peers blocked in a collective with it fail now.

        A gloo collective waiting on a peer that has left the cell neither times out early nor sees
        SIGINT; closing the peer's connections makes it raise "Connection closed by peer" at once.
        """
        import torch.distributed as dist

        error = ""
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        # The group's sockets close only with its last reference, which torch itself may keep (seen
        # after autograd steps); shutting down the connections to the other ranks frees them anyway.
        pids = [int(pid) for pid in msg.body.get("peers", [])]
        hosts = [str(h) for h in msg.body.get("peer_hosts", [])] or [""] * len(pids)
        here = socket.gethostname()
        # Only processes on this machine can be looked up; ranks elsewhere fall back to the kill.
        closed = _shut_down_connections_to([p for p, h in zip(pids, hosts, strict=False) if h in ("", here)])
        body = {"req_id": msg.body["req_id"], "ok": not error, "error": error, "closed": closed}
        self.sock.send("release_reply", body)

    def regroup(self, msg: Message) -> None:
        """Replace the default process group with a new one on a fresh store (after a release)."""
        import torch.distributed as dist

        from jupyter_shard.rank.shard import current

        started = time.perf_counter()
        reply: dict[str, Any] = {"req_id": msg.body["req_id"], "ok": True, "error": "", "prepared": False}
        try:
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # a group broken by the release: drop it anyway
                    dist.destroy_process_group()
            from torch._C._distributed_c10d import PrefixStore

            backend = "nccl" if _env("DEVICE") == "cuda" else "gloo"
            meet: dict[str, Any] = (
                {"store": PrefixStore(str(msg.body["prefix"]), _agent_store[0])}
                if "prefix" in msg.body
                else {"init_method": "file://" + str(msg.body["store"])}
            )
            dist.init_process_group(
                backend,
                rank=self.rank,
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timedelta(seconds=float(_env("TIMEOUT"))),
                **meet,
            )
            helper = current()
            reply["prepared"] = helper is not None and helper.group_rebuilt()
        except Exception as exc:
            reply["ok"], reply["error"] = False, f"{type(exc).__name__}: {exc}"
        reply["seconds"] = time.perf_counter() - started
        self.sock.send("regroup_reply", reply)

    def shutdown(self, msg: Message) -> None:
        self.channel.close()
        os._exit(0)


def _shut_down_connections_to(peers: list[int]) -> int:
    """Shut down (not close: torch owns the fds) this process's TCP connections to ``peers``' ports."""
    import psutil

    ports: set[int] = set()
    for pid in peers:
        if pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            ports.update(c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp"))
    closed = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd < 0 or not conn.raddr or conn.raddr.port not in ports:
            continue
        sock = socket.socket(fileno=conn.fd)
        try:
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return closed


_agent_store: list[Any] = []  # the torchrun agent's store, kept for rebuilding the process group


def _signal_self(msg: Message) -> None:
    """A signal from the kernel for a rank it cannot signal itself (started by an agent elsewhere)."""
    sig = int(msg.body["signal"])
    if sig == signal.SIGKILL and os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)  # the rank leads its group: its children go too
    elif sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        os.kill(os.getpid(), sig)


def _reply_stacks(channel: Channel, msg: Message) -> None:
    main_id = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        if name.startswith("jupyter_shard-"):
            continue
        lines = traceback.format_stack(frame)
        stacks.append({"thread": "MainThread" if ident == main_id else name, "stack": "".join(lines)})
    channel.enqueue("stacks_reply", {"req_id": msg.body["req_id"], "stacks": stacks}, [])


def _status_body(state: RankState) -> dict[str, Any]:
    from jupyter_shard.rank.shard import current, memory_report

    helper = current()
    return {
        "executing": state.executing,
        "cell": state.cell_head,
        "running_for": time.time() - state.started if state.executing else 0.0,
        "memory": memory_report(helper.device if helper else None),
        "step": helper.global_step if helper else 0,
        "collective": current_collective() if state.executing else "",
    }


_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def current_collective() -> str:
    """The ``torch.distributed`` call the main thread is in (``all_reduce``, ``barrier``…), else ""."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    outermost = ""
    while frame is not None:  # innermost to outermost: the last c10d frame seen is the public call
        if frame.f_code.co_filename.endswith(_C10D):
            outermost = frame.f_code.co_name
        frame = frame.f_back
    return outermost


def _reply_status(channel: Channel, msg: Message, state: RankState) -> None:
    channel.enqueue("status_reply", {"req_id": msg.body["req_id"], **_status_body(state)}, [])
