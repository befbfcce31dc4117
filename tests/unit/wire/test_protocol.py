"""jupyter_shard.wire.protocol: signing, authentication before parsing, replay and size limits,
no unpickling."""

from __future__ import annotations

import builtins
import json
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jupyter_shard.wire import protocol
from jupyter_shard.wire.protocol import (
    MSG_TYPES,
    TAG,
    Message,
    ProtocolError,
    Wire,
    io_identity,
    new_key,
    parse_identity,
    rank_identity,
)

KEY = b"k" * 32
OTHER_KEY = b"x" * 32


@pytest.fixture
def sender() -> Wire:
    return Wire(KEY, "rank-0")


@pytest.fixture
def receiver() -> Wire:
    return Wire(KEY, "kernel")


def sign(header: bytes, body: bytes, *buffers: bytes, key: bytes = KEY) -> list[bytes]:
    """Frames with a valid signature over arbitrary header/body bytes (what a key holder can send)."""
    return [TAG, protocol._mac(key, [TAG, header, body, *buffers]), header, body, *buffers]


def header_json(**fields: Any) -> bytes:
    base: dict[str, Any] = {"v": 1, "type": "status", "id": "x", "seq": 1, "sender": "rank-0", "ts": 0.0}
    base.update(fields)
    return json.dumps(base).encode()


def flip(data: bytes, index: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[index] ^= 1 << bit
    return bytes(out)


def rejected(receiver: Wire, frames: list[bytes], match: str, **kwargs: Any) -> None:
    before = receiver.rejected
    with pytest.raises(ProtocolError, match=match):
        receiver.decode(frames, **kwargs)
    assert receiver.rejected == before + 1


# -- keys ---------------------------------------------------------------------------------------------


def test_new_key_is_256_random_bits() -> None:
    a, b = new_key(), new_key()
    assert len(a) == 32 and len(b) == 32
    assert a != b


@pytest.mark.parametrize("length", [0, 1, 16, 31])
def test_short_keys_are_refused(length: int) -> None:
    with pytest.raises(ValueError, match="at least 256 bits"):
        Wire(b"k" * length, "kernel")


def test_32_byte_key_is_accepted() -> None:
    assert Wire(b"k" * 32, "kernel").sender == "kernel"


def test_identities_round_trip() -> None:
    assert rank_identity(3) == "rank-3"
    assert io_identity(3) == "rank-3.io"
    for rank in (0, 7, 123456):
        assert parse_identity(rank_identity(rank).encode()) == (rank, False)
        assert parse_identity(io_identity(rank).encode()) == (rank, True)


@pytest.mark.parametrize(
    "identity",
    [
        b"",
        b"kernel",
        b"rank-",
        b"rank--1",
        b"rank-1x",
        b"rank-1.io.io",
        b"rank-1234567",
        b"Rank-1",
        b"rank-\xd9\xa1",
        "rank-\u00b2".encode(),
        b"rank-1.i",
        b"\xff\xfe",
    ],
)
def test_parse_identity_refuses_anything_else(identity: bytes) -> None:
    assert parse_identity(identity) == (-1, False)


# -- round trip ---------------------------------------------------------------------------------------


def test_round_trip_with_buffers(sender: Wire, receiver: Wire) -> None:
    buffers = [b"", b"\x00\x01\x02", bytes(range(256)) * 10]
    body = {"cell_id": "c1", "names": ["a", "b"], "n": 3, "nested": {"x": [1.5, None, True]}}
    frames = sender.encode("push_reply", body, buffers)
    assert frames[0] == TAG
    assert len(frames) == 4 + len(buffers)
    msg = receiver.decode(frames, expect_sender="rank-0")
    assert isinstance(msg, Message)
    assert msg.type == "push_reply"
    assert msg.body == body
    assert msg.sender == "rank-0"
    assert msg.buffers == buffers
    assert all(type(b) is bytes for b in msg.buffers)
    assert receiver.rejected == 0


def test_round_trip_accepts_memoryview_frames(sender: Wire, receiver: Wire) -> None:
    frames = sender.encode("stream", {"cell_id": "c", "name": "stdout", "text": "hi\n"}, [b"buf"])
    msg = receiver.decode([memoryview(f) for f in frames])
    assert msg.body["text"] == "hi\n" and msg.buffers == [b"buf"]


def test_sequence_grows_and_messages_decode_in_order(sender: Wire, receiver: Wire) -> None:
    msgs = [receiver.decode(sender.encode("metrics", {"step": i, "values": {}, "ts": 0.0})) for i in range(5)]
    seqs = [m.seq for m in msgs]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    assert [m.body["step"] for m in msgs] == list(range(5))


def test_every_message_type_round_trips(sender: Wire, receiver: Wire) -> None:
    for t in sorted(MSG_TYPES):
        assert receiver.decode(sender.encode(t, {})).type == t


def test_independent_senders_have_independent_sequences(receiver: Wire) -> None:
    a, b = Wire(KEY, "rank-0"), Wire(KEY, "rank-1")
    fa, fb = a.encode("ready", {}), b.encode("ready", {})
    fb2 = b.encode("done", {})
    assert receiver.decode(fb).sender == "rank-1"
    assert receiver.decode(fa).sender == "rank-0"
    assert receiver.decode(fb2).type == "done"


# -- rejection ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [TAG],
        [TAG, b"sig", b"{}"],
        [b"jsh2", b"sig", b"{}", b"{}"],
        [b"", b"", b"", b""],
        [b"garbage"] * 6,
    ],
)
def test_garbage_frames_are_rejected(receiver: Wire, frames: list[bytes]) -> None:
    rejected(receiver, frames, "not a jupyter_shard message")


