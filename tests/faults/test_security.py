"""Security (F15, F16): loopback-only listeners, a private socket directory, the key kept off command
lines, and forged, replayed, truncated or oversized frames refused without running or unpickling
anything, while the pool keeps working.

Where a frame can be injected: the kernel's ROUTER socket, ``ipc://{pool dir}/pool.sock``, and the
local ranks' direct links, ``{pool dir}/direct.sock`` (jupyter_shard/pool/links.py), are the only
endpoints a pool listens on. Ranks only connect out (two DEALER sockets each, see
jupyter_shard/rank/channel.py) and listen on nothing of their own but gloo's loopback TCP pairs, so
the only way into a rank is through the kernel, which never forwards what it receives. The rank's
own checks are still tested, by sending through the kernel's socket.

How forged frames reach the decoder: a ROUTER ignores a peer whose identity is already connected, so
an intruder cannot speak as ``rank-0`` while rank 0 is up, and frames under an unknown identity are
dropped before they are decoded. ``rank-00`` parses as rank 0 without being its identity, so frames
sent under it are refused by :meth:`Wire.decode` itself: these tests fail if a signature, replay,
size or layout check is taken out of jupyter_shard/wire/protocol.py.
"""

from __future__ import annotations

import builtins
import ipaddress
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest
import zmq

from jupyter_shard import Pool
from jupyter_shard.wire import protocol
from jupyter_shard.wire.protocol import (
    MAX_BODY,
    MAX_HEADER,
    TAG,
    Wire,
    new_key,
    parse_identity,
    rank_identity,
)

pytestmark = pytest.mark.timeout(120)

ALIAS = "rank-00"  # taken for rank 0 by parse_identity, but not rank 0's own (connected) identity
FORGED = "FORGED-BY-THE-TEST"  # a stream text that must never reach the pool's record of a rank


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with Pool(nproc=2, device="cpu", log_dir=tmp_path_factory.mktemp("logs")) as p:
        p.run("import torch, torch.distributed as dist; dist.all_reduce(torch.ones(1))")
        yield p


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A file that forged code or a forged pickle would create: it must never exist."""
    return tmp_path / "forged-payload-ran"


def _rank_pids(pool: Pool) -> list[int]:
    return [s.pid for s in pool.status()]


def _key(pool: Pool) -> bytes:
    """The pool's key, as an attacker who stole it (or a signed frame) would have it."""
    assert pool.connection.wire is not None
    return pool.connection.wire._key


class _Evil:
    """Unpickling this creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('unpickled')",))


def _stream(key: bytes, text: str = FORGED, sender: str = ALIAS) -> list[bytes]:
    """Rank output as a rank sends it: the text is the message's one buffer."""
    return Wire(key, sender).encode(
        "stream", {"cell_id": "forged", "name": "stdout"}, [text.encode() + b"\n"]
    )


def _execute(key: bytes, marker: Path, sender: str = ALIAS) -> list[bytes]:
    code = f"open({str(marker)!r}, 'w').write('ran')"
    return Wire(key, sender).encode("execute", {"cell_id": "forged", "code": code, "exec_count": 1})


def _signed(key: bytes, header: bytes, body: bytes, *buffers: bytes) -> list[bytes]:
    """Frames validly signed over arbitrary bytes: only a key holder can build these."""
    return [TAG, protocol._mac(key, [TAG, header, body, *buffers]), header, body, *buffers]


def _header(msg_type: str = "stream", sender: str = ALIAS, **extra: Any) -> bytes:
    fields = {"v": 1, "type": msg_type, "seq": time.time_ns(), "sender": sender, "ts": time.time(), **extra}
    return json.dumps(fields).encode()


def _stream_body(pad: str = "") -> bytes:
    return json.dumps({"cell_id": "forged", "name": "stdout", "pad": pad}).encode()


def _flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x01
    return bytes(out)


def _framed(parts: list[bytes]) -> list[bytes]:
    """Signed parts laid out as a sender puts them on the socket (``protocol.pack``); anything that
    is not even shaped like parts (fewer than four, no tag) goes out as it is."""
    return protocol.pack(parts) if len(parts) >= 4 and parts[0] == TAG else parts


