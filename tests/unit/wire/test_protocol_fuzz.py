"""Fuzzing :meth:`jupyter_shard.wire.protocol.Wire.decode`, the first thing every frame on a pool
socket meets.

Whatever arrives, decode returns a message only for an untouched genuine one and otherwise raises
:class:`ProtocolError` (counted in ``rejected``): never another exception, never a hang. Genuine
messages round-trip; replayed and out-of-order ones are refused, per sender, without burning the
sequence of the sender they claim to be from.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from jupyter_shard.wire import protocol
from jupyter_shard.wire.protocol import MSG_TYPES, TAG, Message, ProtocolError, Wire

pytestmark = pytest.mark.timeout(90)

KEY = bytes(range(32))
SENDERS = ("rank-0", "rank-0.io", "rank-1")

FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _decode(wire: Wire, frames: list[Any], expect_sender: str | None = None) -> Message | None:
    """``decode``, holding it to its contract: a message, or a ProtocolError that is counted."""
    before = wire.rejected
    try:
        msg = wire.decode(frames, expect_sender)
    except ProtocolError:
        assert wire.rejected == before + 1
        return None
    assert wire.rejected == before
    return msg


# -- strategies -------------------------------------------------------------------------------------

_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False),  # NaN round-trips, but is not equal to itself
    st.text(max_size=16),
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
_bodies = st.dictionaries(st.text(max_size=10), _json, max_size=5)
_buffers = st.lists(st.binary(max_size=48), max_size=4)
_types = st.sampled_from(sorted(MSG_TYPES))


@st.composite
def _frame_like(draw: st.DrawFn, data: bytes) -> Any:
    """The same bytes as zmq may hand them over: bytes, bytearray or memoryview."""
    kind = draw(st.sampled_from([bytes, bytearray, memoryview]))
    return kind(data) if kind is not memoryview else memoryview(data)


_random_frames = st.lists(
    st.one_of(st.binary(max_size=64), st.just(TAG), st.just(b""), st.just(b"{}")), max_size=10
)


def _at(raw: int, n: int) -> int:
    return raw % max(n, 1)


_MUTATIONS = ["flip", "cut_frame", "cut_list", "extra", "swap", "duplicate", "drop", "replace", "grow"]


@st.composite
def _mutated(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    """One to three of: a bit flip, a cut frame, a cut list, an extra part, swapped parts...

    Every step draws the same values whatever the frames hold, so that a failure replays."""
    out = list(frames)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        kind = draw(st.sampled_from(_MUTATIONS))
        i_raw, j_raw, pos_raw = (draw(st.integers(min_value=0, max_value=2**16)) for _ in range(3))
        bit, extra = draw(st.integers(min_value=0, max_value=7)), draw(st.binary(max_size=16))
        if not out:
            out.append(extra)
            continue
        i, j = _at(i_raw, len(out)), _at(j_raw, len(out))
        pos = _at(pos_raw, len(out[i]))
        if kind == "flip" and out[i]:
            flipped = bytearray(out[i])
            flipped[pos] ^= 1 << bit
            out[i] = bytes(flipped)
        elif kind == "cut_frame":
            out[i] = out[i][:pos]
        elif kind == "cut_list":
            out = out[:i]
        elif kind == "extra":
            out.insert(_at(pos_raw, len(out) + 1), extra)
        elif kind == "swap":
            out[i], out[j] = out[j], out[i]
        elif kind == "duplicate":
            out.insert(i, out[i])
        elif kind == "drop":
            del out[i]
        elif kind == "replace":
            out[i] = extra
        else:
            out[i] = out[i] + (extra or b"+")
    return out


@contextmanager
def _frozen_clock() -> Iterator[None]:
    """Encode with a fixed clock, so that the same draws give the same frames when a failure replays."""
    clock = SimpleNamespace(time=lambda: 1_700_000_000.25, time_ns=lambda: 1_700_000_000_250_000_000)
    with mock.patch.object(protocol, "time", clock):
        yield


# -- random input -----------------------------------------------------------------------------------


@FUZZ
@given(_random_frames, st.one_of(st.none(), st.sampled_from(SENDERS)))
def test_random_frame_lists_are_only_ever_protocol_errors(frames: list[bytes], expect: str | None) -> None:
    assert _decode(Wire(KEY, "kernel"), frames, expect) is None


@FUZZ
@given(st.lists(st.binary(max_size=64), min_size=3, max_size=8), st.data())
def test_random_frames_behind_the_right_tag_in_any_frame_type(rest: list[bytes], data: Any) -> None:
    frames = [data.draw(_frame_like(f)) for f in [TAG, *rest]]
    assert _decode(Wire(KEY, "kernel"), frames) is None


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=200), _buffers)
def test_signed_random_bytes_are_only_ever_protocol_errors(
    header: bytes, body: bytes, buffers: list[bytes]
) -> None:
    """What a key holder could send: authentic, but not a message; still never another exception."""
    frames = [TAG, protocol._mac(KEY, [TAG, header, body, *buffers]), header, body, *buffers]
    msg = _decode(Wire(KEY, "kernel"), frames)
    if msg is not None:  # only if the random bytes happen to be a well-formed header and body
        assert json.loads(header)["type"] in MSG_TYPES


@settings(FUZZ, max_examples=40)
@given(
    st.sampled_from(
        [
            b"[" * 100_000,
            b'{"a":' * 50_000,
            b"1" * 5000,
            b'"' + b"\\u0000" * 2000 + b'"',
            b"1e999999",
            b"\xef\xbb\xbf{}",
            b"\xff\xfe{\x00}\x00",
            b"{}" + b" " * 10_000,
        ]
    ),
    st.booleans(),
)
def test_pathological_signed_json_is_refused_quickly(junk: bytes, in_header: bool) -> None:
    header = junk if in_header else json.dumps({"type": "status", "seq": 1, "sender": "rank-0"}).encode()
    body = b"{}" if in_header else junk
    frames = [TAG, protocol._mac(KEY, [TAG, header, body]), header, body]
    began = time.perf_counter()
    msg = _decode(Wire(KEY, "kernel"), frames)
    assert time.perf_counter() - began < 2.0  # no quadratic parse: refused in milliseconds
    if junk.strip() == b"{}" and not in_header:
        assert msg is not None and msg.type == "status" and msg.body == {}  # padded, but an object
    else:
        assert msg is None  # not a JSON object we accept


def test_many_tiny_frames_are_refused_without_trouble() -> None:
    assert _decode(Wire(KEY, "kernel"), [TAG] + [b""] * 100_000) is None


# -- genuine messages, mutated ----------------------------------------------------------------------


@FUZZ
@given(_types, _bodies, _buffers, st.data())
def test_any_mutation_of_a_genuine_message_is_refused(
    msg_type: str, body: dict[str, Any], buffers: list[bytes], data: Any
) -> None:
    with _frozen_clock():
        genuine = Wire(KEY, "rank-0").encode(msg_type, body, buffers)
    receiver = Wire(KEY, "kernel")
    mutated = data.draw(_mutated(genuine))
    msg = _decode(receiver, mutated, "rank-0")
    assert (msg is not None) == (mutated == genuine)  # e.g. swapping two equal frames changes nothing
    if msg is None:
        assert _decode(receiver, genuine, "rank-0") is not None  # a refusal burns no sequence number


@FUZZ
@given(_types, _bodies, _buffers)
def test_a_message_signed_with_another_key_is_refused(
    msg_type: str, body: dict[str, Any], buffers: list[bytes]
) -> None:
    forged = Wire(bytes(reversed(KEY)), "rank-0").encode(msg_type, body, buffers)
    assert _decode(Wire(KEY, "kernel"), forged) is None


# -- round trip -------------------------------------------------------------------------------------


@FUZZ
@given(_types, _bodies, _buffers, st.sampled_from(SENDERS), st.data())
def test_round_trip(msg_type: str, body: dict[str, Any], buffers: list[bytes], who: str, data: Any) -> None:
    sender, receiver = Wire(KEY, who), Wire(KEY, "kernel")
    frames = sender.encode(msg_type, body, buffers)
    assert frames[0] == TAG and len(frames) == 4 + len(buffers)
    msg = _decode(receiver, [data.draw(_frame_like(f)) for f in frames], who)
    assert msg is not None
    assert (msg.type, msg.sender, msg.buffers) == (msg_type, who, buffers)
    assert all(type(b) is bytes for b in msg.buffers)
    assert msg.body == body
    again = _decode(receiver, sender.encode(msg_type, body, buffers), who)
    assert again is not None and again.seq > msg.seq


# -- replay and order: a model of what must be accepted ---------------------------------------------


class ReplayModel(RuleBasedStateMachine):
    """Senders make messages; any made message may be delivered any number of times, in any order.
    Accepted exactly when its seq is above the last accepted from that sender."""

    made = Bundle("made")

    def __init__(self) -> None:
        super().__init__()
        self.receiver = Wire(KEY, "kernel")
        self.senders = {name: Wire(KEY, name) for name in SENDERS}
        self.last: dict[str, int] = {}
        self.refused = 0

    @rule(target=made, who=st.sampled_from(SENDERS), msg_type=_types, n=st.integers(0, 3))
    def make(self, who: str, msg_type: str, n: int) -> tuple[str, int, list[bytes]]:
        frames = self.senders[who].encode(msg_type, {"n": n}, [b"x" * (n + 1)])
        return who, json.loads(frames[2])["seq"], frames

    def _deliver(self, item: tuple[str, int, list[bytes]], expect: str | None) -> None:
        who, seq, frames = item
        msg = _decode(self.receiver, frames, expect)
        should = (expect is None or expect == who) and seq > self.last.get(who, -1)
        assert (msg is not None) == should, (who, seq, self.last)
        if msg is None:
            self.refused += 1
        else:
            assert (msg.sender, msg.seq) == (who, seq)
            self.last[who] = seq

    @rule(item=made)
    def deliver(self, item: tuple[str, int, list[bytes]]) -> None:
        self._deliver(item, item[0])

    @rule(item=consumes(made))
    def deliver_once_without_sender_check(self, item: tuple[str, int, list[bytes]]) -> None:
        self._deliver(item, None)

    @rule(item=made, claimed=st.sampled_from(SENDERS))
    def deliver_on_some_socket(self, item: tuple[str, int, list[bytes]], claimed: str) -> None:
        self._deliver(item, claimed)

    @rule(item=made, part=st.sampled_from([1, 3, 4]), at=st.integers(0, 10_000))
    def deliver_tampered(self, item: tuple[str, int, list[bytes]], part: int, at: int) -> None:
        """One bit changed in the signature, body or buffer (never empty: see ``make``)."""
        who, _, frames = item
        tampered = list(frames)
        spoiled = bytearray(tampered[part])
        spoiled[at % len(spoiled)] ^= 0x01
        tampered[part] = bytes(spoiled)
        assert _decode(self.receiver, tampered, who) is None
        self.refused += 1

    @invariant()
    def refusals_are_counted(self) -> None:
        assert self.receiver.rejected == self.refused


TestReplayModel = ReplayModel.TestCase
TestReplayModel.settings = settings(max_examples=40, stateful_step_count=30, deadline=None, database=None)


def test_replay_of_each_message_type_is_refused() -> None:
    sender, receiver = Wire(KEY, "rank-1"), Wire(KEY, "kernel")
    for msg_type in sorted(MSG_TYPES):
        frames = sender.encode(msg_type, {})
        assert _decode(receiver, frames) is not None
        assert _decode(receiver, frames) is None
        assert _decode(receiver, list(frames)) is None
    assert receiver.rejected == 2 * len(MSG_TYPES)