def test_unsigned_message_is_rejected(sender: Wire, receiver: Wire) -> None:
    frames = sender.encode("execute", {"cell_id": "c", "code": "1", "exec_count": 1})
    frames[1] = b""
    rejected(receiver, frames, "bad signature")
    frames[1] = b"\x00" * 32
    rejected(receiver, frames, "bad signature")


def test_wrong_key_is_rejected(receiver: Wire) -> None:
    intruder = Wire(OTHER_KEY, "rank-0")
    rejected(
        receiver, intruder.encode("execute", {"cell_id": "c", "code": "1", "exec_count": 1}), "bad signature"
    )


def _sample(sender: Wire) -> list[bytes]:
    return sender.encode("push", {"names": ["a"]}, [b"first buffer", b"second buffer", b"third"])


@pytest.mark.parametrize("frame_index", range(1, 7), ids=["sig", "header", "body", "buf0", "buf1", "buf2"])
@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_one_flipped_bit_anywhere_is_rejected(
    sender: Wire, receiver: Wire, frame_index: int, where: str
) -> None:
    frames = _sample(sender)
    n = len(frames[frame_index])
    index = {"start": 0, "middle": n // 2, "end": n - 1}[where]
    frames[frame_index] = flip(frames[frame_index], index, bit=3)
    rejected(receiver, frames, "bad signature")


def test_flipped_tag_is_rejected(sender: Wire, receiver: Wire) -> None:
    frames = _sample(sender)
    frames[0] = flip(frames[0], 0)
    rejected(receiver, frames, "bad tag")


def test_buffers_are_covered_by_the_signature(sender: Wire, receiver: Wire) -> None:
    frames = _sample(sender)
    rejected(receiver, [*frames[:-1], b"other"], "bad signature")
    rejected(receiver, [*frames, b"extra"], "bad signature")
    rejected(receiver, [*frames, b""], "bad signature")
    rejected(receiver, [*frames[:4], frames[5], frames[4], frames[6]], "bad signature")
    # moving bytes between adjacent buffers keeps the concatenation but not the signature
    rejected(receiver, [*frames[:4], frames[4] + frames[5][:1], frames[5][1:], frames[6]], "bad signature")
    assert receiver.decode(frames).buffers == [b"first buffer", b"second buffer", b"third"]


def test_truncated_frame_lists_are_rejected(sender: Wire, receiver: Wire) -> None:
    frames = _sample(sender)
    for n in range(len(frames)):
        with pytest.raises(ProtocolError):
            receiver.decode(frames[:n])
    assert receiver.rejected == len(frames)
    assert receiver.decode(frames).type == "push"


def test_truncated_frame_contents_are_rejected(sender: Wire, receiver: Wire) -> None:
    frames = _sample(sender)
    for i in range(1, len(frames)):
        cut = list(frames)
        cut[i] = cut[i][:-1]
        rejected(receiver, cut, "bad signature")


def test_replayed_message_is_rejected(sender: Wire, receiver: Wire) -> None:
    frames = sender.encode("execute", {"cell_id": "c", "code": "x = 1", "exec_count": 1})
    assert receiver.decode(frames).type == "execute"
    rejected(receiver, frames, "replayed or reordered message from 'rank-0'")
    rejected(receiver, list(frames), "replayed")


def test_older_sequence_is_rejected(sender: Wire, receiver: Wire) -> None:
    first = sender.encode("stream", {"text": "1"})
    second = sender.encode("stream", {"text": "2"})
    assert receiver.decode(second).body == {"text": "2"}
    rejected(receiver, first, "replayed or reordered")
    # and a newer one is still accepted afterwards
    assert receiver.decode(sender.encode("stream", {"text": "3"})).body == {"text": "3"}


def test_replay_state_is_per_receiver(sender: Wire) -> None:
    frames = sender.encode("ready", {})
    assert Wire(KEY, "kernel").decode(frames).type == "ready"
    assert Wire(KEY, "kernel").decode(frames).type == "ready"


def test_sender_mismatch_is_rejected_and_does_not_burn_the_sequence(sender: Wire, receiver: Wire) -> None:
    frames = sender.encode("result", {"cell_id": "c"})
    rejected(receiver, frames, "claims sender 'rank-0' on the socket of 'rank-1'", expect_sender="rank-1")
    assert receiver.decode(frames, expect_sender="rank-0").type == "result"


def test_oversized_header_is_rejected(sender: Wire, receiver: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    frames = sender.encode("status", {})
    monkeypatch.setattr(protocol, "MAX_HEADER", len(frames[2]) - 1)
    rejected(receiver, frames, "header or body over the size limit")
    monkeypatch.setattr(protocol, "MAX_HEADER", len(frames[2]))
    assert receiver.decode(frames).type == "status"


def test_oversized_body_is_rejected(sender: Wire, receiver: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    frames = sender.encode("execute", {"cell_id": "c", "code": "x" * 100, "exec_count": 1})
    monkeypatch.setattr(protocol, "MAX_BODY", 64)
    rejected(receiver, frames, "header or body over the size limit")


def test_oversized_buffer_is_rejected(sender: Wire, receiver: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    frames = sender.encode("push", {}, [b"small", b"y" * 200])
    monkeypatch.setattr(protocol, "MAX_FRAME", 100)
    rejected(receiver, frames, "buffer over the size limit")


def test_size_limits_are_checked_before_the_signature(
    receiver: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An oversized frame is refused on size alone, even unsigned (no HMAC over a huge frame)."""
    monkeypatch.setattr(protocol, "MAX_FRAME", 10)
    rejected(receiver, [TAG, b"nosig", b"{}", b"{}", b"z" * 11], "size limit")


@pytest.mark.parametrize(
    ("header", "body", "match"),
    [
        (b"\xff\xfe\x00garbage", b"{}", "not JSON"),
        (header_json(), b"not json", "not JSON"),
        (header_json(), b"\xff\xff\xff", "not JSON"),
        (header_json(), b"", "not JSON"),
        (b"[1, 2]", b"{}", "must be JSON objects"),
        (header_json(), b"[]", "must be JSON objects"),
        (header_json(), b'"text"', "must be JSON objects"),
        (header_json(), b"null", "must be JSON objects"),
        (b"42", b"42", "must be JSON objects"),
        (header_json(type="rm_rf"), b"{}", "unknown type or bad header: 'rm_rf'"),
        (header_json(type=None), b"{}", "unknown type"),
        (header_json(type=7), b"{}", "unknown type"),
        (header_json(sender=5), b"{}", "bad header"),
        (header_json(seq="1"), b"{}", "bad header"),
        (header_json(seq=1.0), b"{}", "bad header"),
        (header_json(seq=True), b"{}", "bad header"),
        (header_json(seq=None), b"{}", "bad header"),
        (json.dumps({"sender": "rank-0", "seq": 1}).encode(), b"{}", "unknown type"),
    ],
)
def test_validly_signed_but_malformed_messages_are_rejected(
    receiver: Wire, header: bytes, body: bytes, match: str
) -> None:
    rejected(receiver, sign(header, body), match)


def test_validly_signed_hand_built_message_is_accepted(receiver: Wire) -> None:
    msg = receiver.decode(sign(header_json(seq=5), b'{"a": 1}', b"buf"))
    assert (msg.type, msg.seq, msg.sender, msg.body, msg.buffers) == (
        "status",
        5,
        "rank-0",
        {"a": 1},
        [b"buf"],
    )


@pytest.mark.parametrize("bad_type", [["execute"], {"a": 1}])
def test_unhashable_type_field_is_a_protocol_error(receiver: Wire, bad_type: object) -> None:
    rejected(receiver, sign(header_json(type=bad_type), b"{}"), "unknown type")


def test_deeply_nested_body_is_a_protocol_error(receiver: Wire) -> None:
    rejected(receiver, sign(header_json(), b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"), "JSON")


def test_huge_integer_in_body_is_a_protocol_error(receiver: Wire) -> None:
    rejected(receiver, sign(header_json(), b'{"a":1' + b"0" * 5000 + b"}"), "JSON")


# -- nothing is unpickled ----------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Tripwires on every unpickling entry point; the yielded list records any call."""
    calls: list[str] = []

    def trip(name: str) -> Callable[..., Any]:
        def tripped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called during decode")

        return tripped

    try:
        import cloudpickle  # imported before pickle is patched: it binds pickle.loads at import time
    except ImportError:  # pragma: no cover
        cloudpickle = None
    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, trip(f"pickle.{name}"))
    try:
        if cloudpickle is None:
            raise ImportError
        monkeypatch.setattr(cloudpickle, "loads", trip("cloudpickle.loads"))
        monkeypatch.setattr(cloudpickle, "load", trip("cloudpickle.load"))
    except ImportError:  # pragma: no cover
        pass
    yield calls


def test_the_evil_payload_is_live(tmp_path: Path) -> None:
    """Sanity check for the tests below: loading this payload really would run code."""
    canary = tmp_path / "canary"
    pickle.loads(pickle.dumps(_Evil(canary)))
    assert canary.read_text() == "pwned"


def test_authenticated_pickle_buffer_is_returned_as_bytes_never_loaded(
    sender: Wire, receiver: Wire, marker: Path, no_unpickling: list[str]
) -> None:
    payload = pickle.dumps(_Evil(marker))
    msg = receiver.decode(sender.encode("push", {"names": ["x"]}, [payload]))
    assert msg.buffers == [payload]
    assert not marker.exists()
    assert no_unpickling == []


def test_unauthenticated_pickle_is_never_loaded(
    receiver: Wire, marker: Path, no_unpickling: list[str]
) -> None:
    payload = pickle.dumps(_Evil(marker))
    intruder = Wire(OTHER_KEY, "rank-0")
    attempts = [
        intruder.encode("push", {}, [payload]),
        [TAG, b"", payload, payload, payload],
        [TAG, b"", b"{}", payload],
        [payload, payload, payload, payload],
        sign(payload, b"{}", payload),  # even validly signed, a pickle header is not JSON
        sign(header_json(), payload),
    ]
    for frames in attempts:
        with pytest.raises(ProtocolError):
            receiver.decode(frames)
    assert receiver.rejected == len(attempts)
    assert not marker.exists()
    assert no_unpickling == []


# -- fuzzing -----------------------------------------------------------------------------------------

_FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _decode_only_protocol_errors(wire: Wire, frames: list[bytes]) -> Message | None:
    before = wire.rejected
    try:
        msg = wire.decode(frames)
    except ProtocolError:
        assert wire.rejected == before + 1
        return None
    assert wire.rejected == before
    return msg


@_FUZZ
@given(st.lists(st.binary(max_size=80), max_size=8))
def test_fuzz_random_frames(frames: list[bytes]) -> None:
    assert _decode_only_protocol_errors(Wire(KEY, "kernel"), frames) is None


@_FUZZ
@given(st.lists(st.binary(max_size=80), max_size=6))
def test_fuzz_random_frames_with_the_right_tag(rest: list[bytes]) -> None:
    assert _decode_only_protocol_errors(Wire(KEY, "kernel"), [TAG, *rest]) is None


_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=20),
)
_json_value = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _at(draw: st.DrawFn, n: int) -> int:
    """A position in 0..n-1 drawn independently of n (header length varies with the clock)."""
    return draw(st.integers(min_value=0, max_value=2**16)) % max(n, 1)


@st.composite
def _mutation(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    out = list(frames)
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "drop", "insert", "swap", "replace"]))
    i = _at(draw, len(out))
    pos, bit = _at(draw, len(out[i])), draw(st.integers(min_value=0, max_value=7))
    extra = draw(st.binary(min_size=1, max_size=16))
    if kind == "flip" and out[i]:
        out[i] = flip(out[i], pos, bit)
    elif kind == "truncate":
        out[i] = out[i][:pos]
    elif kind == "extend":
        out[i] = out[i] + extra
    elif kind == "drop":
        del out[i]
    elif kind == "insert":
        out.insert(i, extra)
    elif kind == "swap":
        j = _at(draw, len(out))
        out[i], out[j] = out[j], out[i]
    else:
        out[i] = extra
    return out


