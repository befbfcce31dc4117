"""jupyter_shard.launchers.torchrun: bind addresses, the ssh command line (secrets on stdin), the rendezvous
endpoint, the manual-join env file.

No torch, no ranks: agents are fakes shaped like Popen.
"""

from __future__ import annotations

import os
import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_shard.env import CURVE as CURVE_ENV
from jupyter_shard.env import KEY as KEY_ENV
from jupyter_shard.launchers import remote
from jupyter_shard.launchers import torchrun as torchrun_mod
from jupyter_shard.launchers.commands import agent_args as torchrun_args
from jupyter_shard.launchers.remote import job_env
from jupyter_shard.launchers.torchrun import TorchrunLauncher, _manual_instructions, _ssh_command
from jupyter_shard.spec import SpecError
from tests.unit.launchers._helpers import (
    ELSEWHERE,
    KEY,
    _curve_value,
    _lo_address,
    _one_line,
    _rank_launches,
    _Spawned,
    _spec,
)

# -- bind addresses ----------------------------------------------------------------------------------


def test_torchrun_on_one_node_without_hosts_binds_loopback() -> None:
    assert TorchrunLauncher().bind_address(_spec(launcher="torchrun")) == "127.0.0.1"


def test_torchrun_with_every_host_this_machine_binds_loopback() -> None:
    spec = _spec(launcher="torchrun", hosts="localhost,localhost")
    assert spec.nodes == 2
    assert TorchrunLauncher().bind_address(spec) == "127.0.0.1"


def test_torchrun_with_a_host_elsewhere_and_no_interface_is_refused_listing_interfaces() -> None:
    spec = _spec(launcher="torchrun", hosts=f"localhost,{ELSEWHERE}")
    with pytest.raises(SpecError) as info:
        TorchrunLauncher().bind_address(spec)
    msg = _one_line(info)
    assert "--interface" in msg
    assert f"ranks on {ELSEWHERE} are not on this machine" in msg
    assert "localhost" not in msg.split("are not on this machine")[0], "only the other hosts are named"
    assert f"lo {_lo_address()}" in msg
    for name in remote._local_addresses():
        assert name in msg


def test_torchrun_with_several_nodes_and_no_hosts_needs_an_interface() -> None:
    with pytest.raises(SpecError) as info:
        TorchrunLauncher().bind_address(_spec(launcher="torchrun", nodes=2))
    msg = _one_line(info)
    assert msg.startswith("--nodes 2 without --hosts runs ranks on other machines")
    assert "--interface" in msg and f"lo {_lo_address()}" in msg


def test_interface_wins_over_hosts_on_this_machine() -> None:
    spec = _spec(launcher="torchrun", hosts="localhost,localhost", interface="lo")
    assert TorchrunLauncher().bind_address(spec) == "127.0.0.1"


def test_a_loopback_interface_is_refused_for_ranks_on_other_hosts() -> None:
    spec = _spec(launcher="torchrun", hosts=f"localhost,{ELSEWHERE}", interface="lo")
    with pytest.raises(SpecError, match=f"--interface lo is loopback, which {ELSEWHERE} cannot reach"):
        TorchrunLauncher().bind_address(spec)


# -- ssh: the secrets travel on stdin -----------------------------------------------------------------


def _agent_env(node: int = 1) -> dict[str, str]:
    return {
        KEY_ENV: KEY,
        CURVE_ENV: _curve_value(),
        "JUPYTER_SHARD_NODE": str(node),
        "JUPYTER_SHARD_ADDRESS": "tcp://10.0.0.1:5555",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "/some where/lib",
        "HOME": "/home/me",
        "PATH": "/usr/bin:/bin",
    }


def _secret_parts(env: dict[str, str]) -> list[str]:
    return [env[KEY_ENV], env[CURVE_ENV], *env[CURVE_ENV].split(" ")]


def test_ssh_command_keeps_every_secret_off_the_command_line(tmp_path: Path) -> None:
    env = _agent_env()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "-m", "jupyter_shard.rank"]
    argv, secrets = _ssh_command("node2", env, agent, tmp_path / "my work")
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "node2"]
    assert len(argv) == 5
    for part in _secret_parts(env):
        assert all(part not in arg for arg in argv), "a secret is on ssh's command line"
    assert secrets == f"{env[KEY_ENV]}\n{env[CURVE_ENV]}\n".encode()
    script = argv[4]
    assert script.startswith(f"read -r {KEY_ENV} && read -r {CURVE_ENV} && export {KEY_ENV} {CURVE_ENV}")
    assert f"cd {shlex.quote(str(tmp_path / 'my work'))} && " in script
    assert (
        f"{shlex.quote(sys.executable)} -m torch.distributed.run --nnodes 2 -m jupyter_shard.rank" in script
    )
    assert "JUPYTER_SHARD_NODE=1" in script and "OMP_NUM_THREADS=1" in script
    assert "HOME=" not in script and "PATH=/usr" not in script


