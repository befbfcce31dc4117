"""jupyter_shard.rank.transfer: a rank's end of push and pull, in one process.

The kernel's side is played here with the same modules it uses (``pickling``, ``segments``): a
segment this process creates is reachable through ``/proc/<pid>/fd`` as the kernel's is, and lent
memory is read with ``ctypes`` at the addresses the reply names, as ``process_vm_readv`` would.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from jupyter_shard.rank import transfer
from jupyter_shard.rank.transfer import (
    chunk_reply,
    landing_reply,
    pulled_reply,
    pushed_values,
    release,
    resent_reply,
)
from jupyter_shard.transfer import peer_memory, pickling, segments
from jupyter_shard.wire.messages import check_body
from jupyter_shard.wire.protocol import Message

pytestmark = pytest.mark.skipif(not segments.supported(), reason="sealed memfds are Linux-only")

BIG = 1 << 62


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    release()
    monkeypatch.setattr(transfer, "_incoming", None)
    yield
    release()


def _push(body: dict[str, Any], buffers: list[Any] | None = None) -> Message:
    return Message("push", {"req_id": "r1", **body}, buffers=list(buffers or []))


def _pull(**body: Any) -> Message:
    return Message("pull", {"req_id": "r2", "name": "x", **body})


def _packed(**values: Any) -> tuple[list[str], list[int], list[bytes], list[memoryview]]:
    names, counts, inbands, oob = [], [], [], []
    for name, value in values.items():
        packed = pickling.dumps(value)
        names.append(name)
        counts.append(len(packed.buffers))
        inbands.append(packed.inband)
        oob.extend(packed.buffers)
    return names, counts, inbands, oob


def _read(address: int, size: int) -> bytes:
    return ctypes.string_at(address, size)


# push


def test_an_inline_push_gives_each_name_its_value_over_writable_buffers() -> None:
    array = np.arange(6, dtype=np.float32)
    names, counts, inbands, oob = _packed(a=array, b={"k": [1, 2]}, c=np.ones(3))
    assert counts == [1, 0, 1]
    values = pushed_values(_push({"names": names, "counts": counts}, [*inbands, *(bytes(b) for b in oob)]))
    assert set(values) == {"a", "b", "c"}
    assert np.array_equal(values["a"], array) and values["b"] == {"k": [1, 2]}
    assert np.array_equal(values["c"], np.ones(3))
    values["a"][0] = 42.0  # writable, as the sender's array was
    assert values["a"][0] == 42.0


@pytest.mark.parametrize(
    ("names", "counts", "n_buffers", "error"),
    [
        (["a", "b"], [0], 2, "names, counts and buffers do not match"),
        (["a"], [-1], 1, "names, counts and buffers do not match"),
        (["a", "b"], [0, 0], 1, "names, counts and buffers do not match"),
        (["a"], [2], 2, "2 buffers announced, 1 came"),
        (["a"], [0], 2, "0 buffers announced, 1 came"),
    ],
)
def test_a_malformed_push_is_refused(names: list[str], counts: list[int], n_buffers: int, error: str) -> None:
    inband = pickling.dumps(1).inband
    with pytest.raises(ValueError, match=error):
        pushed_values(_push({"names": names, "counts": counts}, [inband] * n_buffers))


def test_a_push_in_parts_is_assembled_and_built_at_its_final_message() -> None:
    array = np.arange(1000, dtype=np.int64)
    names, counts, inbands, oob = _packed(x=array)
    data = b"".join(bytes(b) for b in oob)
    sizes = [b.nbytes for b in oob]
    head = {"names": names, "counts": counts, "stream": "s1", "sizes": sizes}
    assert pushed_values(_push({**head, "offset": 0}, [data[:3000]])) == {}
    assert pushed_values(_push({**head, "offset": 3000}, [data[3000:5000], data[5000:]])) == {}
    values = pushed_values(_push({**head, "final": True}, inbands))
    assert np.array_equal(values["x"], array)


def test_a_push_in_parts_that_ends_early_or_out_of_order_is_refused() -> None:
    names, counts, inbands, oob = _packed(x=np.arange(10))
    data = b"".join(bytes(b) for b in oob)
    head = {"names": names, "counts": counts, "stream": "s1", "sizes": [len(data)]}
    pushed_values(_push({**head, "offset": 0}, [data[:8]]))
    with pytest.raises(ValueError, match="came where byte 8 was expected"):
        pushed_values(_push({**head, "offset": 16}, [data[16:]]))
    with pytest.raises(ValueError, match="ended before all its parts came"):
        pushed_values(_push({**head, "final": True}, inbands))
    # the unfinished push was dropped: its later parts start a new one, which they cannot
    with pytest.raises(ValueError, match="came where byte 0 was expected"):
        pushed_values(_push({**head, "offset": 8}, [data[8:]]))


def test_the_final_part_of_another_stream_is_refused() -> None:
    names, counts, inbands, oob = _packed(x=np.arange(4))
    data = b"".join(bytes(b) for b in oob)
    head = {"names": names, "counts": counts, "sizes": [len(data)]}
    pushed_values(_push({**head, "stream": "s1", "offset": 0}, [data]))
    with pytest.raises(ValueError, match="ended before all its parts came"):
        pushed_values(_push({**head, "stream": "s2", "final": True}, inbands))


def test_a_new_stream_starts_over() -> None:
    names, counts, inbands, oob = _packed(x=np.arange(4))
    data = b"".join(bytes(b) for b in oob)
    head = {"names": names, "counts": counts, "sizes": [len(data)]}
    pushed_values(_push({**head, "stream": "old", "offset": 0}, [data[:5]]))
    pushed_values(_push({**head, "stream": "new", "offset": 0}, [data]))
    values = pushed_values(_push({**head, "stream": "new", "final": True}, inbands))
    assert np.array_equal(values["x"], np.arange(4))


def test_a_push_too_big_for_free_memory_is_refused_before_anything_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**30))
    head = {"names": ["x"], "counts": [1], "stream": "s", "sizes": [3 * 2**30]}
    with pytest.raises(MemoryError, match=r"needs 3\.0 GiB and this machine has 1\.0 GiB free"):
        pushed_values(_push({**head, "offset": 0}, [b"x"]))
    reply = landing_reply(_push({"land": True, "names": ["x"], "counts": [1], "sizes": [3 * 2**30]}))
    assert reply["ok"] is False and reply["error"].startswith("MemoryError: the value needs 3.0 GiB")
    assert "addresses" not in reply


def test_a_landed_push_is_built_over_the_memory_the_rank_offered() -> None:
    array = np.arange(512, dtype=np.float64)
    names, counts, inbands, oob = _packed(x=array, y=np.ones(7, dtype=np.uint8))
    sizes = [b.nbytes for b in oob]
    reply = landing_reply(_push({"land": True, "names": names, "counts": counts, "sizes": sizes}))
    assert check_body("push_reply", reply) == []
    assert reply["ok"] and reply["req_id"] == "r1" and len(reply["addresses"]) == 2
    assert _read(reply["token_address"], peer_memory.TOKEN_BYTES) == bytes.fromhex(reply["token"])
    for address, buffer in zip(reply["addresses"], oob, strict=True):  # the kernel writes the push
        ctypes.memmove(address, bytes(buffer), buffer.nbytes)
    values = pushed_values(_push({"names": names, "counts": counts, "landed": True, "sizes": sizes}, inbands))
    assert np.array_equal(values["x"], array) and np.array_equal(values["y"], np.ones(7, dtype=np.uint8))
    assert values["x"].ctypes.data == reply["addresses"][0], "built over the landing, not a copy"


def test_a_landed_push_must_name_memory_offered_for_it() -> None:
    names, counts, inbands, oob = _packed(x=np.arange(8))
    sizes = [b.nbytes for b in oob]
    landed = {"names": names, "counts": counts, "landed": True, "sizes": sizes}
    with pytest.raises(ValueError, match="names memory this rank did not offer"):
        pushed_values(_push(landed, inbands))  # nothing was offered
    landing_reply(_push({"land": True, "names": names, "counts": counts, "sizes": [sizes[0] + 8]}))
    with pytest.raises(ValueError, match="names memory this rank did not offer"):
        pushed_values(_push(landed, inbands))  # offered for other sizes
    landing_reply(_push({"land": True, "names": names, "counts": counts, "sizes": sizes}))
    release()
    with pytest.raises(ValueError, match="names memory this rank did not offer"):
        pushed_values(_push(landed, inbands))  # the kernel let it go


def test_a_landing_is_used_once() -> None:
    names, counts, inbands, oob = _packed(x=np.zeros(4))
    sizes = [b.nbytes for b in oob]
    landing_reply(_push({"land": True, "names": names, "counts": counts, "sizes": sizes}))
    landed = {"names": names, "counts": counts, "landed": True, "sizes": sizes}
    pushed_values(_push(landed, inbands))
    with pytest.raises(ValueError, match="did not offer"):
        pushed_values(_push(landed, inbands))


def test_a_landing_with_a_negative_size_is_refused() -> None:
    reply = landing_reply(_push({"land": True, "names": ["x"], "counts": [1], "sizes": [8, -1]}))
    assert reply == {
        "req_id": "r1",
        "ok": False,
        "error": "ValueError: malformed push: a buffer size below zero",
    }


def test_without_peer_memory_a_landing_reply_names_no_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_memory, "supported", lambda: False)
    reply = landing_reply(_push({"land": True, "names": ["x"], "counts": [1], "sizes": [8]}))
    assert reply == {"req_id": "r1", "ok": True, "error": ""}


def test_a_push_through_the_kernels_segment() -> None:
    array = np.arange(3000, dtype=np.int32)
    names, counts, inbands, oob = _packed(x=array)
    with segments.Segment() as seg:
        seg.fill(oob)
        body = {"names": names, "counts": counts, "segment": seg.ref, "sizes": [b.nbytes for b in oob]}
        values = pushed_values(_push(body, inbands))
    assert np.array_equal(values["x"], array)


def test_a_push_naming_an_unsealed_segment_is_refused() -> None:
    names, counts, inbands, oob = _packed(x=np.arange(10))
    with segments.Segment() as seg:
        segments.write_into(seg.fd, oob)  # written but not sealed: it could still change
        body = {"names": names, "counts": counts, "segment": seg.ref, "sizes": [b.nbytes for b in oob]}
        with pytest.raises(segments.SegmentError, match="not sealed"):
            pushed_values(_push(body, inbands))


# pull


def _unpack(reply: Any, buffers: list[Any]) -> Any:
    return pickling.loads(bytes(buffers[0]), [bytearray(b) for b in buffers[1:]])


def test_a_small_pull_is_sent_in_the_message() -> None:
    value = {"w": np.arange(5.0), "n": 3}
    reply, buffers = pulled_reply(_pull(), 0, "'x'", value, BIG)
    assert check_body("pull_reply", reply) == []
    assert reply["ok"] and reply["req_id"] == "r2" and reply["error"] == ""
    assert reply["sizes"] == [40] and len(buffers) == 2
    out = _unpack(reply, buffers)
    assert np.array_equal(out["w"], value["w"]) and out["n"] == 3


def test_a_value_that_cannot_be_pickled_is_refused_with_why() -> None:
    import threading

    reply, buffers = pulled_reply(_pull(), 0, "'x'", threading.Lock(), BIG)
    assert not reply["ok"] and buffers == []
    assert reply["error"].startswith("'x' could not be pickled: TypeError: ")


def test_a_module_that_cannot_be_pickled_is_refused_with_what_to_pull_instead() -> None:
    import threading

    import torch

    model = torch.nn.Linear(2, 2)
    model.group = threading.Lock()  # as a wrapper holds its process group
    reply, buffers = pulled_reply(_pull(), 0, "'model'", model, BIG)
    assert not reply["ok"] and buffers == []
    assert reply["error"].startswith("'model' could not be pickled: TypeError: ")
    assert "`%dist_pull NAME --gather`" in reply["error"] and "state_dict()" in reply["error"]
    plain, _ = pulled_reply(_pull(), 0, "'x'", threading.Lock(), BIG)
    assert "--gather" not in plain["error"]  # the hint is for modules only


def test_a_value_over_the_limit_is_refused() -> None:
    reply, buffers = pulled_reply(_pull(), 0, "'x'", np.zeros(3 * 2**20, dtype=np.uint8), 2**20)
    assert not reply["ok"] and buffers == []
    assert reply["error"] == "'x' is 3 MiB pickled, over the 1 MiB limit of this copy"


def test_a_value_with_a_part_over_the_frame_limit_must_go_to_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "MAX_FRAME", 1000)
    reply, buffers = pulled_reply(_pull(), 1, "'x'", np.zeros(2000, dtype=np.uint8), BIG)
    assert not reply["ok"] and buffers == []
    assert "message limit of a rank on another machine; save it to a file instead" in reply["error"]
    reply, buffers = pulled_reply(_pull(), 1, "'x'", np.zeros(100, dtype=np.uint8), BIG)
    assert reply["ok"], "under the limit it goes"


def test_a_large_pull_goes_into_the_segment_offered_to_this_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SEGMENT_OVER", 1024)
    array = np.arange(2048, dtype=np.float32)
    with segments.Segment() as mine, segments.Segment() as other:
        offered = {"0": other.ref, "3": mine.ref}
        reply, buffers = pulled_reply(_pull(segments=offered), 3, "'x'", array, BIG)
        assert check_body("pull_reply", reply) == []
        assert reply["ok"] and reply.get("in_segment") and len(buffers) == 1
        out = pickling.loads(bytes(buffers[0]), mine.seal_and_map(reply["sizes"]))
        assert np.array_equal(out, array)
        assert os.fstat(other.fd).st_size == 0, "not another rank's segment"


def test_a_small_pull_stays_in_the_message_though_a_segment_is_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transfer, "SEGMENT_OVER", 1024)
    with segments.Segment() as seg:
        reply, buffers = pulled_reply(_pull(segments={"0": seg.ref}), 0, "'x'", np.zeros(16), BIG)
    assert reply["ok"] and not reply.get("in_segment") and len(buffers) == 2


def test_an_unreachable_segment_sends_the_value_in_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SEGMENT_OVER", 16)
    gone = {"pid": 2**22 + 12345, "fd": 999, "token": "0" * 32}  # no such process here
    reply, buffers = pulled_reply(_pull(segments={"0": gone}), 0, "'x'", np.arange(64.0), BIG)
    assert reply["ok"] and not reply.get("in_segment")
    assert np.array_equal(_unpack(reply, buffers), np.arange(64.0))


def test_a_segment_refused_for_another_reason_fails_the_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SEGMENT_OVER", 16)
    with segments.Segment() as seg:
        seg.fill([memoryview(b"already here")])  # a segment someone already wrote
        reply, buffers = pulled_reply(_pull(segments={"0": seg.ref}), 0, "'x'", np.arange(64.0), BIG)
    assert not reply["ok"] and buffers == []
    assert reply["error"].startswith("'x' could not be sent: the segment for this pull was already written")


def test_a_direct_pull_lends_the_buffers_at_the_addresses_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SEGMENT_OVER", 16)
    array = np.arange(100, dtype=np.int64)
    with segments.Segment() as seg:
        reply, buffers = pulled_reply(_pull(segments={"0": seg.ref}, direct=True), 0, "'x'", array, BIG)
    assert check_body("pull_reply", reply) == []
    assert reply["ok"] and len(buffers) == 1 and not reply.get("in_segment")
    (address,) = reply["addresses"]
    assert _read(address, 800) == array.tobytes()
    assert _read(reply["token_address"], peer_memory.TOKEN_BYTES) == bytes.fromhex(reply["token"])


def test_a_large_streamed_pull_is_read_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK", 100)
    array = np.arange(60, dtype=np.int64)  # 480 bytes, over one chunk
    reply, buffers = pulled_reply(_pull(stream=True), 0, "'x'", array, BIG)
    assert reply["ok"] and reply.get("streamed") and len(buffers) == 1
    got = b""
    while len(got) < 480:
        length = min(100, 480 - len(got))
        part, pieces = chunk_reply(Message("pull", {"req_id": "c", "chunk": [len(got), length]}))
        assert part["ok"], part["error"]
        got += b"".join(bytes(p) for p in pieces)
    assert got == array.tobytes()
    part, pieces = chunk_reply(Message("pull", {"req_id": "c", "chunk": [0, 401]}))
    assert not part["ok"] and pieces == [] and part["error"] == "a part of 401 bytes is over the 400 allowed"
    part, pieces = chunk_reply(Message("pull", {"req_id": "c", "chunk": [400, 100]}))
    assert not part["ok"] and "outside the 480 of this value" in part["error"]


def test_a_streamed_pull_under_a_chunk_goes_in_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK", 10_000)
    reply, buffers = pulled_reply(_pull(stream=True), 0, "'x'", np.arange(60), BIG)
    assert reply["ok"] and not reply.get("streamed") and len(buffers) == 2


def test_nothing_can_be_read_once_released_or_after_another_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK", 8)
    chunk = Message("pull", {"req_id": "c", "chunk": [0, 8]})
    assert chunk_reply(chunk)[0]["error"] == "nothing is lent for a part to be read from"
    pulled_reply(_pull(stream=True), 0, "'x'", np.arange(60), BIG)
    assert chunk_reply(chunk)[0]["ok"]
    release()
    assert not chunk_reply(chunk)[0]["ok"]
    pulled_reply(_pull(stream=True), 0, "'x'", np.arange(60), BIG)
    pushed_values(_push({"names": [], "counts": []}))  # a push lets the last pull's loan go
    assert not chunk_reply(chunk)[0]["ok"]


def test_lent_buffers_are_resent_into_a_segment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SEGMENT_OVER", 16)
    array = np.arange(300, dtype=np.float64)
    with segments.Segment() as first:
        reply, buffers = pulled_reply(_pull(segments={"2": first.ref}, direct=True), 2, "'x'", array, BIG)
    assert "addresses" in reply
    with segments.Segment() as seg:
        resent = resent_reply(
            Message("pull", {"req_id": "r3", "resend": True, "segments": {"2": seg.ref}}), 2
        )
        assert check_body("pull_reply", resent) == []
        assert resent == {"req_id": "r3", "ok": True, "error": "", "in_segment": True, "sizes": [2400]}
        assert np.array_equal(pickling.loads(bytes(buffers[0]), seg.seal_and_map([2400])), array)
    with segments.Segment() as seg:
        again = resent_reply(Message("pull", {"req_id": "r4", "resend": True, "segments": {"2": seg.ref}}), 2)
    assert again == {
        "req_id": "r4",
        "ok": False,
        "error": "rank 2 has nothing lent to resend, or no segment to write it into",
    }


def test_a_resend_without_a_segment_for_this_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK", 8)
    pulled_reply(_pull(stream=True), 1, "'x'", np.arange(60), BIG)
    with segments.Segment() as seg:
        reply = resent_reply(Message("pull", {"req_id": "r", "segments": {"0": seg.ref}}), 1)
    assert not reply["ok"] and "rank 1 has nothing lent to resend" in reply["error"]