@_FUZZ
@given(
    st.sampled_from(sorted(MSG_TYPES)),
    st.dictionaries(st.text(max_size=8), _json_value, max_size=4),
    st.lists(st.binary(max_size=32), max_size=3),
    st.data(),
)
def test_fuzz_mutated_valid_messages(
    msg_type: str, body: dict[str, Any], buffers: list[bytes], data: Any
) -> None:
    sender, receiver = Wire(KEY, "rank-0"), Wire(KEY, "kernel")
    frames = sender.encode(msg_type, body, buffers)
    mutated = data.draw(_mutation(frames))
    assume(mutated != frames)
    assert _decode_only_protocol_errors(receiver, mutated) is None
    # the genuine message still goes through after the rejected one
    assert receiver.decode(frames).type == msg_type


@_FUZZ
@given(st.binary(max_size=120), st.binary(max_size=120), st.lists(st.binary(max_size=16), max_size=2))
def test_fuzz_signed_random_bytes(header: bytes, body: bytes, buffers: list[bytes]) -> None:
    """A key holder sending junk: still only ever a ProtocolError."""
    _decode_only_protocol_errors(Wire(KEY, "kernel"), sign(header, body, *buffers))


@_FUZZ
@given(
    st.one_of(st.sampled_from(sorted(MSG_TYPES)), _json_scalar),
    st.one_of(st.just("rank-0"), _json_value),
    st.one_of(st.integers(min_value=-(2**70), max_value=2**70), _json_value),
    st.one_of(st.dictionaries(st.text(max_size=8), _json_value, max_size=4), _json_value),
    st.dictionaries(st.text(max_size=6), _json_value, max_size=3),
)
def test_fuzz_signed_json(msg_type: Any, sender: Any, seq: Any, body: Any, extra: dict[str, Any]) -> None:
    header = {**extra, "type": msg_type, "sender": sender, "seq": seq}
    receiver = Wire(KEY, "kernel")
    msg = _decode_only_protocol_errors(receiver, sign(json.dumps(header).encode(), json.dumps(body).encode()))
    valid = (
        msg_type in MSG_TYPES
        and isinstance(sender, str)
        and type(seq) is int
        and seq >= 0  # a fresh receiver has seen -1 from everyone
        and isinstance(body, dict)
    )
    assert (msg is not None) == valid
    if msg is not None:
        assert (msg.type, msg.sender, msg.seq) == (msg_type, sender, seq)


