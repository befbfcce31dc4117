"""The message registry: every message type that crosses the kernel/rank boundary, declared once.

Each :class:`Kind` names one message type with its direction, the ``TypedDict`` of its body, whether
it travels on a rank's I/O socket (``rank-k.io``) and, for a request, the type of its reply. The
handler tables on both sides are built from it (:func:`handler_table`), so a side that misses a type
it receives, or handles one it never does, fails when it starts rather than when the message comes.

A kind is also the string of its name (``DONE == "done"``) and builds its message, checked by mypy
against its body type at the call site::

    sock.send(*DONE({"io_count": 3, "cell_id": ..., ...}))  # (msg_type, body) for any sender

A request's body also carries ``req_id``, which the kernel's ``Connection.request`` adds; every reply
carries it back. :func:`check_body` checks a body against its declaration at run time; the wire calls
it on every message it signs when ``JUPYTER_SHARD_CHECK_PROTOCOL`` is set (see ``protocol.Wire``).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, TypedDict, TypeVar

__all__ = [
    "MESSAGES",
    "MSG_TYPES",
    "Direction",
    "Kind",
    "MsgType",
    "Outgoing",
    "Receiver",
    "check_body",
    "handler_table",
    "receiver_of",
]

Direction = Literal["to_rank", "to_kernel"]
Receiver = Literal["rank", "rank.io", "kernel"]  # a rank's main thread, its I/O thread, the kernel


# -- bodies: kernel -> rank -------------------------------------------------------------------------


class DebugSetup(TypedDict):
    """The notebook's debugger is on: compile the cell under the file name the kernel's debugger gave
    it, and stop at these breakpoints (file -> lines) in it or in cells before it."""

    filename: str
    breakpoints: dict[str, list[int]]


class _ExecuteOptions(TypedDict, total=False):
    post_mortem: bool  # not code: open pdb at the frame where the rank's last failed cell raised
    debug: DebugSetup


class DebugRequestBody(TypedDict):
    """A Debug Adapter Protocol request for a rank stopped at a breakpoint (its own ids)."""

    seq: int
    command: str
    arguments: dict[str, Any]


class ExecuteBody(_ExecuteOptions):
    cell_id: str
    code: str
    exec_count: int
    cwd: str  # the kernel's working directory, which the rank takes before the cell where it exists


class AnswerBody(TypedDict):
    """The answer to a rank's ``prompt``: ``value``, or ``error`` (no input box to ask in),
    or ``eof`` (the person sent end-of-input)."""

    value: str
    error: str
    eof: bool


class SegmentRef(TypedDict):
    """A shared-memory segment of the kernel's (:mod:`jupyter_shard.transfer.segments`)."""

    pid: int
    fd: int
    token: str


class _PushOptions(TypedDict, total=False):
    segment: SegmentRef  # the out-of-band buffers are in this segment, not in the message
    sizes: list[int]  # the out-of-band buffers' sizes, in order (required with ``segment``)
    stream: str  # one push sent in parts: its id; a part's buffers are the bytes from ``offset`` of
    offset: int  # the out-of-band buffers laid end to end, and the ``final`` part has the pickles
    final: bool
    land: bool  # offer fresh memory of ``sizes`` for the kernel to write into (a reply with addresses)
    landed: bool  # the buffers were written into the memory offered: build the values over it


class PushBody(_PushOptions):
    """One in-band pickle per name, as buffers in the same order, then (without ``segment``) every
    value's out-of-band buffers (:mod:`~jupyter_shard.transfer.pickling`);
    ``counts``: how many each value has."""

    names: list[str]
    counts: list[int]


class _PullOptions(TypedDict, total=False):
    device: bool  # keep tensors on the rank's device (default: they come back on the CPU)
    last: bool  # the value of the rank's last cell (its last expression) instead of a variable
    limit: int  # refuse, rather than send, a value that pickles to more bytes than this
    segments: dict[str, SegmentRef]  # by rank: an empty segment to write the buffers into
    direct: bool  # the rank may answer with where its buffers are, for the kernel to read them
    resend: bool  # write the buffers lent for the last pull into ``segments`` (reading them failed)
    release: bool  # the kernel has read what the rank lent it: no reply
    stream: bool  # a large value is lent and read in parts (``chunk``), not sent at once
    chunk: list[int]  # [offset, length] of the lent buffers laid end to end, as one buffer


class PullBody(_PullOptions):
    name: str
    gather: bool  # the plain model behind the one shard.prepare returned (a collective)


class Empty(TypedDict):
    pass


class SignalBody(TypedDict):
    signal: int


class ReleaseBody(TypedDict):
    peers: list[int]  # every live rank's pid, and its host ("" when not known)
    peer_hosts: list[str]