def test_ssh_script_reads_the_secrets_in_order_and_runs_in_cwd(tmp_path: Path) -> None:
    """Run the script the remote shell would run, with a stand-in for torchrun that reports."""
    env = _agent_env(node=3)
    work = tmp_path / "shared dir"
    work.mkdir()
    report = (
        "import os; e = os.environ; "
        f"print(e['{KEY_ENV}']); print(e['{CURVE_ENV}']); print(os.getcwd()); "
        "print(e['JUPYTER_SHARD_NODE']); print(e['PYTHONPATH'])"
    )
    argv, secrets = _ssh_command("node2", env, [sys.executable, "-c", report], work)
    out = subprocess.run(
        ["sh", "-c", argv[-1]],
        input=secrets,
        capture_output=True,
        env={"PATH": os.environ["PATH"]},
        cwd=tmp_path,
        timeout=10,
        check=True,
    ).stdout.decode()
    assert out.splitlines() == [env[KEY_ENV], env[CURVE_ENV], str(work), "3", "/some where/lib"]


def test_torchrun_start_sends_secrets_to_a_remote_node_only_on_stdin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned = _Spawned()
    monkeypatch.setattr(torchrun_mod, "spawn_agent", spawned)
    monkeypatch.setenv(KEY_ENV, "kernel-side-key")  # the kernel's own environment must not leak either
    monkeypatch.setenv(CURVE_ENV, "kernel side curve")
    spec = _spec(launcher="torchrun", hosts=f"localhost,{ELSEWHERE}")
    launches = _rank_launches(tmp_path, 2)
    handles = TorchrunLauncher().start(spec, launches, lifeline_fd=99)
    assert [h.rank for h in handles] == [0, 1]
    assert [(c["node"], c["host"]) for c in spawned.calls] == [(0, "localhost"), (1, ELSEWHERE)]
    here, there = spawned.calls
    secrets = _secret_parts(launches[0].env)

    # node 0 is this machine: a local torchrun whose environment carries the keys
    assert here["command"][:3] == [sys.executable, "-m", "jupyter_shard.launchers.node_agent"]
    assert here["command"][-2:] == ["-m", "jupyter_shard.rank"]
    assert _option(here["command"], "--node-rank") == "0"
    assert here["env"][KEY_ENV] == KEY and here["env"]["JUPYTER_SHARD_NODE"] == "0"
    assert here["stdin"] is None
    assert here["log"] == tmp_path / "node-0.log"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JUPYTER_SHARD_LOG"):
        assert name not in here["env"]

    # node 1 is reached over ssh: the keys are on stdin, never in argv or ssh's environment
    assert there["command"][:4] == ["ssh", "-o", "BatchMode=yes", ELSEWHERE]
    for part in [*secrets, "kernel-side-key", "kernel side curve"]:
        assert all(part not in arg for arg in there["command"])
        assert all(part not in value for value in there["env"].values())
    assert KEY_ENV not in there["env"] and CURVE_ENV not in there["env"]
    assert there["stdin"] == f"{KEY}\n{launches[0].env[CURVE_ENV]}\n".encode()
    script = there["command"][-1]
    assert f"cd {shlex.quote(str(tmp_path))} && " in script
    assert "-m jupyter_shard.launchers.node_agent" in script and script.endswith("-m jupyter_shard.rank")
    assert _option(script, "--node-rank") == "1" and "JUPYTER_SHARD_NODE=1" in script
    assert "GLOO_SOCKET_IFNAME" not in script and "RANK=" not in script.replace("NODE", "")
    assert there["log"] == tmp_path / "node-1.log"


def _option(argv_or_script: list[str] | str, name: str) -> str:
    words = shlex.split(argv_or_script) if isinstance(argv_or_script, str) else argv_or_script
    return words[words.index(name) + 1]


def _rdzv_endpoint(argv_or_script: list[str] | str) -> str:
    assert _option(argv_or_script, "--rdzv-backend") == "static"
    return f"{_option(argv_or_script, '--master-addr')}:{_option(argv_or_script, '--master-port')}"