def test_cell_head_names_a_cell_by_its_first_line_of_code() -> None:
    from jupyter_shard.wire.protocol import cell_head

    code = "# %%distributed --nproc 2\n\n  for step in range(10):\n    pass"
    assert cell_head(code) == "for step in range(10):"
    assert cell_head("# a comment of the user\nx = 1") == "# a comment of the user"
    assert cell_head("") == "" and len(cell_head("y = " + "1" * 200)) == 80


# -- socket layout: the signed parts packed into one frame, then the buffers --------------------------


def test_socket_frames_round_trip(sender: Wire, receiver: Wire) -> None:
    buffers = [b"", b"\x00\x01", bytes(range(256))]
    frames = sender.to_socket("push_reply", {"ok": True, "names": ["a"]}, buffers)
    assert len(frames) == 1 + len(buffers) and frames[0].startswith(TAG) and frames[1:] == buffers
    msg = receiver.from_socket([memoryview(f) for f in frames], expect_sender="rank-0")
    assert msg.body == {"ok": True, "names": ["a"]} and msg.buffers == buffers
    assert receiver.rejected == 0


def test_pack_and_unpack_are_inverse(sender: Wire) -> None:
    parts = sender.encode("stream", {"cell_id": "c", "name": "stdout", "text": "x\n"}, [b"b1", b"b2"])
    assert protocol.unpack(protocol.pack(parts)) == parts


