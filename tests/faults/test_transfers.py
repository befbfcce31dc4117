"""F19 and F15 for pushes and pulls: values arrive exactly, a rank killed or the kernel interrupted in
the middle of a transfer leaves no segment behind and a pool that works, and a forged, truncated or
malformed transfer is refused without anything being built from it.

Transfers to local ranks are copied straight into or out of the rank's memory
(jupyter_shard/transfer/peer_memory.py), or where that fails
through a sealed memfd (jupyter_shard/transfer/segments.py);
with ``JUPYTER_SHARD_SHARED_MEMORY=0`` they travel in the signed messages, the path of ranks on other
machines. A rank is held still with SIGSTOP so that the kernel is surely waiting mid-transfer when it
is killed or interrupted."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from jupyter_shard import Pool
from jupyter_shard.errors import PoolError
from jupyter_shard.transfer import segments
from jupyter_shard.wire.messages import PUSH

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not segments.supported(), reason="sealed memfds are Linux-only"),
]

BIG = 16 << 20  # elements: a 64 MiB float32 tensor


def open_segments() -> list[str]:
    """The kernel's open segments (a leaked one would stay open here)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:jupyter_shard-"):
            found.append(target)
    return found


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with Pool(nproc=2, device="cpu", log_dir=tmp_path_factory.mktemp("logs")) as p:
        p.run("import torch, numpy as np")
        yield p


