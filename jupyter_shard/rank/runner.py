"""The rank's main-thread loop and its handlers: run cells, take pushes, answer pulls, release and
rebuild the process group, stop. One handler per message type the registry sends a rank's main
thread (:func:`~jupyter_shard.wire.messages.handler_table` checks there is exactly that); an unknown type
is logged."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import traceback
from types import FrameType
from typing import TYPE_CHECKING, Any

from jupyter_shard.rank.channel import Channel, ShellSocket
from jupyter_shard.rank.cuda_errors import lost_context
from jupyter_shard.wire.messages import (
    DEBUG_RESPONSE,
    DONE,
    PULL_REPLY,
    PUSH_REPLY,
    REGROUP_REPLY,
    RELEASE_REPLY,
    DebugSetup,
    PushReply,
    RegroupReply,
    handler_table,
)
from jupyter_shard.wire.protocol import Message, cell_head

if TYPE_CHECKING:
    from jupyter_shard.rank.group import PoolGroup


class CellState:
    """What the main thread is doing, and its process group, readable from the I/O thread."""

    def __init__(self) -> None:
        self.executing = False
        self.cell_id = ""
        self.cell_head = ""
        self.started = 0.0
        self.group: PoolGroup | None = None  # once built; the I/O thread aborts it on an NCCL pool
        self.waiting = ""  # the prompt the main thread waits at for the notebook's answer, or ""
        self.stopped_at_prompt = False  # an interrupt came while pdb waited for an answer

    def begin(self, cell_id: str, code: str) -> None:
        self.cell_id = cell_id
        self.cell_head = cell_head(code)
        self.started = time.time()
        self.executing = True

    def end(self) -> None:
        self.executing = False
        self.cell_head = ""


class Runner:
    """The main thread's loop: one handler per message type, an unknown type is logged."""

    def __init__(
        self,
        rank: int,
        channel: Channel,
        sock: ShellSocket,
        state: CellState,
        shell: Any,
        group: PoolGroup,
    ) -> None:
        self.rank = rank
        self.channel = channel
        self.sock = sock
        self.state = state
        self.shell = shell
        self.group = group
        self.handlers = handler_table(
            "rank",
            {
                "execute": self.execute,
                "push": self.push,
                "pull": self.pull,
                "shutdown": self.shutdown,
                "release": self.release,
                "regroup": self.regroup,
                "answer": self.stale_answer,
                "debug_request": self.debug_request,
            },
        )
        self.deferred: list[Message] = []  # came while a cell waited at a prompt; handled after it
        self.lost_context = ""  # the CUDA error that lost this process's context for good, once seen
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
            msg = self.deferred.pop(0) if self.deferred else self.sock.recv()
            handler = self.handlers.get(msg.type)
            if handler is None:
                print(f"jupyter_shard: rank {self.rank} ignored a {msg.type!r} message", file=sys.__stderr__)
                continue
            try:
                handler(msg)
            except Exception:  # the rank stays: the kernel's request times out and says so
                print(
                    f"jupyter_shard: rank {self.rank} failed to handle a {msg.type!r} message:",
                    file=sys.__stderr__,
                )
                traceback.print_exc(file=sys.__stderr__)

    def execute(self, msg: Message) -> None:
        body = msg.body
        cell_id, code = str(body["cell_id"]), str(body["code"])
        started = time.perf_counter()
        _follow_directory(str(body.get("cwd", "")))
        self.group.free_retired()
        self.state.begin(cell_id, code)
        failure: BaseException | None = None
        try:  # the handler is put back after every cell, so it is ours here
            if body.get("post_mortem"):
                error = self.shell.post_mortem(cell_id)
            elif "debug" in body:
                error = self._run_traced(code, cell_id, int(body.get("exec_count", 0)), body["debug"])
            else:
                error = self.shell.run(code, cell_id, int(body.get("exec_count", 0)))
        except KeyboardInterrupt as exc:
            error, failure = ("KeyboardInterrupt", "", ["KeyboardInterrupt"]), exc
        finally:
            self.state.end()
        if error and failure is None:
            failure = self.shell.kept_error
        if failure is not None and not self.lost_context:
            self.lost_context = lost_context(failure)  # from the exception: the device is not asked
        if self.state.stopped_at_prompt:  # pdb was left by the kernel's interrupt: say so, trace off
            self.state.stopped_at_prompt = False
            sys.settrace(None)
            error = ("KeyboardInterrupt", "", ["KeyboardInterrupt: stopped at a pdb prompt"])
            self._own_sigint()
        name, value, tb = error or ("", "", [])
        ungrouped = self.group.unusable(failure)
        self.sock.send(
            *DONE(
                {
                    "io_count": self.channel.flush(),
                    "cell_id": cell_id,
                    "status": "error" if error else "ok",
                    "ename": name,
                    "evalue": value,
                    "traceback": tb,
                    "duration": time.perf_counter() - started,
                    "grouped": not ungrouped,
                    "ungrouped": ungrouped,
                    "lost_context": self.lost_context,
                }
            )
        )

    def _run_traced(
        self, code: str, cell_id: str, exec_count: int, setup: DebugSetup
    ) -> tuple[str, str, list[str]] | None:
        """A cell while the notebook's debugger is on: under its file name, stopping at breakpoints."""
        from jupyter_shard.rank.tracer import RankTracer

        tracer = RankTracer(self.rank, self.sock, self.while_waiting)
        run: Any = self.shell.run
        if not tracer.arm(setup, code):
            return run(code, cell_id, exec_count, setup["filename"])  # type: ignore[no-any-return]
        tracer.start()
        try:
            return run(code, cell_id, exec_count, setup["filename"])  # type: ignore[no-any-return]
        finally:
            tracer.stop()

    def debug_request(self, msg: Message) -> None:
        """A debugger request for a rank that is not stopped (it came late, or the cell ended)."""
        self.sock.send(
            *DEBUG_RESPONSE(
                {
                    "seq": int(msg.body["seq"]),
                    "success": False,
                    "message": "the rank is not stopped",
                    "body": {},
                }
            )
        )

    def while_waiting(self, msg: Message) -> None:
        """A message that came while the cell waited at a prompt: a shutdown now, the rest after it."""
        if msg.type == "shutdown":
            self.shutdown(msg)
        self.deferred.append(msg)

    def stale_answer(self, msg: Message) -> None:
        """An answer to a prompt the rank no longer waits at (its cell was stopped): dropped."""

    def push(self, msg: Message) -> None:
        from jupyter_shard.rank.transfer import landing_reply, pushed_values

        if msg.body.get("land"):
            self.sock.send(*PUSH_REPLY(landing_reply(msg)))
            return
        reply: PushReply = {"req_id": str(msg.body["req_id"]), "ok": True, "error": ""}
        try:
            self.shell.user_ns.update(pushed_values(msg))
        except Exception as exc:
            reply["ok"], reply["error"] = False, f"{type(exc).__name__}: {exc}"
        self.sock.send(*PUSH_REPLY(reply))

    def pull(self, msg: Message) -> None:
        """A copy of a variable, or of the last cell's value, for the kernel, its tensors on the CPU
        (the kernel must not create a CUDA context to read it) unless the request keeps them on the
        device; a value over the request's ``limit`` is refused before it is pickled where its
        tensors alone pass it."""
        from jupyter_shard.rank.device import tensor_bytes
        from jupyter_shard.rank.transfer import chunk_reply, pulled_reply, release, resent_reply

        if msg.body.get("release"):
            release()
            return
        if msg.body.get("resend"):
            self.sock.send(*PULL_REPLY(resent_reply(msg, self.rank)))
            return
        if "chunk" in msg.body:
            part, parts = chunk_reply(msg)
            self.sock.send(*PULL_REPLY(part), parts)
            return
        started = time.perf_counter()
        limit = int(msg.body.get("limit", 1 << 62))
        try:
            what, value = self._pulled(msg)
        except Exception as exc:
            self.sock.send(*PULL_REPLY({"req_id": str(msg.body["req_id"]), "ok": False, "error": str(exc)}))
            return
        seconds = time.perf_counter() - started
        size = tensor_bytes(value)
        if size > limit:
            error = f"{what} holds {size / 2**20:.0f} MiB of tensors, over the {limit / 2**20:.0f} MiB "
            error += "limit of this copy"
            self.sock.send(*PULL_REPLY({"req_id": str(msg.body["req_id"]), "ok": False, "error": error}))
            return
        reply, buffers = pulled_reply(msg, self.rank, what, value, limit)
        if not reply["ok"] and self.lost_context and "CUDA" in reply["error"]:  # a CUDA tensor's copy
            first = reply["error"].split("\n", 1)[0]  # without torch's paragraph about debugging
            reply["error"] = (
                f"{first}; rank {self.rank}'s CUDA context is lost: only CPU values can be copied"
            )
        reply["seconds"] = seconds
        self.sock.send(*PULL_REPLY(reply), buffers)

    def _pulled(self, msg: Message) -> tuple[str, Any]:
        """What a pull asks for: its description and the value itself."""
        if msg.body.get("last"):
            if self.shell.last_value is None:
                raise LookupError(f"rank {self.rank}'s last cell ended without a value")
            return f"rank {self.rank}'s last value", self.shell.last_value[0]
        name = str(msg.body["name"])
        if name not in self.shell.user_ns:
            raise LookupError(f"name {name!r} is not defined on rank {self.rank}")
        value = self.shell.user_ns[name]
        if msg.body.get("gather"):
            try:
                value = self._gathered(name, value)
            except Exception as exc:
                raise RuntimeError(f"rank {self.rank}: {exc}") from exc
        return repr(name), value

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
        An NCCL group is aborted instead of destroyed: destroying it would wait for its pending
        kernels (:meth:`~jupyter_shard.rank.group.PoolGroup.release_steps` says which, by backend).
        """
        import torch.distributed as dist

        steps = self.group.release_steps(self.group.backend, "idle")
        closed = 0
        if "close" in steps:
            # First the connections to the other ranks: the group's sockets close only with its last
            # reference, which torch itself may keep (seen after autograd steps), and destroying a
            # group whose collective is still pending here would wait for that collective.
            pids = [int(pid) for pid in msg.body.get("peers", [])]
            hosts = [str(h) for h in msg.body.get("peer_hosts", [])] or [""] * len(pids)
            here = socket.gethostname()
            # Only processes on this machine can be looked up; ranks elsewhere fall back to the kill.
            closed = _shut_down_connections_to(
                [p for p, h in zip(pids, hosts, strict=False) if h in ("", here)]
            )
        error = ""
        try:
            if "abort" in steps:
                self.group.abort()
            elif dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        req_id = str(msg.body["req_id"])
        self.sock.send(*RELEASE_REPLY({"req_id": req_id, "ok": not error, "error": error, "closed": closed}))

    def regroup(self, msg: Message) -> None:
        """Replace the default process group with a new one on a fresh store (after a release, or
        after a cell destroyed it)."""
        from jupyter_shard.rank.shard import current

        started = time.perf_counter()
        reply: RegroupReply = {
            "req_id": str(msg.body["req_id"]),
            "ok": True,
            "error": "",
            "prepared": False,
            "seconds": 0.0,
        }
        try:
            if "prefix" in msg.body:
                self.group.build_on_prefix(str(msg.body["prefix"]))
            else:
                self.group.build_on_file(str(msg.body["store"]))
            helper = current()
            reply["prepared"] = helper is not None and helper.group_rebuilt()
        except Exception as exc:
            reply["ok"], reply["error"] = False, f"{type(exc).__name__}: {exc}"
        reply["seconds"] = time.perf_counter() - started
        self.sock.send(*REGROUP_REPLY(reply))

    def shutdown(self, msg: Message) -> None:
        self.channel.close()
        os._exit(0)


def _follow_directory(cwd: str) -> None:
    """Take the kernel's working directory, as a notebook cell would run in it; a directory this
    host does not have (a rank on another machine) leaves the rank where it is."""
    if cwd and cwd != os.getcwd():
        with contextlib.suppress(OSError):
            os.chdir(cwd)


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
        try:  # gloo may close the fd between the listing and here (a peer shut down its end)
            sock = socket.socket(fileno=conn.fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return closed