def _send(pool: Pool, messages: Sequence[list[bytes]], identity: str | None = ALIAS) -> None:
    """Connect to the pool socket as a peer without the key, send, and return once all is sent."""
    assert pool.directory is not None
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(f"ipc://{pool.directory / 'pool.sock'}")
        for frames in messages:
            sock.send_multipart(_framed(frames))
        sock.close()
    finally:
        ctx.term()  # waits until every queued frame is written to the socket


def _wait_until(condition: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _forged_text_seen(pool: Pool) -> bool:
    return any(FORGED in a.last_line for a in pool.activity())


def _assert_refused(pool: Pool, dropped_before: int, count: int, marker: Path | None = None) -> None:
    """Exactly ``count`` frames dropped, no forged effect, and the pool still runs a cell."""
    _wait_until(lambda: pool.dropped >= dropped_before + count)  # the watcher thread receives them
    assert pool.dropped - dropped_before == count
    assert not _forged_text_seen(pool), "a forged stream message was taken for rank output"
    result = pool.run("6 * 7", timeout=30)
    assert result.value == {"text/plain": "42"}
    assert pool.dropped - dropped_before == count
    if marker is not None:
        assert not marker.exists(), "a forged message ran code or was unpickled"


def test_the_evil_payload_is_live(tmp_path: Path) -> None:
    """Sanity check for the tests below: unpickling the payload really creates the marker."""
    canary = tmp_path / "canary"
    cloudpickle.loads(cloudpickle.dumps(_Evil(canary)))
    assert canary.read_text() == "unpickled"


# -- listeners, directory, key ----------------------------------------------------------------------


def test_ranks_listen_on_loopback_only(pool: Pool) -> None:
    listening = []
    for pid in _rank_pids(pool):
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append(conn.laddr.ip)
    for ip in listening:
        assert ipaddress.ip_address(ip).is_loopback, f"a rank listens on {ip}"
    kernel_listeners = [
        c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
    ]
    assert kernel_listeners == [], f"the pool opened TCP listeners in the kernel: {kernel_listeners}"


def _listening_unix_sockets(pid: int) -> list[str]:
    """Paths (``@name`` for abstract ones) of the listening UNIX sockets the process holds."""
    listening = {}
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: a listening socket
                listening[fields[6]] = fields[7] if len(fields) > 7 else "(unnamed)"
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in listening:
            held.append(listening[target[8:-1]])
    return held


def test_ranks_have_no_listening_socket_of_their_own(pool: Pool) -> None:
    """Ranks only connect out (rank/channel.py): no ipc/UNIX listener a forged frame could reach.
    Their rendezvous is a FileStore in the private directory; gloo's TCP pairs are loopback only
    (test above)."""
    assert pool.directory is not None
    for pid in _rank_pids(pool):
        assert _listening_unix_sockets(pid) == [], f"rank process {pid} listens on a UNIX socket"
    assert sorted(_listening_unix_sockets(os.getpid())) == [
        str(pool.directory / "direct.sock"),
        str(pool.directory / "pool.sock"),
    ]


def test_private_directory_and_ipc_socket(pool: Pool) -> None:
    directory = pool.directory
    assert directory is not None
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert directory.stat().st_uid == os.getuid()
    assert (directory / "pool.sock").exists()
    direct = (directory / "direct.sock").stat()
    assert stat.S_ISSOCK(direct.st_mode) and stat.S_IMODE(direct.st_mode) == 0o600


def test_key_not_on_command_line_nor_inherited_by_rank_children(pool: Pool) -> None:
    for pid in _rank_pids(pool):
        assert not any("JUPYTER_SHARD_KEY" in a for a in psutil.Process(pid).cmdline())
    run = pool.run("import subprocess\nsubprocess.run(['env'], capture_output=True, text=True).stdout")
    value = run.value
    assert value is not None
    assert "JUPYTER_SHARD_KEY" not in value["text/plain"]


# -- F15 on the kernel's socket ---------------------------------------------------------------------


def test_frames_without_the_key_are_rejected_and_pool_keeps_working(pool: Pool) -> None:
    assert pool.directory is not None
    dropped = pool.dropped
    ctx = zmq.Context.instance()
    socks = []
    try:
        for identity in (b"rank-9", b"intruder", None):
            sock = ctx.socket(zmq.DEALER)
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{pool.directory / 'pool.sock'}")
            socks.append(sock)
            sock.send_multipart(Wire(new_key(), "rank-0").to_socket("done", {"cell_id": "x", "status": "ok"}))
            sock.send_multipart([b"garbage"])
            sock.send_multipart([b"jsh1", b"sig", b"{}", b"{}", b"\x80" * 10])
        time.sleep(0.3)
        result = pool.run("1 + 1")
        assert result.value == {"text/plain": "2"}
        assert pool.dropped - dropped == 9
    finally:
        for sock in socks:
            sock.close()


def test_the_alias_identity_reaches_the_decoder() -> None:
    """The tests below rely on this; if identities become canonical, inject another way."""
    assert parse_identity(ALIAS.encode()) == (0, False)


def test_intruder_cannot_take_a_connected_rank_identity(pool: Pool) -> None:
    """A second peer claiming ``rank-0`` is ignored by the ROUTER: its frames never arrive."""
    dropped = pool.dropped
    _send(pool, [_stream(new_key(), sender="rank-0"), [b"garbage"]], identity="rank-0")
    time.sleep(0.5)
    assert pool.dropped == dropped
    assert not _forged_text_seen(pool)
    assert pool.run("6 * 7", timeout=30).value == {"text/plain": "42"}


def test_unsigned_frames_are_dropped_and_run_nothing(pool: Pool, marker: Path) -> None:
    key = _key(pool)
    attempts = []
    for frames in (_stream(key), _execute(key, marker)):
        attempts.append([TAG, b"", *frames[2:]])  # empty signature
        attempts.append([TAG, b"\x00" * 32, *frames[2:]])  # a signature of the right length
        attempts.append([TAG, frames[2], frames[3], b"{}"])  # no signature frame at all
    dropped = pool.dropped
    _send(pool, attempts)
    _assert_refused(pool, dropped, len(attempts), marker)


def test_frames_signed_with_another_key_are_dropped_and_run_nothing(pool: Pool, marker: Path) -> None:
    wrong = new_key()
    attempts = [
        _stream(wrong),
        _execute(wrong, marker),
        Wire(wrong, ALIAS).encode("done", {"cell_id": "forged", "status": "ok", "io_count": 0}),
        Wire(wrong, ALIAS).encode(
            "pull_reply", {"req_id": "x", "ok": True}, [cloudpickle.dumps(_Evil(marker))]
        ),
    ]
    dropped = pool.dropped
    _send(pool, attempts)
    _assert_refused(pool, dropped, len(attempts), marker)


def test_genuine_frame_with_one_flipped_body_byte_is_dropped(pool: Pool) -> None:
    """Signed with the pool's key, then one byte of the text changed (still valid UTF-8)."""
    frames = _stream(_key(pool))
    at = frames[4].index(FORGED.encode()) + len(FORGED) - 1
    frames[4] = _flip(frames[4], at)  # "...TEST" becomes "...TESU": same shape, different bytes
    assert frames[4].decode().startswith(FORGED[:-1])
    dropped = pool.dropped
    _send(pool, [frames])
    _assert_refused(pool, dropped, 1)
    assert not any(FORGED[:-1] in a.last_line for a in pool.activity())


def test_replayed_and_reordered_genuine_frames_are_dropped(pool: Pool) -> None:
    """Two genuine frames from one sender: sent in order they are taken; sent again, or the older
    one after the newer, they are dropped and do not change what the pool shows."""
    wire = Wire(_key(pool), ALIAS)
    older = wire.encode("stream", {"cell_id": "c", "name": "stdout"}, [b"older frame\n"])
    newer = wire.encode("stream", {"cell_id": "c", "name": "stdout"}, [b"newer frame\n"])
    dropped = pool.dropped
    _send(pool, [older, newer])
    assert _wait_until(lambda: pool.activity()[0].last_line == "newer frame")
    _send(pool, [newer, older, older])
    assert _wait_until(lambda: pool.dropped >= dropped + 3)
    time.sleep(0.2)
    assert pool.dropped - dropped == 3
    assert pool.activity()[0].last_line == "newer frame"
    assert pool.run("6 * 7", timeout=30).value == {"text/plain": "42"}


def test_a_kernel_attaching_a_kept_pool_refuses_what_the_kernel_before_it_took(kept_runtime: Path) -> None:
    """A genuine frame the first kernel took, replayed to the kernel that attaches after it, is
    dropped there; a newer one from the same sender is still taken (the refusal is by ``seq``)."""
    from jupyter_shard.pool.keep import attach

    first = Pool(nproc=1, device="cpu")
    first.start()
    first.keep = 60
    wire = Wire(_key(first), ALIAS)
    taken = wire.encode("stream", {"cell_id": "c", "name": "stdout"}, [b"taken before\n"])
    _send(first, [taken])
    assert _wait_until(lambda: first.activity()[0].last_line == "taken before")
    first.run("1")  # a cell's end writes down what was taken
    first.release()
    second = attach()
    try:
        dropped = second.dropped
        _send(second, [taken])
        assert _wait_until(lambda: second.dropped > dropped), "a replay from before the attach was taken"
        newer = wire.encode("stream", {"cell_id": "c", "name": "stdout"}, [b"sent after\n"])
        _send(second, [newer])
        assert _wait_until(lambda: second.activity()[0].last_line == "sent after")
        assert second.dropped - dropped == 1
        assert second.run("6 * 7", timeout=30).value == {"text/plain": "42"}
    finally:
        second.shutdown()


def test_genuine_frame_of_another_sender_is_dropped(pool: Pool) -> None:
    """A frame rank 0 could have signed (sender ``rank-0``), replayed from another identity."""
    dropped = pool.dropped
    _send(pool, [_stream(_key(pool), sender="rank-0")])
    _assert_refused(pool, dropped, 1)


def test_truncated_frames_are_dropped(pool: Pool) -> None:
    key = _key(pool)
    genuine = _stream(key)
    cut = list(genuine)
    cut[2] = cut[2][: len(cut[2]) // 2]  # header cut in half, signature left as it was
    half = genuine[2][: len(genuine[2]) // 2]
    attempts = [
        [TAG],
        genuine[:2],
        genuine[:3],  # no body
        cut,
        _signed(key, half, genuine[3]),  # re-signed by a key holder: the cut header is not JSON
        [TAG, genuine[1], b"", b""],
    ]
    dropped = pool.dropped
    _send(pool, attempts)
    _assert_refused(pool, dropped, len(attempts))


def test_oversized_header_and_body_are_dropped_unparsed(pool: Pool) -> None:
    """Validly signed, so only the size limits stop them (checked before the signature)."""
    key = _key(pool)
    header = _header(pad="x" * MAX_HEADER)
    body = _stream_body("y" * MAX_BODY)
    assert len(header) > MAX_HEADER and len(body) > MAX_BODY
    text = FORGED.encode() + b"\n"
    attempts = [_signed(key, header, _stream_body(), text), _signed(key, _header(), body, text)]
    dropped = pool.dropped
    _send(pool, attempts)
    _assert_refused(pool, dropped, len(attempts))


def test_oversized_buffer_is_dropped(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real buffer limit is 1 GiB and is read from JUPYTER_SHARD_MAX_FRAME at import, and the
    pool does not pass that variable to its ranks; so the kernel's decoder limit is lowered here,
    in this process, which is the kernel. The ROUTER's MAXMSGSIZE stays at the import-time value."""
    monkeypatch.setattr(protocol, "MAX_FRAME", 1 << 20)
    key = _key(pool)
    attempts = [
        _signed(key, _header(), _stream_body(), b"z" * ((1 << 20) + 1)),
        _signed(key, _header(), _stream_body(), b"small", b"z" * (2 << 20)),
    ]
    dropped = pool.dropped
    _send(pool, attempts)
    _assert_refused(pool, dropped, len(attempts))


def test_badly_signed_pickle_is_never_unpickled_by_the_kernel(pool: Pool, marker: Path) -> None:
    """While the kernel waits for a pull reply (which it unpickles), forged replies to that very
    request arrive first, carrying a pickle that would create ``marker``: none is taken."""
    pool.run(
        "import time\n"
        "class SlowToPickle:\n"
        "    def __reduce__(self):\n"
        "        time.sleep(1.5)\n"
        "        return (int, (7,))\n"
        "slow = SlowToPickle()",
        ranks=[0],
    )
    payload = cloudpickle.dumps(_Evil(marker))
    sent = threading.Event()

    def forge() -> None:
        if not _wait_until(lambda: bool(pool.connection.waiting_requests), within=10.0):
            return
        req_id = pool.connection.waiting_requests[0]
        body = {"req_id": req_id, "ok": True, "error": ""}
        genuine = Wire(_key(pool), ALIAS).encode("pull_reply", body, [payload])
        _send(
            pool,
            [
                Wire(new_key(), ALIAS).encode("pull_reply", body, [payload]),
                [TAG, b"", *genuine[2:]],
                [TAG, genuine[1], genuine[2], genuine[3], _flip(payload, len(payload) // 2)],
            ],
        )
        sent.set()

    dropped = pool.dropped
    forger = threading.Thread(target=forge)
    forger.start()
    try:
        value = pool.pull("slow", rank=0)
        dropped_while_pending = pool.dropped - dropped
    finally:
        forger.join(15.0)
    assert sent.is_set(), "the forged replies were not sent while the pull was pending"
    assert value == 7
    assert dropped_while_pending == 3, "the forged replies did not arrive while the pull was pending"
    assert not marker.exists(), "the kernel unpickled a forged buffer"
    _assert_refused(pool, dropped, 3, marker)


# -- F15 on a rank's socket (reached only through the kernel's own socket) --------------------------

_RANK_REJECTED = (
    "import gc\n"
    "from jupyter_shard.wire.protocol import Wire\n"
    "sum(w.rejected for w in gc.get_objects() if isinstance(w, Wire) and w.sender == 'rank-0')"
)


def _rank0_rejected(pool: Pool) -> int:
    value = pool.run(_RANK_REJECTED, ranks=[0], timeout=30).value
    assert value is not None
    return int(value["text/plain"])


def _to_rank0(pool: Pool, messages: Sequence[list[bytes]], via: str = "link") -> None:
    """Send as the kernel does: on rank 0's direct link (in order with the cells that follow), or on
    the pool socket, which the rank still reads (what it gets there arrives in its own time)."""
    assert pool.connection.socket is not None
    with pool.connection.lock:
        for frames in messages:
            if via == "link":
                assert pool.connection.links.send(0, _framed(frames))
            else:
                pool.connection.socket.send_multipart([rank_identity(0).encode(), *_framed(frames)])


def _rank0_rejects(pool: Pool, before: int, count: int) -> int:
    """How many more messages rank 0 rejected, waiting up to 10 s for ``count`` of them."""
    deadline = time.monotonic() + 10
    while (seen := _rank0_rejected(pool) - before) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def _from_kernel(
    pool: Pool, msg_type: str, body: dict[str, Any], buffers: Sequence[bytes] = ()
) -> list[bytes]:
    """Frames as the kernel would sign them (with its next ``seq``), for the test to spoil."""
    assert pool.connection.wire is not None
    return pool.connection.wire.encode(msg_type, body, buffers)


def _resigned(frames: list[bytes], key: bytes) -> list[bytes]:
    return [TAG, protocol._mac(key, [TAG, *frames[2:]]), *frames[2:]]


@pytest.mark.parametrize("via", ["link", "socket"])
def test_rank_drops_forged_kernel_frames_without_running_them(pool: Pool, marker: Path, via: str) -> None:
    """Sent through the kernel's own link or socket, as no other way reaches a rank. Each frame
    carries the kernel's next ``seq`` (built in sending order, after the last cell), so only the
    signature or layout check stands between it and the rank."""
    code = f"open({str(marker)!r}, 'w')"

    def execute() -> list[bytes]:
        return _from_kernel(pool, "execute", {"cell_id": "forged-0", "code": code, "exec_count": 1})

    def flipped() -> list[bytes]:
        frames = execute()
        frames[3] = _flip(frames[3], frames[3].index(b"forged-0") + 7)  # cell id "forged-1"
        return frames

    def push() -> list[bytes]:
        return _from_kernel(pool, "push", {"names": ["x"], "req_id": "r"}, [cloudpickle.dumps(_Evil(marker))])

    before = _rank0_rejected(pool)
    attempts = [
        _resigned(execute(), new_key()),
        flipped(),
        [TAG, b"", *execute()[2:]],
        _resigned(push(), new_key()),
        execute()[:3],
    ]
    _to_rank0(pool, attempts, via)
    assert _rank0_rejects(pool, before, len(attempts)) == len(attempts)
    assert not marker.exists(), "rank 0 ran forged code or unpickled a forged buffer"


def test_rank_drops_a_replayed_genuine_execute(
    pool: Pool, marker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real cell's ``execute`` frames, captured as the kernel sends them, then sent again."""
    assert pool.connection.wire is not None
    captured: list[list[bytes]] = []
    encode = pool.connection.wire.encode

    def capture(
        msg_type: str, body: dict[str, Any], buffers: Sequence[bytes] = (), to: str | None = None
    ) -> list[bytes]:
        frames = encode(msg_type, body, buffers, to)
        if msg_type == "execute":
            captured.append(frames)
        return frames

    monkeypatch.setattr(pool.connection.wire, "encode", capture)
    pool.run(f"open({str(marker)!r}, 'a').write('x')", ranks=[0])
    monkeypatch.undo()
    assert marker.read_text() == "x" and len(captured) == 1
    before = _rank0_rejected(pool)
    _to_rank0(pool, [captured[0]], "link")
    _to_rank0(pool, [captured[0]], "socket")
    assert _rank0_rejects(pool, before, 2) == 2
    assert marker.read_text() == "x", "a replayed execute ran the cell again"
    dropped = pool.dropped
    _send(pool, [captured[0]])  # and on the kernel's socket it is not a rank's message at all
    _assert_refused(pool, dropped, 1)
    assert marker.read_text() == "x"


# -- F16: another process or user ------------------------------------------------------------------

_KEYLESS_PEER = """
import pickle, sys, zmq
from jupyter_shard.wire.protocol import TAG, Wire, new_key, pack

address, marker = sys.argv[1], sys.argv[2]

class Evil:
    def __reduce__(self):
        return (exec, ("open(%r, 'w').write('unpickled')" % marker,))

payload = pickle.dumps(Evil())
code = "open(%r, 'w').write('ran')" % marker
ctx = zmq.Context()
sent = 0
for identity in (b"rank-00", b"rank-01.io", b"intruder", None):
    sock = ctx.socket(zmq.DEALER)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(address)
    wire = Wire(new_key(), (identity or b"rank-0").decode())
    for frames in (
        wire.to_socket("execute", {"cell_id": "c", "code": code, "exec_count": 1}),
        wire.to_socket("push", {"names": ["x"], "req_id": "r"}, [payload]),
        wire.to_socket("pull_reply", {"req_id": "r", "ok": True, "error": ""}, [payload]),
        pack([TAG, b"", b'{"type": "stream"}', b'{"name": "stdout"}', sys.argv[3].encode()]),
        [payload] * 4,
        [b"garbage"],
    ):
        sock.send_multipart(frames)
        sent += 1
    sock.close()
ctx.term()
print(sent)
"""


def test_keyless_process_on_the_pool_socket_is_refused_and_runs_nothing(pool: Pool, marker: Path) -> None:
    assert pool.directory is not None
    dropped = pool.dropped
    peer = subprocess.run(
        [sys.executable, "-c", _KEYLESS_PEER, f"ipc://{pool.directory / 'pool.sock'}", str(marker), FORGED],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert peer.returncode == 0, peer.stderr
    sent = int(peer.stdout)
    assert sent == 24
    _assert_refused(pool, dropped, sent, marker)


_CONNECT_PROBE = """
import os, socket, sys
for path in sys.argv[1:]:
    try:
        os.stat(os.path.dirname(path))  # the directory itself can be found...
    except PermissionError:  # ...or not even that, under the user's 0700 runtime directory
        print("refused")
        continue
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        print("connected")
    except PermissionError:
        print("refused")
    finally:
        s.close()
"""


def _python_for(uid: int) -> str | None:
    """An interpreter that user ``uid`` may run (the venv's may sit under root's 0700 home)."""
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    for candidate in (sys.executable, getattr(sys, "_base_executable", ""), system):
        if not candidate:
            continue
        try:
            subprocess.run(
                [candidate, "-c", "pass"], user=uid, group=uid, extra_groups=[], check=True, timeout=30
            )
        except (OSError, subprocess.SubprocessError):
            continue
        return candidate
    return None


def test_other_user_cannot_connect_to_the_pool_socket(pool: Pool) -> None:
    """The socket sits in a 0700 directory of the kernel's user. Root ignores permission bits, so
    when the tests run as root the mode is asserted and a probe dropped to ``nobody`` must be
    refused where it can reach a control socket in an open directory."""
    assert pool.directory is not None
    info = pool.directory.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    if os.getuid() != 0:
        pytest.skip("switching to another user needs root; the 0700 mode is asserted above")
    nobody = 65534
    python = _python_for(nobody)
    if python is None:
        pytest.skip("no Python interpreter that user nobody may run")
    open_dir = Path(tempfile.mkdtemp(prefix="js-open-"))
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        open_dir.chmod(0o755)
        control.bind(str(open_dir / "control.sock"))
        (open_dir / "control.sock").chmod(0o777)
        control.listen(1)
        probe = subprocess.run(
            [
                python,
                "-I",
                "-c",
                _CONNECT_PROBE,
                str(open_dir / "control.sock"),
                str(pool.directory / "pool.sock"),
                str(pool.directory / "direct.sock"),
            ],
            user=nobody,
            group=nobody,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        control.close()
        shutil.rmtree(open_dir, ignore_errors=True)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["connected", "refused", "refused"]
    assert pool.run("6 * 7", timeout=30).value == {"text/plain": "42"}


# -- F15 on the direct links --------------------------------------------------------------------------


def _link_record(*frames: bytes) -> bytes:
    return b"".join(bytes(piece) for piece in protocol.stream_record(list(frames)))


def _send_on_a_link(pool: Pool, name: bytes, records: Sequence[list[bytes]]) -> bytes:
    """Open a direct link as a peer without the key, send, and return what the kernel sent back
    before it closed the link (it must close it: nothing forged may be served)."""
    assert pool.directory is not None
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.settimeout(10)
    try:
        peer.connect(str(pool.directory / "direct.sock"))
        peer.sendall(_link_record(name) + b"".join(_link_record(*_framed(r)) for r in records))
        received = b""
        while chunk := peer.recv(65536):
            received += chunk
        return received
    finally:
        peer.close()


def test_local_ranks_talk_over_their_direct_links(pool: Pool) -> None:
    links = pool.connection.links
    assert [links.serves(r) for r in range(2)] == [True, True]
    assert pool.run("6 * 7", timeout=30).value == {"text/plain": "42"}


@pytest.mark.parametrize("name", [b"rank-0", b"rank-1.io", b"rank-7", b"intruder"])
def test_forged_messages_on_a_direct_link_are_dropped_and_the_link_closed(
    pool: Pool, marker: Path, name: bytes
) -> None:
    """Whatever name a link claims, its first message must be signed with the pool key as that
    rank's main thread, or it is dropped (counted once) and the link closed unread; the rank's own
    link keeps serving it."""
    dropped = pool.dropped
    links = pool.connection.links
    own = links._by_rank[0]
    wrong_key = Wire(new_key(), "rank-0")
    records = [
        wrong_key.to_socket("done", {"cell_id": "forged", "status": "ok"}),
        wrong_key.to_socket("ready", {"rank": 0, "pid": os.getpid()}),
        [TAG, b"s" * 32, b"{}", b"{}"],
        _execute(new_key(), marker, "rank-0"),
        _execute(new_key(), marker, "kernel"),
    ]
    assert _send_on_a_link(pool, name, records) == b""
    _assert_refused(pool, dropped, 1, marker)
    assert links._by_rank[0] is own


def test_a_link_that_names_no_rank_is_closed_and_nothing_is_counted(pool: Pool) -> None:
    dropped = pool.dropped
    assert _send_on_a_link(pool, b"x" * 65, [[b"anything"]]) == b""
    assert pool.dropped == dropped
    assert pool.run("6 * 7", timeout=30).value == {"text/plain": "42"}
    assert pool.connection.links.serves(0)