def sample() -> dict[str, object]:
    base = torch.arange(3000, dtype=torch.float64)
    return {
        "big": torch.randn(BIG),
        "dtypes": [(torch.randn(257, 3) * 50).to(d) for d in (torch.bfloat16, torch.float16, torch.int8)]
        + [torch.tensor([True, False]), torch.randn(4, dtype=torch.complex128)],
        "views": (base.reshape(30, 100).t(), base[::7], torch.empty(0, 4), torch.tensor(1.5)),
        "arrays": {"c": np.arange(1 << 20, dtype=np.int32), "f": np.asfortranarray(np.ones((300, 200)))},
        "param": torch.nn.Parameter(torch.randn(5, 5)),
    }


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# A rank's own check that what it got is what was sent, kept as ``ok`` with a checksum of each part.
ON_RANK = """
import hashlib
def _digest(v):
    if isinstance(v, torch.Tensor):
        raw = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return (str(v.dtype), tuple(v.shape), hashlib.sha256(raw).hexdigest())
    if isinstance(v, np.ndarray):
        return (str(v.dtype), v.shape, hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest())
    if isinstance(v, dict):
        return {k: _digest(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_digest(x) for x in v]
    return repr(v)
digest = _digest(value)
"""


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "messages"])
def test_values_round_trip_exactly_and_each_rank_owns_its_copy(
    pool: Pool, shared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUPYTER_SHARD_SHARED_MEMORY", "1" if shared else "0")
    value = sample()
    pool.push(value=value)
    assert pool.last_transfer is not None and pool.last_transfer.path == ("direct" if shared else "messages")
    pool.run(ON_RANK)
    digests = pool.pull_all("digest")
    assert digests[0] == digests[1]
    back = pool.pull("value", rank=1)
    assert pool.last_transfer is not None and pool.last_transfer.shared is shared
    assert same(value, back), "the value came back changed"

    pool.run("value['big'][0] = -12345.0; value['arrays']['c'][0] = -1", ranks=[0])
    pool.run("probe = (float(value['big'][0]), int(value['arrays']['c'][0]))")
    probes = pool.pull_all("probe")
    assert probes[0] == (-12345.0, -1)
    assert probes[1] == (float(value["big"][0]), 0), "one rank's change reached another"  # type: ignore[index]
    assert float(value["big"][0]) != -12345.0  # type: ignore[index]
    back[  # a pulled value is the kernel's own too
        "big"
    ][1] = 7.0
    assert float(pool.pull("value", rank=1)["big"][1]) != 7.0
    assert open_segments() == []


def test_a_pull_read_from_the_rank_falls_back_to_a_segment_and_the_rank_lets_go(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull from a local rank reads the rank's memory; where that fails (here: the read is made to
    fail as a pid of another process or namespace fails it), the rank writes into the segment."""
    from jupyter_shard.transfer import peer_memory

    pool.run(f"import torch; lent = torch.randn({BIG})", ranks=[1])
    lent = pool.pull("lent", rank=1)
    assert pool.last_transfer is not None and pool.last_transfer.path == "direct"
    held = "from jupyter_shard.rank import transfer; transfer._lent is None"
    assert pool.run(held, ranks=[1]).value == {"text/plain": "True"}, "the rank still holds the buffers"

    def refused(*args: object) -> None:
        raise peer_memory.PeerMemoryError("the process with the rank's pid is not the rank that replied")

    monkeypatch.setattr(peer_memory, "read", refused)
    again = pool.pull("lent", rank=1)
    assert pool.last_transfer is not None and pool.last_transfer.path == "segment"
    assert torch.equal(again, lent)
    assert pool.run(held, ranks=[1]).value == {"text/plain": "True"}
    assert open_segments() == []


def test_a_push_that_cannot_be_written_into_a_rank_goes_through_a_segment(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel may not write a rank's memory (another pid namespace, a pid reused: here the
    write is made to fail for rank 1 as those fail it), that rank gets the value through a segment."""
    from jupyter_shard.transfer import peer_memory

    real = peer_memory.write
    pid = next(s.pid for s in pool.status() if s.rank == 1)

    def refused_for_rank_1(targets: list[peer_memory.Target], sources: list[memoryview]) -> dict[int, str]:
        failed = real([t for t in targets if t.pid != pid], sources)
        return {**failed, pid: "the process with the rank's pid is not the rank that replied"}

    monkeypatch.setattr(peer_memory, "write", refused_for_rank_1)
    value = sample()
    pool.push(fallback=value)
    assert pool.last_transfer is not None and pool.last_transfer.path == "direct+segment"
    assert same(pool.pull("fallback", rank=0), value) and same(pool.pull("fallback", rank=1), value)
    held = "from jupyter_shard.rank import transfer; transfer._landing is None"
    assert all(r.result == {"text/plain": "True"} for r in pool.run(held).ranks.values())
    assert open_segments() == []


def test_a_push_with_room_for_one_copy_but_not_one_per_rank_shares_a_segment(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    class Room(NamedTuple):
        available: int

    value = torch.randn(BIG // 2)  # 32 MiB: room for one copy, not for two in 3/4 of what is free
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Room(80 << 20))
    pool.push(roomy=value)
    assert pool.last_transfer is not None and pool.last_transfer.path == "segment"
    monkeypatch.undo()
    pool.run("roomy[0] = -1.0", ranks=[0])
    assert torch.equal(pool.pull("roomy", rank=1), value), "one rank's change reached another"
    assert float(pool.pull("roomy", rank=0)[0]) == -1.0
    assert open_segments() == []


def test_an_interrupt_while_the_kernel_writes_lets_the_ranks_drop_their_landing(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jupyter_shard.transfer import peer_memory

    def interrupted(targets: list[peer_memory.Target], sources: list[memoryview]) -> dict[int, str]:
        raise KeyboardInterrupt

    value = torch.randn(BIG)
    monkeypatch.setattr(peer_memory, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.push(dropped=value)
    monkeypatch.undo()
    held = "from jupyter_shard.rank import transfer; (transfer._landing is None, 'dropped' in dir())"
    assert all(r.result == {"text/plain": "(True, False)"} for r in pool.run(held).ranks.values())
    pool.push(kept=value)
    assert torch.equal(pool.pull("kept", rank=1), value)


def test_forged_truncated_and_malformed_pushes_are_refused_and_the_pool_works(pool: Pool) -> None:
    """Each push here is signed with the pool's key (it comes from the kernel's own wire), so only
    the checks of the transfer itself stand between it and the rank's namespace."""
    data = np.arange(1 << 18, dtype=np.float64)
    packed_ok = pool.connection  # the connection the kernel's pushes use
    targets = pool.ranks.targets(None)

    def push(body: dict[str, object], frames: list[bytes]) -> dict[int, str]:
        replies = packed_ok.request(*PUSH(body), targets, buffers=frames, timeout=30)  # type: ignore[arg-type]
        assert set(replies) == {0, 1}
        return {k: str(m.body["error"]) for k, m in replies.items() if not m.body["ok"]}

    from jupyter_shard.transfer import pickling

    packed = pickling.dumps(data)
    view = packed.buffers[0]
    pool.run("forged = 'untouched'")
    with segments.Segment() as unsealed:  # written, never sealed: it could still change
        segments.write_into(unsealed.fd, [view])
        body = {"names": ["forged"], "counts": [1], "segment": unsealed.ref, "sizes": [view.nbytes]}
        assert all("not sealed" in e for e in push(body, [packed.inband]).values())
    with segments.Segment() as segment:
        segment.fill([view])
        truncated = {"names": ["forged"], "counts": [1], "segment": segment.ref, "sizes": [view.nbytes * 2]}
        assert all("truncated" in e for e in push(truncated, [packed.inband]).values())
        other = {**segment.ref, "token": "f" * 32}
        forged = {"names": ["forged"], "counts": [1], "segment": other, "sizes": [view.nbytes]}
        assert all(segments.UNAVAILABLE in e for e in push(forged, [packed.inband]).values())
    malformed = {"names": ["forged", "extra"], "counts": [1], "sizes": []}
    assert all("malformed" in e for e in push(malformed, [packed.inband]).values())
    short = {"names": ["forged"], "counts": [1]}  # the inline path: a buffer shorter than the tensor
    assert all(push(short, [packed.inband, bytes(view[:100])]).values())
    parts = {"names": ["forged"], "counts": [1], "sizes": [view.nbytes], "stream": "s1"}
    assert push({**parts, "offset": 0}, [bytes(view[:4096])]) == {}  # the first part of two
    assert all("expected" in e for e in push({**parts, "offset": 8192}, [bytes(view[8192:])]).values())
    assert all("before all its parts" in e for e in push({**parts, "final": True}, [packed.inband]).values())
    assert pool.pull_all("forged") == {0: "untouched", 1: "untouched"}, "nothing refused was kept"
    pool.push(again=data)
    assert np.array_equal(pool.pull("again", rank=1), data)


def test_a_value_the_machine_has_no_room_for_is_refused_in_one_line(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    class Full(NamedTuple):
        available: int

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Full(1 << 20))
    with pytest.raises(
        PoolError, match=r"needs 32\.0 MiB of shared memory and 1\.0 MiB is free; push smaller"
    ):
        pool.push(huge=torch.zeros(BIG // 2))
    pool.run(f"import torch; huge = torch.ones({BIG // 2})", ranks=[0])
    with pytest.raises(PoolError, match=r"the value is 32\.0 MiB and the kernel's machine has 1\.0 MiB free"):
        pool.pull("huge", rank=0)
    monkeypatch.undo()
    assert float(pool.pull("huge", rank=0).sum()) == BIG // 2, "the pool works on"
    assert open_segments() == []


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def test_kernel_interrupt_mid_push_leaves_no_segment_and_the_pool_usable(pool: Pool) -> None:
    value = torch.randn(BIG)
    pid = next(s.pid for s in pool.status() if s.rank == 1)
    before = shm()
    _stop(pid)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.push(interrupted=value)
    finally:
        timer.cancel()
        os.kill(pid, signal.SIGCONT)
    assert open_segments() == [], "the segment outlived the interrupted push"
    assert shm() == before
    pool.push(after=value)
    assert torch.equal(pool.pull("after", rank=1), value)
    assert open_segments() == []


@pytest.mark.parametrize("what", ["push", "pull"])
def test_rank_killed_mid_transfer_leaves_no_segment_and_restart_recovers(tmp_path: Path, what: str) -> None:
    value = torch.randn(BIG)
    before = shm()
    with Pool(nproc=2, device="cpu", log_dir=tmp_path) as pool:
        pool.run(f"import torch; y = torch.randn({BIG})")
        victim = next(s.pid for s in pool.status() if s.rank == 0)
        _stop(victim)
        killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        try:
            with pytest.raises(PoolError, match="rank 0"):
                pool.push(x=value) if what == "push" else pool.pull("y", rank=0)
        finally:
            killer.join()
        assert time.monotonic() - started < 10
        assert open_segments() == [], f"the segment outlived the {what}"
        assert shm() == before
        pool.restart()
        pool.push(x=value)
        assert torch.equal(pool.pull("x", rank=0), value)
    assert open_segments() == []