def test_remote_nodes_are_not_sent_to_a_loopback_rendezvous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--hosts localhost,node2``: node 0 (this machine) hosts the rendezvous store; node 2 must be
    told an address of this machine it can reach, not ``localhost``, which is node 2 itself there."""
    spawned = _Spawned()
    monkeypatch.setattr(torchrun_mod, "spawn_agent", spawned)
    spec = _spec(launcher="torchrun", hosts=f"localhost,{ELSEWHERE}")
    TorchrunLauncher().start(spec, _rank_launches(tmp_path, 2), lifeline_fd=99)
    host = _rdzv_endpoint(spawned.calls[1]["command"][-1]).rsplit(":", 1)[0]
    assert host not in ("localhost", "::1") and not host.startswith("127."), (
        f"node 1 on {ELSEWHERE} is told to meet at {host}, which is itself there"
    )
    assert host == socket.gethostname()  # this machine, by a name the other node can look up


def test_torchrun_on_this_machine_meets_on_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spawned = _Spawned()
    monkeypatch.setattr(torchrun_mod, "spawn_agent", spawned)
    spec = _spec(launcher="torchrun", hosts="localhost,localhost", nproc=2)
    TorchrunLauncher().start(spec, _rank_launches(tmp_path, 4), lifeline_fd=99)
    ends = {_rdzv_endpoint(c["command"]) for c in spawned.calls}
    assert len(ends) == 1 and next(iter(ends)).startswith("127.0.0.1:")
    ids = {c["command"][c["command"].index("--rdzv-id") + 1] for c in spawned.calls}
    assert len(ids) == 1 and next(iter(ids)).startswith("jupyter_shard-")
    assert all(c["env"]["GLOO_SOCKET_IFNAME"] == "lo" for c in spawned.calls), "kept for loopback"
    assert [_option(c["command"], "--node-rank") for c in spawned.calls] == ["0", "1"]  # node 0 hosts


# -- manual join: --nodes N without --hosts ------------------------------------------------------------


def test_manual_instructions_write_a_private_env_file_and_print_no_key(tmp_path: Path) -> None:
    spec = _spec(launcher="torchrun", nodes=2)
    env = job_env(_rank_launches(tmp_path, 1)[0].env)
    options = torchrun_args("2", 1, "K", "NODE0", "29400", "jupyter_shard-abc")
    work = tmp_path / "my work"
    text = _manual_instructions(spec, env, options, tmp_path, work)
    path = tmp_path / "node.env"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for part in _secret_parts(env):
        assert part not in text
    assert text.startswith("waiting for 2 nodes to join")
    command = next(line.strip() for line in text.splitlines() if line.startswith("  cd "))
    words = shlex.split(command)
    assert words[:2] == ["cd", str(work)]
    assert words[3:5] == [".", str(path)]
    assert words[6:9] == [sys.executable, "-m", "jupyter_shard.launchers.node_agent"]
    assert words[-2:] == ["-m", "jupyter_shard.rank"]
    assert _option(words, "--master-addr") == "NODE0" and _option(words, "--node-rank") == "K"
    assert "NODE0" in text.splitlines()[-1] and "K is the node's index (0 on the first node" in text
    # the file, sourced by a shell, gives back exactly the pool's keys and nothing per rank or foreign
    shown = subprocess.run(
        ["sh", "-c", f". {shlex.quote(str(path))} && env"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
        timeout=10,
        check=True,
    ).stdout.splitlines()
    assert f"{KEY_ENV}={KEY}" in shown
    assert f"{CURVE_ENV}={env[CURVE_ENV]}" in shown
    assert "OMP_NUM_THREADS=1" in shown
    content = path.read_text()
    assert "GLOO_SOCKET_IFNAME" not in content and "MASTER_PORT" not in content
    assert "\nPATH=" not in content and "export PATH" not in content


def test_torchrun_start_without_hosts_starts_no_agent_and_waits_for_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned = _Spawned()
    monkeypatch.setattr(torchrun_mod, "spawn_agent", spawned)
    launcher = TorchrunLauncher()
    handles = launcher.start(_spec(launcher="torchrun", nodes=2), _rank_launches(tmp_path, 2), 99)
    assert spawned.calls == []
    assert len(handles) == 2 and all(h.poll() is None for h in handles)
    note = launcher.waiting()
    assert note is not None and KEY not in note
    assert stat.S_IMODE((tmp_path / "node.env").stat().st_mode) == 0o600
    assert "--nnodes 2" in note and "--master-addr NODE0 --master-port 29400" in note