class RegroupBody(TypedDict, total=False):
    """Where the new group meets: a prefix of the agent's store, or a fresh FileStore (one of them)."""

    prefix: str
    store: str


# -- bodies: rank -> kernel -------------------------------------------------------------------------


class ReadyBody(TypedDict):
    rank: int
    pid: int
    host: str
    device: str
    log_path: str
    node: int
    job: str  # the Slurm job, or ""


class StartupFailedBody(TypedDict):
    rank: int
    traceback: str


class StreamBody(TypedDict):
    """The text travels as one buffer, UTF-8 (``surrogatepass``, so any ``str`` survives): a flood is
    megabytes a second, and a JSON string costs both ends an escape pass over every character."""

    cell_id: str
    name: Literal["stdout", "stderr"]


class ResultBody(TypedDict):
    cell_id: str
    data: dict[str, Any]
    metadata: dict[str, Any]


class DisplayBody(ResultBody):
    transient: dict[str, Any]
    update: bool


class PromptBody(TypedDict):
    """A rank's ``input()``, ``getpass()`` or pdb prompt, sent by its main thread, which waits for the
    ``answer``; ``io_count`` as in ``done``: the output before the prompt is shown first."""

    cell_id: str
    prompt: str
    password: bool
    io_count: int


class DebugResponseBody(TypedDict):
    seq: int  # the request's
    success: bool
    message: str
    body: dict[str, Any]


class DebugEventBody(TypedDict):
    """A Debug Adapter Protocol event of a rank (``stopped``, ``continued``), in its own ids."""

    event: str
    body: dict[str, Any]


# done's ``ungrouped``, where it is not the NCCL ErrorType name that the rank's watchdog recorded:
GROUP_DESTROYED = "DESTROYED"  # no default group: its cell destroyed it (or a release aborted it)
GROUP_UNKNOWN = "UNKNOWN"  # its NCCL error record cannot be read, and the cell failed in a collective


class _DoneGroup(TypedDict, total=False):
    # why ``grouped`` is false: GROUP_DESTROYED, the NCCL ``ErrorType`` its watchdog recorded
    # ("COMM_ERROR", "REMOTE_ERROR", "TIMEOUT"), or GROUP_UNKNOWN; "" (or absent) while it is true
    ungrouped: str


class DoneBody(_DoneGroup):
    """``io_count``: how many messages the rank's I/O socket had been given when the cell ended."""

    io_count: int
    cell_id: str
    status: Literal["ok", "error"]
    ename: str
    evalue: str
    traceback: list[str]
    duration: float
    grouped: bool  # whether the rank still has a default process group (a cell may destroy it)
    lost_context: str  # the CUDA error that lost the rank's CUDA context for good; "" while it works


class MetricsBody(TypedDict):
    """``count`` records logged with the same ``names``; the buffers are float64 columns (native byte
    order, both ends are on one machine or the same platform): steps, wall times, then one per name."""

    rank: int
    names: list[str]
    count: int


class _HeartbeatExtras(TypedDict, total=False):
    importing: str  # the module the main thread is importing (the outermost import), or ""


class HeartbeatBody(_HeartbeatExtras):
    executing: bool
    cell: str  # the running cell's first line
    running_for: float
    memory: dict[str, int]
    step: int
    collective: str  # the torch.distributed call the main thread is in, or ""
    group_ranks: list[int]  # the ranks of that call's group; [] for the default group (every rank)
    waiting: str  # the prompt the main thread waits at for an answer from the notebook, or ""


class Reply(TypedDict):
    req_id: str


class OutcomeReply(Reply):
    ok: bool
    error: str


class _LentMemory(TypedDict, total=False):
    addresses: list[int]  # where the buffers are (or go) in the rank, sizes as the transfer's sizes
    token: str  # random bytes (hex) the rank holds at ``token_address`` while it lends the memory
    token_address: int


class _PullReplyOptions(_LentMemory, total=False):
    sizes: list[int]  # the out-of-band buffers' sizes, in order
    in_segment: bool  # they were written into the request's segment, else they follow the pickle
    seconds: float  # how long getting the value took on the rank (for --gather: the all-gather)
    streamed: bool  # the buffers are lent, to be read in parts with ``chunk`` requests


class PushReply(OutcomeReply, _LentMemory):
    """To a push with ``land``: where the rank's fresh memory for it is (none: use a segment)."""


class PullReply(OutcomeReply, _PullReplyOptions):
    """When ok, the in-band pickle is the first buffer (:mod:`jupyter_shard.transfer.pickling`)."""


class ThreadStack(TypedDict):
    thread: str
    stack: str


class StacksReply(Reply):
    stacks: list[ThreadStack]