def _count_rejected(receiver: Wire, frames: list[bytes], match: str) -> None:
    before = receiver.rejected
    with pytest.raises(ProtocolError, match=match):
        receiver.from_socket(frames)
    assert receiver.rejected == before + 1


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no frames"),
        ([b""], "bad tag or too short"),
        ([TAG + b"\x00" * 35], "bad tag or too short"),
        ([b"jsh2" + b"\x00" * 60], "bad tag or too short"),
        ([TAG + b"\x00" * 32 + (protocol.MAX_HEADER + 1).to_bytes(4, "big") + b"{}" * 3000], "length"),
        ([TAG + b"\x00" * 32 + (10).to_bytes(4, "big") + b"{}"], "length"),
    ],
    ids=["nothing", "empty", "short", "tag", "header-too-long", "header-past-the-end"],
)
def test_malformed_socket_frames_are_rejected(receiver: Wire, frames: list[bytes], match: str) -> None:
    _count_rejected(receiver, frames, match)


def test_every_flipped_byte_of_a_packed_frame_is_rejected(sender: Wire, receiver: Wire) -> None:
    """Tag, signature, the header's length, header and body all sit in the first frame."""
    frames = sender.to_socket("execute", {"cell_id": "c", "code": "1", "exec_count": 1}, [b"buf"])
    for index in range(len(frames[0])):
        with pytest.raises(ProtocolError):
            receiver.from_socket([flip(frames[0], index), *frames[1:]])
    with pytest.raises(ProtocolError):
        receiver.from_socket([frames[0], flip(frames[1], 1)])
    assert receiver.rejected == len(frames[0]) + 1
    assert receiver.from_socket(frames).type == "execute"


