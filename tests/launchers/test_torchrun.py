"""Two torchrun agents on this machine as node 0 and node 1: ranks dial back over TCP with CurveZMQ.

Each node runs one ``torch.distributed.run`` agent (static rendezvous, node 0's store on loopback alone)
started by the pool; the ranks build their process group on the agents' store, connect to the kernel at ``tcp://127.0.0.1:port``
through an encrypted channel that admits only the pool's client key, and keep their state between
cells. A node whose agent is killed mid-cell is reported as that node failing, with its host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import zmq

from jupyter_shard import DistributedError, Pool
from jupyter_shard.launchers import resolve_spec
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.spec import LaunchSpec
from jupyter_shard.wire.curve import CurveKeys, secure_client
from jupyter_shard.wire.protocol import Wire, rank_identity
from tests.launchers._listeners import LISTENERS

pytestmark = pytest.mark.timeout(180)


def _spec(**extra: object) -> LaunchSpec:
    return resolve_spec(
        nproc=1, device="cpu", strategy="ddp", launcher="torchrun", hosts="localhost,localhost", **extra
    )


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    logs = tmp_path_factory.mktemp("logs")
    with Pool(spec=_spec(), log_dir=logs, sink=ConsoleSink()) as p:
        yield p


def test_ranks_on_two_agents_all_reduce_and_keep_state(pool: Pool) -> None:
    assert pool.address.startswith("tcp://127.0.0.1:"), pool.address
    result = pool.run(
        "import os, torch, torch.distributed as dist\n"
        "t = torch.full((1,), float(dist.get_rank() + 1))\n"
        "dist.all_reduce(t)\n"
        "env = os.environ\n"
        "print(env['RANK'], env['JUPYTER_SHARD_NODE'], env['TORCHELASTIC_RUN_ID'], t.item())"
    )
    lines = {k: r.stdout.split() for k, r in result.ranks.items()}
    assert {k: (v[0], v[3]) for k, v in lines.items()} == {0: ("0", "3.0"), 1: ("1", "3.0")}
    assert [lines[k][1] for k in (0, 1)] == ["0", "1"]  # each node was told its index: rank 0 on node 0
    assert {k: str(pool.ranks[k].node) for k in lines} == {k: v[1] for k, v in lines.items()}
    assert lines[0][2] == lines[1][2] and lines[0][2].startswith("jupyter_shard-")  # one rendezvous
    # the agents are the pool's children; the ranks are theirs, not the kernel's
    agents = {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.cmdline()[1:3] == ["-m", "jupyter_shard.launchers.node_agent"]
    }
    assert len(agents) == 2
    rank_pids = {s.pid for s in pool.status()}
    assert all(psutil.Process(pid).ppid() in agents for pid in rank_pids)
    assert pool.run("t.item() + 1").ranks[1].result == {"text/plain": "4.0"}  # state kept
    # node 0's rendezvous store (on MASTER_PORT) listens on loopback alone, not on every interface
    listening = pool.run(LISTENERS, ranks=[0]).ranks[0].stdout.split()
    assert listening == ["LISTENING", "0100007F"], listening


def test_a_script_and_lightning_see_two_nodes(pool: Pool) -> None:
    # A script's own init/destroy on ranks whose group lives on the agents' store: run twice.
    script = (
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "s = torch.ones(1)\n"
        "dist.all_reduce(s)\n"
        "dist.destroy_process_group()\n"
        "print('sum', int(s.item()), os.environ['GROUP_WORLD_SIZE'])"
    )
    for _ in range(2):
        result = pool.run("import os\n" + script)
        assert [r.stdout.strip() for r in result.ranks.values()] == ["sum 2 2", "sum 2 2"]
    fit = (
        "import lightning as L\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "class Net(L.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Linear(4, 1)\n"
        "    def training_step(self, batch, i):\n"
        "        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "data = TensorDataset(torch.randn(32, 4, generator=g), torch.zeros(32, 1))\n"
        "trainer = L.Trainer(accelerator='cpu', devices='auto', num_nodes={nodes}, max_epochs=1,\n"
        "    logger=False, enable_progress_bar=False, enable_model_summary=False,\n"
        "    enable_checkpointing=False)\n"
        "trainer.fit(Net(), DataLoader(data, batch_size=4))\n"
        "print(trainer.world_size, trainer.num_nodes, trainer.num_devices, trainer.global_step,\n"
        "      trainer.node_rank)"
    )
    result = pool.run(fit.format(nodes=2))
    outputs = sorted(r.stdout.strip().splitlines()[-1] for r in result.ranks.values())
    assert outputs == ["2 2 1 4 0", "2 2 1 4 1"], outputs
    with pytest.raises(DistributedError) as failed:
        pool.run(fit.format(nodes=3))
    expected = "but this pool has 2 ranks (1 on each of 2 nodes): pass devices=1, num_nodes=2"
    assert expected in str(failed.value)


def test_status_names_each_ranks_host_and_the_world(pool: Pool) -> None:
    rows = pool.status()
    assert [r.rank for r in rows] == [0, 1]
    assert all(r.host == socket.gethostname() and r.pid > 0 for r in rows)
    assert pool.world_size == 2
    assert "2 nodes × 1 CPU rank (torchrun)" in pool.spec.describe()


def test_interrupt_reaches_a_rank_started_by_an_agent(pool: Pool) -> None:
    """SIGINT goes through the rank's I/O thread (the kernel is not the rank's parent)."""
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(DistributedError) as err:
        pool.run("import time\nfor _ in range(600):\n    time.sleep(0.05)")
    timer.join()
    assert time.monotonic() - started < 10
    assert {r.status for r in err.value.result.ranks.values()} == {"interrupted"}
    assert "KeyboardInterrupt" in str(err.value)
    assert pool.run("t.item()").ranks[0].result == {"text/plain": "3.0"}  # same processes, state kept


def test_without_the_curve_keys_a_client_is_refused(pool: Pool, tmp_path: Path) -> None:
    """A peer that knows the HMAC key but not the Curve keys gets nothing through; raw bytes neither."""
    host, port = pool.address.removeprefix("tcp://").rsplit(":", 1)
    marker = tmp_path / "forged-code-ran"
    assert pool.connection.wire is not None
    forged = Wire(pool.connection.wire._key, rank_identity(0)).to_socket(
        "stream", {"name": "stdout", "cell_id": "x"}, [f"open({str(marker)!r}, 'w')".encode()]
    )
    dropped_before = pool.dropped
    refused_before = pool.curve.refused if pool.curve is not None else -1
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)  # no Curve at all: the handshake cannot even start
        plain.setsockopt(zmq.IDENTITY, b"rank-7")
        plain.connect(pool.address)
        wrong = ctx.socket(zmq.DEALER)  # Curve with the right server key but another client key
        other = CurveKeys.new()
        server_public = CurveKeys.new().server_public if pool.curve is None else pool.curve.keys.server_public
        secure_client(
            wrong, f"{server_public.decode()} {other.client_public.decode()} {other.client_secret.decode()}"
        )
        wrong.setsockopt(zmq.IDENTITY, b"rank-8")
        wrong.connect(pool.address)
        for sock in (plain, wrong):
            with contextlib.suppress(zmq.Again):  # no handshake, so usually nothing to send to
                sock.send_multipart(forged, zmq.NOBLOCK)
        # raw TCP with a ZMTP 3.0 greeting asking for the NULL mechanism (no encryption): the server
        # hangs up without a handshake (reading to the end would time out if it kept the connection)
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
        received = b""
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(greeting + b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER")
            raw.settimeout(5)
            try:
                while chunk := raw.recv(4096):
                    received += chunk
            except ConnectionResetError:
                pass
        deadline = time.monotonic() + 5
        while pool.curve is not None and pool.curve.refused == refused_before and time.monotonic() < deadline:
            time.sleep(0.05)
        pool.run("pass")  # the pool receives whatever got in, and still works
    finally:
        ctx.destroy(linger=0)
    assert b"READY" not in received and len(received) <= 64, received[:80]  # at most its greeting
    assert pool.curve is not None and pool.curve.refused > refused_before  # the wrong key, refused
    assert pool.dropped == dropped_before  # nothing reached the decoder at all
    assert not marker.exists()


def test_a_node_killed_mid_cell_is_reported_as_that_node(tmp_path: Path) -> None:
    with Pool(spec=_spec(), log_dir=tmp_path, sink=ConsoleSink()) as p:
        p.run("import torch, torch.distributed as dist")
        assert p.launcher is not None
        tether = psutil.Process(p.launcher.agents[1].pid)  # type: ignore[attr-defined]
        (agent,) = tether.children()
        killer = threading.Timer(2.0, agent.kill)  # node 1's torchrun agent dies, like its machine
        killer.start()
        started = time.monotonic()
        with pytest.raises(DistributedError) as err:
            p.run("import time\nfor _ in range(600):\n    dist.all_reduce(torch.ones(1)); time.sleep(0.05)")
        killer.join()
        took = time.monotonic() - started
        message = str(err.value)
        assert f"went down with node 1 ({socket.gethostname()})" in message, message
        on_node_1 = next(k for k, r in p.ranks.records.items() if r.node == 1)
        assert err.value.result.ranks[on_node_1].status == "dead"
        assert took < 30, took
        notes = "\n".join(err.value.result.notes)
        assert f"node 1 ({socket.gethostname()}) failed: rank {on_node_1} went down with it" in notes, notes
        assert "%dist_restart starts the pool again on the same hosts" in notes
        other = 1 - on_node_1
        assert "went down with node" not in p.ranks[other].exit  # the rank on node 0 is not blamed


def test_the_kernels_death_ends_agents_and_ranks(tmp_path: Path) -> None:
    script = (
        "import time\n"
        "from jupyter_shard import Pool\n"
        "from jupyter_shard.launchers import resolve_spec\n"
        "spec = resolve_spec(nproc=1, device='cpu', launcher='torchrun', hosts='localhost,localhost')\n"
        f"pool = Pool(spec=spec, log_dir={str(tmp_path)!r})\n"
        "pool.start()\n"
        "print(*[s.pid for s in pool.status()], *pool.launcher.local_pids(), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 4  # two ranks, two tethers (each running a torchrun agent)
        family = [psutil.Process(p) for p in pids]
        family += [c for p in family[2:] for c in p.children(recursive=True)]
        proc.kill()  # no clean-up from the kernel itself
        proc.wait(10)
        _, alive = psutil.wait_procs(family, timeout=20)
        assert alive == [], [p.cmdline()[:4] for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_nodes_started_by_hand_join_from_the_printed_command(tmp_path: Path) -> None:
    """``--nodes 2`` without ``--hosts``: the pool prints the command for each node and waits."""
    spec = resolve_spec(nproc=1, device="cpu", launcher="torchrun", nodes=2, interface="lo")
    pool = Pool(spec=spec, log_dir=tmp_path, sink=ConsoleSink())
    notices: list[str] = []
    pool.on_notice = notices.append
    nodes: list[subprocess.Popen[bytes]] = []

    def join_when_asked() -> None:
        deadline = time.monotonic() + 30
        while not notices and time.monotonic() < deadline:
            time.sleep(0.1)
        command = notices[0].splitlines()[1].strip().replace("--master-addr NODE0", "--master-addr 127.0.0.1")
        for k in range(2):  # each node told its index, as the notice asks
            here = command.replace("--node-rank K", f"--node-rank {k}")
            nodes.append(subprocess.Popen(["bash", "-c", here], cwd=tmp_path, start_new_session=True))

    joiner = threading.Thread(target=join_when_asked)
    joiner.start()
    try:
        pool.start()
        joiner.join()
        assert notices[0].startswith("waiting for 2 nodes to join; on each node run")
        assert (
            pool.connection.wire is not None and pool.connection.wire._key.hex() not in notices[0]
        )  # keys stay in the file
        result = pool.run(
            "import torch, torch.distributed as dist\nt = torch.ones(1); dist.all_reduce(t); t.item()"
        )
        assert [r.result for r in result.ranks.values()] == [{"text/plain": "2.0"}] * 2
    finally:
        pool.shutdown()
        for node in nodes:
            try:
                node.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0]  # the agents ended when the pool shut down