class StatusReply(Reply, HeartbeatBody):
    io_count: int  # this reply's place among what the rank's I/O socket sent (an attaching kernel counts on)
    cell_id: str  # the running cell's, "" when idle (an attaching kernel follows a background run)


class HistoryReply(Reply):
    records: list[list[Any]]  # what the rank logged and sent: [step, wall time, {name: value}], oldest first


class ReleaseReply(OutcomeReply):
    closed: int  # connections to peers shut down


class RegroupReply(OutcomeReply):
    prepared: bool  # a model prepared with shard.prepare still holds the old group
    seconds: float


# -- the registry -----------------------------------------------------------------------------------

B = TypeVar("B", bound=Mapping[str, Any])


Outgoing = tuple[str, dict[str, Any]]
"""A message to send: ``sender(*message, buffers)`` for any ``(msg_type, body, buffers)`` sender."""


class Kind(str, Generic[B]):
    """One message type: the string of its name, with its declaration."""

    name: str  # a plain ``str``, as sent
    direction: Direction
    body: type[B]
    io: bool
    reply: Kind[Any] | None

    def __new__(
        cls,
        name: str,
        direction: Direction,
        body: type[B],
        *,
        io: bool = False,
        reply: Kind[Any] | None = None,
    ) -> Kind[B]:
        self = super().__new__(cls, name)
        self.name = name
        self.direction, self.body, self.io, self.reply = direction, body, io, reply
        return self

    def __call__(self, body: B) -> Outgoing:
        """This kind's message with ``body`` (mypy checks ``body`` against :attr:`body`)."""
        return self.name, body  # type: ignore[return-value]  # a TypedDict is a dict at run time

    def __repr__(self) -> str:
        return f"Kind({str(self)!r})"


def _to_kernel(name: str, body: type[B], *, io: bool = False) -> Kind[B]:
    return Kind(name, "to_kernel", body, io=io)


READY = _to_kernel("ready", ReadyBody)
STARTUP_FAILED = _to_kernel("startup_failed", StartupFailedBody)
STREAM = _to_kernel("stream", StreamBody, io=True)
DISPLAY = _to_kernel("display", DisplayBody, io=True)
RESULT = _to_kernel("result", ResultBody, io=True)
DONE = _to_kernel("done", DoneBody)
METRICS = _to_kernel("metrics", MetricsBody, io=True)
HEARTBEAT = _to_kernel("heartbeat", HeartbeatBody, io=True)
PUSH_REPLY = _to_kernel("push_reply", PushReply)
PULL_REPLY = _to_kernel("pull_reply", PullReply)
STACKS_REPLY = _to_kernel("stacks_reply", StacksReply, io=True)
STATUS_REPLY = _to_kernel("status_reply", StatusReply, io=True)
HISTORY_REPLY = _to_kernel("history_reply", HistoryReply, io=True)
RELEASE_REPLY = _to_kernel("release_reply", ReleaseReply)
REGROUP_REPLY = _to_kernel("regroup_reply", RegroupReply)
PROMPT = _to_kernel("prompt", PromptBody)
DEBUG_RESPONSE = _to_kernel("debug_response", DebugResponseBody)
DEBUG_EVENT = _to_kernel("debug_event", DebugEventBody)

EXECUTE = Kind("execute", "to_rank", ExecuteBody)
PUSH = Kind("push", "to_rank", PushBody, reply=PUSH_REPLY)
PULL = Kind("pull", "to_rank", PullBody, reply=PULL_REPLY)
STACKS = Kind("stacks", "to_rank", Empty, io=True, reply=STACKS_REPLY)
STATUS = Kind("status", "to_rank", Empty, io=True, reply=STATUS_REPLY)
# what the rank logged, for a kernel that attaches to a kept pool (answered while a cell runs)
HISTORY = Kind("history", "to_rank", Empty, io=True, reply=HISTORY_REPLY)
SIGNAL = Kind("signal", "to_rank", SignalBody, io=True)
# to a rank of an NCCL pool blocked in a collective: abort its group from the I/O thread
ABORT = Kind("abort", "to_rank", Empty, io=True)
SHUTDOWN = Kind("shutdown", "to_rank", Empty)
RELEASE = Kind("release", "to_rank", ReleaseBody, reply=RELEASE_REPLY)
REGROUP = Kind("regroup", "to_rank", RegroupBody, reply=REGROUP_REPLY)
DEBUG_REQUEST = Kind("debug_request", "to_rank", DebugRequestBody)  # read while stopped at a breakpoint
ANSWER = Kind("answer", "to_rank", AnswerBody)  # read by the main thread while it waits at the prompt