def test_moving_the_header_boundary_is_rejected(sender: Wire, receiver: Wire) -> None:
    """A length that splits header and body elsewhere keeps every byte but not the signature."""
    frames = sender.to_socket("status", {"req_id": "r"})
    head = len(TAG) + 32
    size = int.from_bytes(frames[0][head : head + 4], "big")
    for moved in (size - 1, size + 1):
        first = frames[0][:head] + moved.to_bytes(4, "big") + frames[0][head + 4 :]
        with pytest.raises(ProtocolError):
            receiver.from_socket([first])
    assert receiver.from_socket(frames).type == "status"


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.binary(max_size=80), max_size=4), st.data())
def test_random_socket_frames_are_only_ever_protocol_errors(rest: list[bytes], data: Any) -> None:
    receiver = Wire(KEY, "kernel")
    first = data.draw(st.one_of(st.binary(max_size=120), st.binary(max_size=80).map(lambda b: TAG + b)))
    with pytest.raises(ProtocolError):
        receiver.from_socket([first, *rest])
    assert receiver.rejected == 1


# -- stream records (a local rank's direct link) ------------------------------------------------------


def _joined(frames: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(piece) for piece in protocol.stream_record(frames))


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=5), min_size=1, max_size=6),
    st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=40),
)
def test_stream_records_come_back_whole_however_the_bytes_are_cut(
    records: list[list[bytes]], cuts: list[int]
) -> None:
    data = b"".join(_joined(list(r)) for r in records)
    reader = protocol.StreamReader()
    got: list[list[bytes]] = []
    at, i = 0, 0
    while at < len(data):
        size = cuts[i % len(cuts)]
        got.extend(reader.feed(memoryview(data)[at : at + size]))
        at, i = at + size, i + 1
    assert got == records


