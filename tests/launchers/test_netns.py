"""Two nodes with their own network addresses: torchrun agents in two network namespaces, reached the
way remote hosts are (``ssh``), dialling back to the kernel on a bridge address it was told to use.

The namespaces ``10.77.x.1`` and ``10.77.x.2`` hang off a bridge holding the kernel's address
``10.77.x.254``; ``ssh`` is a stand-in on PATH that runs the given script inside the host's namespace
(as sshd would run it on that host), with the pool's secrets arriving on stdin. Needs root and
network namespaces; without them the test skips, and the same launcher is tested on loopback in
test_torchrun.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from jupyter_shard import DistributedError, Pool
from jupyter_shard.launchers import resolve_spec
from jupyter_shard.pool.output import ConsoleSink
from tests.launchers._listeners import LISTENERS, proc_hex

pytestmark = pytest.mark.timeout(180)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def two_namespaces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str], Path]]:
    """(bridge name, node addresses, directory with a stand-in ``ssh``)."""
    tag = f"{os.getpid() % 10000}"
    net = f"10.77.{os.getpid() % 250}"
    bridge, spaces = f"jsbr{tag}", [f"jsns{tag}-{i}" for i in range(2)]
    made: list[list[str]] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(["link", "del", bridge])
        _ip("addr", "add", f"{net}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, ns in enumerate(spaces):
            _ip("netns", "add", ns)
            made.append(["netns", "del", ns])
            outer, inner = f"jsv{tag}{i}", f"jsp{tag}{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{net}.{i + 1}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (OSError, subprocess.CalledProcessError) as exc:
        for undo in reversed(made):
            subprocess.run(["ip", *undo], capture_output=True)
        detail = getattr(exc, "stderr", b"") or str(exc)
        pytest.skip(f"network namespaces are not available here ({detail!r}); loopback is tested instead")
    bin_dir = tmp_path_factory.mktemp("fake-ssh")
    cases = "\n".join(f"  {net}.{i + 1}) ns={ns}; ifc=jsp{tag}{i} ;;" for i, ns in enumerate(spaces))
    ssh = bin_dir / "ssh"
    ssh.write_text(
        "#!/bin/bash\n"
        "# ssh [-o OPTION]... HOST SCRIPT: run SCRIPT in HOST's network namespace, stdin passed on\n"
        'while [ "$1" = "-o" ]; do shift 2; done\n'
        'host=$1; shift\ncase "$host" in\n'
        + cases
        + '\n  *) echo "unknown host $host" >&2; exit 255 ;;\nesac\n'
        'exec ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$ifc" bash -c "$*"\n'
    )
    ssh.chmod(0o755)
    try:
        yield bridge, [f"{net}.1", f"{net}.2"], bin_dir
    finally:
        for undo in reversed(made):
            subprocess.run(["ip", *undo], capture_output=True)


def test_ranks_in_two_namespaces_all_reduce_and_dial_back_on_the_bridge(
    two_namespaces: tuple[str, list[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bridge, addresses, bin_dir = two_namespaces
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    spec = resolve_spec(
        nproc=1,
        device="cpu",
        strategy="ddp",
        launcher="torchrun",
        hosts=",".join(addresses),
        interface=bridge,
    )
    with Pool(spec=spec, log_dir=tmp_path, sink=ConsoleSink()) as pool:
        kernel_host, port = pool.address.removeprefix("tcp://").rsplit(":", 1)
        assert kernel_host == addresses[0].rsplit(".", 1)[0] + ".254"
        result = pool.run(
            "import os, torch, torch.distributed as dist\n"
            "t = torch.full((1,), float(dist.get_rank() + 1)); dist.all_reduce(t)\n"
            "print(os.environ['JUPYTER_SHARD_NODE'], os.environ.get('JUPYTER_SHARD_KEY'), t.item())"
        )
        seen = sorted(r.stdout.split() for r in result.ranks.values())
        assert seen == [["0", "None", "3.0"], ["1", "None", "3.0"]]  # the key left the environment
        # node 0's rendezvous store listens on the address node 1 was told, not on every interface
        on_node_0 = next(k for k, r in pool.ranks.records.items() if r.node == 0)
        listening = pool.run(LISTENERS, ranks=[on_node_0]).ranks[on_node_0].stdout.split()
        assert listening == ["LISTENING", proc_hex(addresses[0])], listening
        # every rank connection to the kernel comes from a namespace's own address
        peers = {
            c.raddr.ip
            for c in psutil.Process().net_connections(kind="tcp")
            if c.laddr and c.laddr.port == int(port) and c.raddr
        }
        assert peers == set(addresses), peers
        # no listener of the pool is on loopback or a wildcard address
        assert pool.address != f"tcp://127.0.0.1:{port}"

        on_node_1 = next(k for k, r in pool.ranks.records.items() if r.node == 1)
        agent = subprocess.run(
            ["ip", "netns", "pids", f"jsns{os.getpid() % 10000}-1"], capture_output=True, text=True
        ).stdout.split()
        node_agent = ["-m", "jupyter_shard.launchers.node_agent"]
        torchrun = [int(p) for p in agent if psutil.Process(int(p)).cmdline()[1:3] == node_agent]
        assert len(torchrun) == 1
        killer = threading.Timer(2.0, lambda: psutil.Process(torchrun[0]).kill())
        killer.start()
        with pytest.raises(DistributedError) as err:
            pool.run(
                "import time\nfor _ in range(600):\n    dist.all_reduce(torch.ones(1)); time.sleep(0.05)"
            )
        killer.join()
        notes = "\n".join(err.value.result.notes)
        assert f"node 1 ({socket.gethostname()}) failed: rank {on_node_1} went down with it" in notes, notes
