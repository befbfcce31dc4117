"""What a rank's I/O thread answers while the main thread may be busy in a cell: its stacks, its
status (the heartbeat's body, on request), signals from a kernel that cannot send them itself, and
the abort of an NCCL group the main thread is blocked in. These run on the I/O thread, so they
answer even when a cell is blocked in a collective or a CUDA sync.

The heartbeat's collective is read from the main thread's Python frames (torch.distributed's own
functions). A rank blocked in a CUDA sync (``loss.item()``, an optimizer step waiting on an NCCL
kernel) shows none, and torch offers no cheap, thread-safe way to ask whether NCCL work is pending
(its flight recorder queries CUDA events, which can block behind the main thread's sync); the
kernel's escalation treats a rank that lets SIGINT pass as blocked instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType

from jupyter_shard.rank.channel import Channel
from jupyter_shard.rank.runner import CellState
from jupyter_shard.wire.messages import (
    HEARTBEAT,
    HISTORY_REPLY,
    STACKS_REPLY,
    STATUS_REPLY,
    HeartbeatBody,
    ThreadStack,
    handler_table,
)
from jupyter_shard.wire.protocol import Message

__all__ = ["current_collective", "serve_io"]


def serve_io(channel: Channel, state: CellState) -> None:
    """Give ``channel``'s I/O thread its request handlers and its heartbeat."""
    channel.io_handlers = handler_table(
        "rank.io",
        {
            "stacks": lambda msg: _reply_stacks(channel, msg),
            "status": lambda msg: _reply_status(channel, msg, state),
            "signal": _signal_self,
            "abort": lambda msg: _abort_group(channel, state),
            "history": lambda msg: _reply_history(channel, msg),
        },
    )
    channel.heartbeat = lambda: HEARTBEAT(_status_body(channel, state))
    channel.busy = lambda: state.executing
    channel.tick = _imports.sample


def _abort_group(channel: Channel, state: CellState) -> None:
    """Abort this rank's process group for the kernel, when its backend frees a blocked rank that
    way (NCCL: :meth:`~jupyter_shard.rank.group.PoolGroup.release_steps`); on gloo it does nothing.

    The abort runs on a thread of its own: ``ncclCommAbort`` can take a while, and the I/O thread
    must go on answering (a rank whose abort hangs is killed by the kernel's next step).
    """
    group = state.group
    if group is None or "abort" not in group.release_steps(group.backend, "blocked"):
        return

    def abort() -> None:
        try:
            if group.abort():
                print(
                    "jupyter_shard: aborted this rank's process group (NCCL) for the kernel, to end the "
                    "collective or CUDA sync it was blocked in; the next cell gets a new group",
                    file=sys.__stderr__,
                    flush=True,
                )
        except Exception as exc:
            channel.report("aborting the process group", exc)

    threading.Thread(target=abort, name="jupyter_shard-abort", daemon=True).start()


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
    stacks: list[ThreadStack] = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        if name.startswith("jupyter_shard-"):
            continue
        lines = traceback.format_stack(frame)
        stacks.append({"thread": "MainThread" if ident == main_id else name, "stack": "".join(lines)})
    channel.enqueue(*STACKS_REPLY({"req_id": str(msg.body["req_id"]), "stacks": stacks}), [])


def _status_body(channel: Channel, state: CellState) -> HeartbeatBody:
    """The heartbeat: it goes out even when the device's memory probe fails (without the CUDA
    figures, the failure reported once), so a rank after a device-side assert still looks alive."""
    from jupyter_shard.rank.shard import current, memory_report

    helper = current()
    try:
        memory = memory_report(helper.device if helper else None)
    except Exception as exc:
        channel.report("the heartbeat's memory probe", exc)
        memory = memory_report(None)
    collective, group_ranks = collective_and_group(state.executing)
    return {
        "executing": state.executing,
        "cell": state.cell_head,
        "running_for": time.time() - state.started if state.executing else 0.0,
        "memory": memory,
        "step": helper.global_step if helper else 0,
        "collective": collective,
        "group_ranks": group_ranks,
        "waiting": state.waiting,
        "importing": _imports.long(),
    }


_IMPORTLIB = "<frozen importlib._bootstrap>"
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # jupyter_shard/


class ImportWatch:
    """Which import the main thread has been in, and since when, sampled on every turn of the I/O
    loop: only an import that has lasted :data:`LONG_IMPORT` seconds is named in the heartbeat, so
    the many quick imports a cell's first lines make never leave a stale name behind."""

    def __init__(self, probe: Callable[[], str] | None = None) -> None:
        self.probe = probe or current_import
        self.name, self.since = "", 0.0

    def sample(self) -> None:
        name = self.probe()
        if name != self.name:
            self.name, self.since = name, time.monotonic()

    def long(self) -> str:
        self.sample()
        return self.name if self.name and time.monotonic() - self.since >= LONG_IMPORT else ""


LONG_IMPORT = 0.5  # seconds in one import before a heartbeat names it


def current_import() -> str:
    """The module the main thread is importing, as the outermost ``import`` of code other than this
    package's names it (a cell's ``import transformers``; torch's import at start-up), else "". A
    long import holds the GIL in native code for seconds, so heartbeats pause: the kernel reads this
    from the last one to call that rank busy importing, not stuck. The walk stops at this package's
    frames, whose own quick lazy imports would otherwise be named."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    name = ""
    while frame is not None:  # innermost to outermost
        code = frame.f_code
        if code.co_filename == _IMPORTLIB and code.co_name == "_find_and_load":
            name = str(frame.f_locals.get("name", "")) or name
        elif code.co_filename.startswith(_OWN):
            break
        frame = frame.f_back
    return name


_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def current_collective() -> str:
    """The ``torch.distributed`` call the main thread is in (``all_reduce``, ``barrier``…), else ""."""
    call = _outermost_c10d_frame()
    return call.f_code.co_name if call is not None else ""


def _outermost_c10d_frame() -> FrameType | None:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    outermost = None
    while frame is not None:  # innermost to outermost: the last c10d frame seen is the public call
        if frame.f_code.co_filename.endswith(_C10D):
            outermost = frame
        frame = frame.f_back
    return outermost


def collective_and_group(executing: bool) -> tuple[str, list[int]]:
    """The heartbeat's ``collective`` and ``group_ranks``: a cell's collective on a subgroup (of the
    ranks that run it) can complete where one of the default group cannot."""
    call = _outermost_c10d_frame() if executing else None
    if call is None:
        return "", []
    group = call.f_locals.get("group")
    ranks: list[int] = []
    if group is not None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):  # a group torch no longer knows: count it as the default
            if group is not dist.GroupMember.WORLD:
                ranks = sorted(dist.get_process_group_ranks(group))
    return call.f_code.co_name, ranks


def _reply_status(channel: Channel, msg: Message, state: CellState) -> None:
    req_id, status = str(msg.body["req_id"]), _status_body(channel, state)
    cell_id = state.cell_id if state.executing else ""
    channel.enqueue_numbered(
        lambda count: STATUS_REPLY({"req_id": req_id, **status, "io_count": count, "cell_id": cell_id})
    )


def _reply_history(channel: Channel, msg: Message) -> None:
    """What this rank logged (``shard.sent``): the I/O thread, which alone appends to it, answers."""
    from jupyter_shard.rank.shard import current

    helper = current()
    records = [[step, ts, values] for step, ts, values in helper.sent] if helper is not None else []
    channel.enqueue(*HISTORY_REPLY({"req_id": str(msg.body["req_id"]), "records": records}), [])


_imports = ImportWatch()