MsgType = Literal[
    "execute", "push", "pull", "stacks", "status", "signal", "abort", "shutdown", "release", "regroup",
    "ready", "startup_failed", "stream", "display", "result", "done", "metrics", "heartbeat",
    "push_reply", "pull_reply", "stacks_reply", "status_reply", "release_reply", "regroup_reply",
    "prompt", "answer", "debug_request", "debug_response", "debug_event", "history", "history_reply",
]  # fmt: skip
MESSAGES: Mapping[str, Kind[Any]] = {
    str(k): k
    for k in (
        *(EXECUTE, PUSH, PULL, STACKS, STATUS, SIGNAL, ABORT, SHUTDOWN, RELEASE, REGROUP),
        *(READY, STARTUP_FAILED, STREAM, DISPLAY, RESULT, DONE, METRICS, HEARTBEAT),
        *(PUSH_REPLY, PULL_REPLY, STACKS_REPLY, STATUS_REPLY, RELEASE_REPLY, REGROUP_REPLY),
        *(PROMPT, ANSWER, DEBUG_REQUEST, DEBUG_RESPONSE, DEBUG_EVENT, HISTORY, HISTORY_REPLY),
    )
}
MSG_TYPES: frozenset[str] = frozenset(MESSAGES)
REPLIES: frozenset[str] = frozenset(str(k.reply) for k in MESSAGES.values() if k.reply is not None)
if set(typing.get_args(MsgType)) != MSG_TYPES:
    raise AssertionError("MsgType and the registered kinds disagree")


def receiver_of(kind: Kind[Any]) -> Receiver:
    """Who handles ``kind``: the kernel, a rank's main thread or its I/O thread."""
    if kind.direction == "to_kernel":
        return "kernel"
    return "rank.io" if kind.io else "rank"


H = TypeVar("H", bound=Callable[..., Any])


def handler_table(receiver: Receiver, handlers: Mapping[str, H], *, replies: H | None = None) -> dict[str, H]:
    """``receiver``'s dispatch table: exactly one handler per type it receives, or a ``ValueError``.

    ``replies``, for the kernel: the one handler of every ``*_reply`` (not to be named in ``handlers``).
    """
    expected = {name for name, kind in MESSAGES.items() if receiver_of(kind) == receiver}
    table = dict(handlers)
    if replies is not None:
        named = REPLIES & set(table)
        if named:
            raise ValueError(f"replies are handled by `replies`; also given: {sorted(named)}")
        table.update(dict.fromkeys(REPLIES & expected, replies))
    missing, extra = expected - set(table), set(table) - expected
    if missing or extra:
        raise ValueError(
            f"the {receiver} handler table does not match the registry: "
            f"missing {sorted(missing)}, never received there {sorted(extra)}"
        )
    return table


# -- checking bodies at run time ----------------------------------------------------------------------


def check_body(msg_type: str, body: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``body`` as a ``msg_type`` body (empty when nothing is)."""
    kind = MESSAGES.get(msg_type)
    if kind is None:
        return [f"unknown message type {msg_type!r}"]
    if kind.reply is None:
        return _check_typed_dict(kind.body, body, msg_type)
    problems = _check_typed_dict(kind.body, body, msg_type, extra=frozenset({"req_id"}))
    if not isinstance(body.get("req_id"), str):
        problems.append(f"{msg_type}: a request needs a string req_id")
    return problems


def _check_typed_dict(td: type, value: object, where: str, extra: frozenset[str] = frozenset()) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: expected an object, got {type(value).__name__}"]
    hints = typing.get_type_hints(td)
    required: frozenset[str] = td.__required_keys__  # type: ignore[attr-defined]
    problems = [f"{where}: missing {key!r}" for key in sorted(required - set(value))]
    problems += [f"{where}: undeclared {key!r}" for key in sorted(set(value) - set(hints) - extra)]
    for key, item in value.items():
        if key in hints:
            problems += _check_value(hints[key], item, f"{where}.{key}")
    return problems


def _check_value(hint: Any, value: object, where: str) -> list[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return []
    if origin is Literal:
        return [] if value in args else [f"{where}: {value!r} is not one of {args}"]
    if origin in (typing.Union, types.UnionType):
        if any(not _check_value(a, value, where) for a in args):
            return []
        return [f"{where}: {value!r} matches none of {args}"]
    if isinstance(hint, type) and typing.is_typeddict(hint):
        return _check_typed_dict(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [p for i, v in enumerate(value) for p in _check_value(args[0], v, f"{where}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        return [p for k, v in value.items() for p in _check_value(args[1], v, f"{where}[{k!r}]")]
    if hint is float:
        ok = type(value) in (float, int)
    elif hint in (int, bool, str):
        ok = type(value) is hint
    else:
        ok = isinstance(value, hint)
    return [] if ok else [f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}"]
