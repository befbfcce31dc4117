"""jupyter_shard.transfer.segments: sealed memfds named in signed messages,
opened and checked by the receiver.

Here one process plays both sides (the segment is opened through ``/proc/<own pid>/fd``, as a rank
opens the kernel's); a rank process doing it is tests/faults/test_transfers.py's."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

from jupyter_shard.transfer import segments
from jupyter_shard.transfer.segments import UNAVAILABLE, Segment, SegmentError

pytestmark = pytest.mark.skipif(not segments.supported(), reason="sealed memfds are Linux-only")


def memfds() -> list[str]:
    """This process's open segments."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:jupyter_shard-"):
            found.append(target)
    return found


def mapped() -> int:
    """How many regions of segments this process has mapped."""
    return Path("/proc/self/maps").read_text().count("/memfd:jupyter_shard-")


def views(*arrays: np.ndarray) -> list[memoryview]:
    return [memoryview(a.data).cast("B") for a in arrays]


def test_a_filled_segment_is_mapped_private_and_writes_stay_with_the_writer() -> None:
    big, small, empty = np.arange(1 << 19, dtype=np.float32), np.arange(10, dtype=np.int16), np.empty(0)
    with Segment() as segment:
        segment.fill(views(big, small, empty))
        sizes = [big.nbytes, small.nbytes, 0]
        with segments.opened(segment.ref) as fd:
            first = segments.map_buffers(fd, sizes)
        with segments.opened(segment.ref) as fd:
            second = segments.map_buffers(fd, sizes)
    assert memfds() == [], "closed with the transfer; what is mapped outlives it"
    a, b = np.frombuffer(first[0], dtype=np.float32), np.frombuffer(second[0], dtype=np.float32)
    np.testing.assert_array_equal(a, big)
    np.testing.assert_array_equal(np.frombuffer(first[1], dtype=np.int16), small)
    assert len(first[2]) == 0
    a[7] = -1.0  # copy-on-write: neither the other mapping nor the source sees it
    assert b[7] == 7.0 and big[7] == 7.0
    assert mapped() == 2
    del a, b, first, second
    gc.collect()
    assert mapped() == 0, "unmapped with the last value over it"


def test_a_segment_is_refused_unless_sealed_and_exactly_the_signed_size() -> None:
    data = np.ones(1 << 18, dtype=np.uint8)
    with Segment() as unsealed:
        segments.write_into(unsealed.fd, views(data))  # written but not sealed: could still change
        with pytest.raises(SegmentError, match="not sealed"), segments.opened(unsealed.ref):
            pass
    with Segment() as segment:
        segment.fill(views(data))
        with segments.opened(segment.ref) as fd:
            with pytest.raises(SegmentError, match="truncated"):
                segments.map_buffers(fd, [data.nbytes, 1 << 20])  # signed sizes need more than it holds
            with pytest.raises(SegmentError, match="truncated"):
                segments.map_buffers(fd, [data.nbytes // 2])


def test_a_descriptor_with_another_token_or_naming_another_file_is_refused(tmp_path: Path) -> None:
    with Segment() as segment:
        assert os.fstat(segment.fd).st_mode & 0o777 == 0o600
        segment.fill(views(np.ones(10)))
        os.fchmod(segment.fd, 0o644)
        with pytest.raises(SegmentError, match="0600"), segments.opened(segment.ref):
            pass
        os.fchmod(segment.fd, 0o600)
        forged = {**segment.ref, "token": "0" * 32}
        with pytest.raises(SegmentError, match=UNAVAILABLE), segments.opened(forged):  # type: ignore[arg-type]
            pass
    plain = tmp_path / "not-a-segment"
    plain.write_bytes(b"x" * 100)
    fd = os.open(plain, os.O_RDONLY)
    try:
        ref = {"pid": os.getpid(), "fd": fd, "token": "0" * 32}
        with pytest.raises(SegmentError, match="another file"), segments.opened(ref):  # type: ignore[arg-type]
            pass
    finally:
        os.close(fd)
    with (
        pytest.raises(SegmentError, match=UNAVAILABLE),
        segments.opened({"pid": 2**22 + 1, "fd": 3, "token": "0" * 32}),
    ):  # no such process
        pass


def test_a_pull_writes_once_into_an_empty_segment_and_the_owner_seals_it() -> None:
    data = np.arange(1 << 18, dtype=np.int64)
    with Segment() as segment:
        with segments.opened(segment.ref, writable=True) as fd:
            segments.write_into(fd, views(data))
        with (
            pytest.raises(SegmentError, match="already written"),
            segments.opened(segment.ref, writable=True),
        ):
            pass
        mapped = segment.seal_and_map([data.nbytes])
        with pytest.raises(OSError):  # sealed: nobody writes to it any more
            os.pwrite(segment.fd, b"x", 0)
    np.testing.assert_array_equal(np.frombuffer(mapped[0], dtype=np.int64), data)


def test_layout_puts_every_buffer_on_a_page_of_its_own() -> None:
    offsets, total = segments.layout([1, 0, segments.PAGE, 3])
    page = segments.PAGE
    assert offsets == [0, page, page, 2 * page] and total == 3 * page
    with pytest.raises(SegmentError):
        segments.layout([-1])
