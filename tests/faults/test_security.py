"""Security: loopback-only listeners, a private socket directory, the key kept off command lines,
and frames without the key rejected without running anything."""

from __future__ import annotations

import ipaddress
import stat
import time
from collections.abc import Iterator

import psutil
import pytest
import zmq

from jupyter_shard import Pool
from jupyter_shard.protocol import Wire, new_key

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with Pool(nproc=2, device="cpu", log_dir=tmp_path_factory.mktemp("logs")) as p:
        p.run("import torch, torch.distributed as dist; dist.all_reduce(torch.ones(1))")
        yield p


def _rank_pids(pool: Pool) -> list[int]:
    return [s.pid for s in pool.status()]


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


def test_private_directory_and_ipc_socket(pool: Pool) -> None:
    directory = pool._dir
    assert directory is not None
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert (directory / "pool.sock").exists()


def test_key_not_on_command_line_nor_inherited_by_rank_children(pool: Pool) -> None:
    for pid in _rank_pids(pool):
        assert not any("JUPYTER_SHARD_KEY" in a for a in psutil.Process(pid).cmdline())
    run = pool.run("import subprocess\nsubprocess.run(['env'], capture_output=True, text=True).stdout")
    value = run.value
    assert value is not None
    assert "JUPYTER_SHARD_KEY" not in value["text/plain"]


def test_frames_without_the_key_are_rejected_and_pool_keeps_working(pool: Pool) -> None:
    assert pool._dir is not None
    dropped = pool.dropped
    ctx = zmq.Context.instance()
    socks = []
    try:
        for identity in (b"rank-9", b"intruder", None):
            sock = ctx.socket(zmq.DEALER)
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{pool._dir / 'pool.sock'}")
            socks.append(sock)
            sock.send_multipart(Wire(new_key(), "rank-0").encode("done", {"cell_id": "x", "status": "ok"}))
            sock.send_multipart([b"garbage"])
            sock.send_multipart([b"jsh1", b"sig", b"{}", b"{}", b"\x80" * 10])
        time.sleep(0.3)
        result = pool.run("1 + 1")
        assert result.value == {"text/plain": "2"}
        assert pool.dropped - dropped == 9
    finally:
        for sock in socks:
            sock.close()
