"""jupyter_shard.transfer.peer_memory: copies straight from or into a rank's memory,
after its token is checked.

Here one process plays both sides (it reads and writes its own memory through its pid, as the kernel
does a rank's); ranks doing it are tests/faults/test_transfers.py's."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

from jupyter_shard.transfer import peer_memory
from jupyter_shard.transfer.peer_memory import PIECE, Lent, PeerMemoryError, Target

pytestmark = pytest.mark.skipif(not peer_memory.supported(), reason="process_vm_readv is Linux-only")


def target_of(lent: Lent, pid: int | None = None, token: str | None = None) -> Target:
    return Target(pid or os.getpid(), lent.addresses, token or lent.token.hex(), lent.token_address)


def arrays() -> list[np.ndarray]:
    """Buffers of awkward sizes: one cut into several pieces (so several threads copy it), one not
    a multiple of the alignment, an empty one and a one-byte one."""
    rng = np.random.default_rng(7)
    return [
        rng.integers(0, 255, size=PIECE * 2 + 12345, dtype=np.uint8),
        rng.standard_normal(1001).astype(np.float32),
        np.empty(0, dtype=np.float64),
        np.array([42], dtype=np.uint8),
    ]


def views(values: list[np.ndarray]) -> list[memoryview]:
    return [memoryview(a.data).cast("B") for a in values]


def test_a_push_lands_exactly_in_fresh_memory_and_each_landing_is_its_own() -> None:
    sources = arrays()
    sizes = [a.nbytes for a in sources]
    first, second = peer_memory.landing(sizes), peer_memory.landing(sizes)
    assert peer_memory.write([target_of(first), target_of(second)], views(sources)) == {}
    for got in (first, second):
        assert [b.nbytes for b in got.buffers] == sizes
        for buffer, source in zip(got.buffers, sources, strict=True):
            assert bytes(buffer) == source.tobytes()
    first.buffers[0][0] ^= 0xFF  # a landing is private: neither the source nor the other sees it
    assert second.buffers[0][0] == sources[0][0] and first.buffers[0][0] != sources[0][0]
    assert all(a % 64 == 0 for a, n in zip(first.addresses, sizes, strict=True) if n)


def test_a_pull_reads_into_fresh_memory_of_its_own() -> None:
    sources = arrays()
    lent = Lent(views(sources))
    got = peer_memory.read(target_of(lent), [a.nbytes for a in sources])
    for buffer, source in zip(got, sources, strict=True):
        assert bytes(buffer) == source.tobytes()
    got[1][0] ^= 0xFF
    assert bytes(got[1]) != sources[1].tobytes(), "the copy is writable, and not the source"


def test_a_wrong_token_or_reply_is_refused_before_any_byte_moves() -> None:
    sources = arrays()
    sizes = [a.nbytes for a in sources]
    landing = peer_memory.landing(sizes)
    forged = target_of(landing, token="00" * peer_memory.TOKEN_BYTES)
    assert peer_memory.write([forged], views(sources)) == {
        os.getpid(): "the process with the rank's pid is not the rank that replied"
    }
    assert not any(landing.buffers[0]), "bytes were written past a token that did not match"
    short = Target(os.getpid(), landing.addresses[:2], landing.token.hex(), landing.token_address)
    assert "do not match" in peer_memory.write([short], views(sources))[os.getpid()]
    lent = Lent(views(sources))
    with pytest.raises(PeerMemoryError, match="not the rank that replied"):
        peer_memory.read(target_of(lent, token="ff" * peer_memory.TOKEN_BYTES), sizes)
    with pytest.raises(PeerMemoryError, match="addresses and sizes do not match"):
        peer_memory.read(target_of(lent), sizes[:1])


def test_a_rank_that_is_gone_fails_alone_and_the_others_are_written() -> None:
    child = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    child.start()
    child.join()
    assert child.pid is not None
    sources = arrays()
    sizes = [a.nbytes for a in sources]
    alive, gone = peer_memory.landing(sizes), peer_memory.landing(sizes)
    failed = peer_memory.write([target_of(gone, pid=child.pid), target_of(alive)], views(sources))
    assert list(failed) == [child.pid] and "No such process" in failed[child.pid]
    assert bytes(alive.buffers[0]) == sources[0].tobytes()
    with pytest.raises(PeerMemoryError, match="No such process"):
        peer_memory.read(target_of(Lent(views(sources)), pid=child.pid), sizes)