def test_a_signed_message_crosses_a_stream_and_is_authenticated_after(sender: Wire, receiver: Wire) -> None:
    buffer = bytearray(b"\x01\x02\x03")
    frames = sender.to_socket("done", {"cell_id": "c", "status": "ok"}, [memoryview(buffer), b""])
    (record,) = protocol.StreamReader().feed(_joined(frames))
    msg = receiver.from_socket(record, expect_sender="rank-0")
    assert (msg.type, msg.body["cell_id"], msg.buffers) == ("done", "c", [b"\x01\x02\x03", b""])
    forged = protocol.StreamReader().feed(_joined([flip(bytes(frames[0]), 50)]))
    with pytest.raises(ProtocolError, match="bad signature"):
        receiver.from_socket(forged[0])


@pytest.mark.parametrize(
    "head",
    [
        (0).to_bytes(4, "big"),  # no frames
        (protocol.MAX_STREAM_FRAMES + 1).to_bytes(4, "big"),
        (1).to_bytes(4, "big") + (1 << 62).to_bytes(8, "big"),  # a frame no message may have
    ],
)
def test_a_stream_record_that_no_sender_makes_is_refused_before_its_frames_are_read(head: bytes) -> None:
    with pytest.raises(ProtocolError, match="stream record"):
        protocol.StreamReader().feed(head)


def test_a_partial_stream_record_waits_for_the_rest() -> None:
    data = _joined([b"abc", b"defg"])
    reader = protocol.StreamReader()
    assert reader.feed(data[:-1]) == []
    assert reader.feed(data[-1:]) == [[b"abc", b"defg"]]
    assert reader.feed(b"") == []


def test_a_kernel_message_names_its_recipients_and_other_ranks_refuse_it() -> None:
    """Signed once for ranks 0-2 and 5: rank 3 refuses it (a copy sent its way is not its own); a
    rank's message to the kernel is refused by another rank."""
    from jupyter_shard.spec import format_ranks
    from jupyter_shard.wire.protocol import KERNEL, io_identity, rank_identity

    key = new_key()
    kernel = Wire(key, KERNEL)
    to = format_ranks([5, 0, 1, 2])
    assert to == "0-2,5"
    frames = kernel.encode("status", {}, to=to)
    for rank in (0, 2, 5):
        assert Wire(key, rank_identity(rank)).decode(frames).type == "status"
    assert Wire(key, io_identity(1)).decode(frames).type == "status"
    for rank in (3, 4, 6, 50):
        with pytest.raises(ProtocolError, match="meant for '0-2,5', not 'rank-"):
            Wire(key, rank_identity(rank)).decode(frames)
    everyone = kernel.encode("status", {})
    assert Wire(key, rank_identity(9)).decode(everyone).type == "status"
    from_rank = Wire(key, rank_identity(1)).encode("status", {})
    assert Wire(key, KERNEL).decode(from_rank).sender == "rank-1"
    with pytest.raises(ProtocolError, match="meant for 'kernel'"):
        Wire(key, rank_identity(2)).decode(from_rank)
