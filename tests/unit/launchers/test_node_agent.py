"""jupyter_shard.launchers.node_agent: node 0's rendezvous store listens on the head address alone.

The contrast is run too: ``torch.distributed.run`` itself, given the same options, listens on every
interface, so the check below fails if the agent stops binding the store itself.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_shard._util.net import free_port
from jupyter_shard.launchers.commands import agent_args
from jupyter_shard.launchers.node_agent import bind_address, torchrun_options

pytestmark = pytest.mark.timeout(120)

# A worker that prints the addresses listening on the store's port, as /proc/net/tcp{,6} hold them
# (hex, little-endian for IPv4: 0100007F is 127.0.0.1; all zeros is every interface).
_LISTENERS = """
import os
port = int(os.environ["MASTER_PORT"])
seen = []
for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(name).read().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].rsplit(":", 1)
        if int(hex_port, 16) == port and fields[3] == "0A":
            seen.append(address)
print("LISTENING", ",".join(sorted(seen)))
"""


def test_options_are_read_before_the_script_only() -> None:
    argv = ["--nnodes", "2", "--master-addr=h", "--node-rank", "1", "-m", "mod", "--node-rank", "9"]
    options = torchrun_options(argv)
    assert options.nnodes == "2"
    assert options.master_addr == "h"
    assert options.node_rank == 1
    assert options.master_port is None  # not given: torch's own default applies later
    assert torchrun_options(["script.py", "--nnodes", "4"]).nnodes == "1:1"  # the script's own options


def test_the_bind_address_is_the_head_as_resolved_here() -> None:
    assert bind_address("127.0.0.1", 1) == (socket.AF_INET, "127.0.0.1")
    assert bind_address("127.0.0.1", 2) == (socket.AF_INET, "127.0.0.1")  # every node is this machine
    assert bind_address("no-such-host.invalid", 2) is None


def test_a_name_that_is_loopback_only_here_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian maps the host name to 127.0.1.1; the other nodes reach it by its network address."""

    def resolve(host: str, *_: object, **__: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert bind_address("node0", 2) is None
    assert bind_address("node0", 1) == (socket.AF_INET, "127.0.1.1")


def _listening(module: str, tmp_path: Path) -> str:
    worker = tmp_path / "worker.py"
    worker.write_text(_LISTENERS)
    options = agent_args("1", 1, "0", "127.0.0.1", str(free_port()), "test-run")
    out = subprocess.run(
        [sys.executable, "-m", module, *options, str(worker)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("LISTENING")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return lines[0].split(" ", 1)[1]


def test_node_0_store_listens_on_the_head_address_alone(tmp_path: Path) -> None:
    assert _listening("jupyter_shard.launchers.node_agent", tmp_path) == "0100007F"
    # torch's own agent with the same options listens everywhere: what the node agent is for
    wildcard = _listening("torch.distributed.run", tmp_path)
    assert wildcard and all(set(a) == {"0"} for a in wildcard.split(",")), wildcard
