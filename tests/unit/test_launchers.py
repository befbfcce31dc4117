"""The multi-node launchers without a cluster: bind addresses, the ssh and srun command lines, the
manual-join env file, the tether (as a real process), RemoteRank's view of its node agent, Curve keys.

No torch, no SLURM, no ranks: agents are fakes shaped like Popen or short-lived ``sleep`` processes.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from jupyter_shard import _curve
from jupyter_shard._curve import CurveKeys, _OnlyOurClient
from jupyter_shard.env import CURVE as CURVE_ENV
from jupyter_shard.env import KEY as KEY_ENV
from jupyter_shard.env import PER_RANK as PER_RANK_ENV
from jupyter_shard.launchers import remote, resolve_spec
from jupyter_shard.launchers import slurm as slurm_mod
from jupyter_shard.launchers import torchrun as torchrun_mod
from jupyter_shard.launchers.base import RankLaunch
from jupyter_shard.launchers.commands import agent_args as torchrun_args
from jupyter_shard.launchers.remote import (
    AgentProcess,
    RemoteRank,
    job_env,
    resolve_interface,
    tether_argv,
)
from jupyter_shard.launchers.slurm import SlurmLauncher
from jupyter_shard.launchers.torchrun import TorchrunLauncher, _manual_instructions, _ssh_command
from jupyter_shard.spec import LaunchSpec, SpecError

ELSEWHERE = "192.0.2.1"  # TEST-NET-1: never this machine, and resolving it needs no DNS
KEY = "0123456789abcdef0123456789abcdef"


def _curve_value() -> str:
    return CurveKeys.new().client_env()


def _spec(**kwargs: Any) -> LaunchSpec:
    kwargs.setdefault("gpu_count", 0)
    kwargs.setdefault("nproc", 1)
    return resolve_spec(**kwargs)


def _one_line(exc: pytest.ExceptionInfo[SpecError]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, "a SpecError is one line"
    return msg


def _lo_address() -> str:
    return remote._local_addresses()["lo"]


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


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
@pytest.mark.parametrize("choice", ["lo", "127.0.0.1"])
def test_interface_lo_or_its_address_resolves_to_loopback(launcher: str, choice: str) -> None:
    spec = _spec(launcher=launcher, interface=choice, **({"nodes": 2} if launcher == "slurm" else {}))
    launcher_obj = TorchrunLauncher() if launcher == "torchrun" else SlurmLauncher()
    assert launcher_obj.bind_address(spec) == "127.0.0.1"


def test_interface_wins_over_hosts_on_this_machine() -> None:
    spec = _spec(launcher="torchrun", hosts="localhost,localhost", interface="lo")
    assert TorchrunLauncher().bind_address(spec) == "127.0.0.1"


@pytest.mark.parametrize("choice", ["nosuchif0", ELSEWHERE, "::1", "", "10.0.0.300"])
def test_unknown_interface_or_address_is_refused_with_the_list(choice: str) -> None:
    with pytest.raises(SpecError) as info:
        resolve_interface(choice)
    msg = _one_line(info)
    assert msg.startswith(f"--interface {choice!r} is not an interface or address of this machine")
    assert f"lo {_lo_address()}" in msg
    spec = _spec(launcher="torchrun", hosts=f"localhost,{ELSEWHERE}", interface=choice)
    with pytest.raises(SpecError, match="is not an interface or address of this machine"):
        TorchrunLauncher().bind_address(spec)


def test_slurm_without_interface_is_refused() -> None:
    with pytest.raises(SpecError) as info:
        SlurmLauncher().bind_address(_spec(launcher="slurm"))
    msg = _one_line(info)
    assert msg.startswith("SLURM may place the ranks on other machines")
    assert "--interface" in msg and f"lo {_lo_address()}" in msg


def test_is_this_machine() -> None:
    assert remote.is_this_machine("localhost")
    assert remote.is_this_machine("127.0.0.1")
    assert remote.is_this_machine("127.0.0.2")
    assert not remote.is_this_machine(ELSEWHERE)


# -- the environment agents get --------------------------------------------------------------------


def test_job_env_drops_every_per_rank_variable() -> None:
    env = {name: "x" for name in PER_RANK_ENV}
    env |= {"PATH": "/bin", KEY_ENV: KEY, "JUPYTER_SHARD_ADDRESS": "tcp://h:1", "OMP_NUM_THREADS": "4"}
    assert job_env(env) == {
        "PATH": "/bin",
        KEY_ENV: KEY,
        "JUPYTER_SHARD_ADDRESS": "tcp://h:1",
        "OMP_NUM_THREADS": "4",
    }
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JUPYTER_SHARD_LOG"):
        assert name in PER_RANK_ENV


def test_torchrun_args_shape() -> None:
    args = torchrun_args("2", 3, "h:29400", "rid")
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs == {
        "--nnodes": "2",
        "--nproc-per-node": "3",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "h:29400",
        "--rdzv-id": "rid",
        "--max-restarts": "0",
        "--monitor-interval": "0.1",
    }


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


class _FakeProc:
    """Enough of Popen for AgentProcess: a pid, poll, signals and wait."""

    _next_pid = 4_000_000

    def __init__(self, code: int | None = None) -> None:
        _FakeProc._next_pid += 1
        self.pid = _FakeProc._next_pid
        self.returncode = code
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if self.returncode is None:
            self.returncode = -sig

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            raise subprocess.TimeoutExpired("fake", timeout or 0)
        return self.returncode


class _Spawned:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        node: int | None,
        host: str,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        cwd: Path,
        lifeline_fd: int,
        cancel: list[str] | tuple[str, ...] = (),
        stdin: bytes | None = None,
    ) -> AgentProcess:
        self.calls.append(
            {
                "node": node,
                "host": host,
                "command": list(command),
                "env": dict(env),
                "log": log_path,
                "cwd": cwd,
                "cancel": list(cancel),
                "stdin": stdin,
            }
        )
        return AgentProcess(node, host, _FakeProc(), log_path)  # type: ignore[arg-type]


def _rank_launches(tmp_path: Path, n: int) -> list[RankLaunch]:
    curve = _curve_value()
    launches = []
    for rank in range(n):
        env = {
            "PATH": os.environ["PATH"],
            KEY_ENV: KEY,
            CURVE_ENV: curve,
            "JUPYTER_SHARD_ADDRESS": "tcp://127.0.0.1:5555",
            "GLOO_SOCKET_IFNAME": "lo",
            "NCCL_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "JUPYTER_SHARD_LOG": str(tmp_path / f"rank-{rank}.log"),
        }
        launches.append(RankLaunch(rank, env, tmp_path / f"rank-{rank}.log", tmp_path))
    return launches


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
    assert here["command"][:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert here["command"][-2:] == ["-m", "jupyter_shard.rank"]
    assert "is_host=true" in here["command"]
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
    assert "-m torch.distributed.run" in script and script.endswith("-m jupyter_shard.rank")
    assert "is_host=false" in script and "JUPYTER_SHARD_NODE=1" in script
    assert "GLOO_SOCKET_IFNAME" not in script and "RANK=" not in script.replace("NODE", "")
    assert there["log"] == tmp_path / "node-1.log"


def _rdzv_endpoint(argv_or_script: list[str] | str) -> str:
    words = shlex.split(argv_or_script) if isinstance(argv_or_script, str) else argv_or_script
    return words[words.index("--rdzv-endpoint") + 1]


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


def test_a_loopback_interface_is_refused_for_ranks_on_other_hosts() -> None:
    spec = _spec(launcher="torchrun", hosts=f"localhost,{ELSEWHERE}", interface="lo")
    with pytest.raises(SpecError, match=f"--interface lo is loopback, which {ELSEWHERE} cannot reach"):
        TorchrunLauncher().bind_address(spec)


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
    assert [c["command"][c["command"].index("--rdzv-conf") + 1] for c in spawned.calls] == [
        "is_host=true",
        "is_host=false",
    ]


# -- manual join: --nodes N without --hosts ------------------------------------------------------------


def test_manual_instructions_write_a_private_env_file_and_print_no_key(tmp_path: Path) -> None:
    spec = _spec(launcher="torchrun", nodes=2)
    env = job_env(_rank_launches(tmp_path, 1)[0].env)
    options = torchrun_args("2", 1, "NODE0:29400", "jupyter_shard-abc")
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
    assert words[6:9] == [sys.executable, "-m", "torch.distributed.run"]
    assert words[-2:] == ["-m", "jupyter_shard.rank"]
    assert "NODE0:29400" in words and "NODE0" in text.splitlines()[-1]
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
    assert "--nnodes 2" in note and "NODE0:29400" in note


# -- slurm: the srun command -------------------------------------------------------------------------


def test_slurm_job_names_are_unique() -> None:
    a, b = SlurmLauncher().job_name, SlurmLauncher().job_name
    assert a != b and a.startswith("jupyter_shard-") and b.startswith("jupyter_shard-")


def test_slurm_start_builds_one_srun_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spawned = _Spawned()
    monkeypatch.setattr(slurm_mod, "spawn_agent", spawned)
    monkeypatch.setattr(slurm_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    fake_python = tmp_path / "bin" / "python"
    fake_python.parent.mkdir()
    fake_python.write_text('#!/bin/sh\necho "NODE=$JUPYTER_SHARD_NODE"\nfor a; do echo "$a"; done\n')
    fake_python.chmod(0o755)
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "nodeA\\nnodeB\\n"\n')
    scontrol.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))

    spec = _spec(
        launcher="slurm", gpus=4, nproc=None, nodes=2, partition="gpu", time_limit="1:00:00", account="proj"
    )
    launcher = SlurmLauncher()
    handles = launcher.start(spec, _rank_launches(tmp_path, 8), lifeline_fd=99)
    assert len(handles) == 8
    (call,) = spawned.calls
    assert (call["node"], call["host"]) == (None, "slurm")
    command = call["command"]
    assert command[0] == "srun"
    srun = command[: command.index("bash")]
    for flag in (
        f"--job-name={launcher.job_name}",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--gpus-per-node=4",
        "--partition=gpu",
        "--time=1:00:00",
        "--account=proj",
    ):
        assert flag in srun
    assert command[-3:-1] == ["bash", "-c"]
    assert call["cancel"] == ["scancel", f"--name={launcher.job_name}"]
    assert call["log"] == tmp_path / "srun.log"
    for name in ("RANK", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert name not in call["env"]

    # what each task runs, with SLURM's variables as srun sets them on node 1
    env = {
        "PATH": f"{fake_python.parent}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "nodeA,nodeB",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "77",
    }
    out = subprocess.run(
        ["bash", "-c", command[-1]], capture_output=True, text=True, env=env, timeout=10, check=True
    ).stdout.splitlines()
    assert out[0] == "NODE=1"
    assert out[1:] == [
        "-m",
        "torch.distributed.run",
        *torchrun_args("2", 4, "nodeA:29400", "77"),
        "-m",
        "jupyter_shard.rank",
    ]


def test_slurm_cpu_pool_asks_for_no_gpus_and_no_unset_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned = _Spawned()
    monkeypatch.setattr(slurm_mod, "spawn_agent", spawned)
    monkeypatch.setattr(slurm_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    SlurmLauncher().start(_spec(launcher="slurm", nproc=2), _rank_launches(tmp_path, 2), lifeline_fd=99)
    srun = spawned.calls[0]["command"]
    srun = srun[: srun.index("bash")]
    assert "--nodes=1" in srun and "--cpus-per-task=2" in srun
    assert not [a for a in srun if a.startswith(("--gpus", "--partition", "--time", "--account"))]


def test_slurm_start_without_srun_is_a_spec_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_mod.shutil, "which", lambda name: None)
    with pytest.raises(SpecError, match="needs SLURM's srun on PATH"):
        SlurmLauncher().start(_spec(launcher="slurm"), _rank_launches(tmp_path, 1), lifeline_fd=99)


# -- the tether, as a real process ------------------------------------------------------------------


SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _catches_sigterm(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & SIGTERM_BIT)
    except OSError:
        pass
    return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _until(check: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


class _Tether:
    def __init__(self, command: list[str], cancel: list[str] | tuple[str, ...] = ()) -> None:
        read, self.write = os.pipe()
        self.proc = subprocess.Popen(
            tether_argv(read, command, cancel), pass_fds=(read,), stderr=subprocess.PIPE
        )
        os.close(read)

    def children(self) -> list[psutil.Process]:
        """The command and everything it started, once the tether watches for signals."""
        found: list[psutil.Process] = []

        def ready() -> bool:
            nonlocal found
            with_children = psutil.Process(self.proc.pid).children(recursive=True)
            found = with_children
            return bool(with_children) and _catches_sigterm(self.proc.pid)

        assert _until(ready), "the tether did not start its command"
        return found

    def close(self) -> None:
        if self.write >= 0:
            os.close(self.write)
            self.write = -1


@pytest.fixture
def tethers() -> Iterator[list[_Tether]]:
    started: list[_Tether] = []
    yield started
    for t in started:
        t.close()
        if t.proc.poll() is None:
            t.proc.kill()
        t.proc.wait(5)
        if t.proc.stderr is not None:
            t.proc.stderr.close()


def test_tether_exits_with_the_commands_status(tethers: list[_Tether]) -> None:
    t = _Tether(["sh", "-c", "exit 3"])
    tethers.append(t)
    assert t.proc.wait(5) == 3


def test_tether_reports_a_signal_as_a_shell_does(tethers: list[_Tether]) -> None:
    t = _Tether(["sh", "-c", "kill -9 $$"])
    tethers.append(t)
    assert t.proc.wait(5) == 128 + signal.SIGKILL


def test_tether_when_the_kernel_is_gone_cancels_and_kills_the_process_group(
    tmp_path: Path, tethers: list[_Tether]
) -> None:
    marker = tmp_path / "cancelled"
    t = _Tether(["sh", "-c", "sleep 60 & wait"], cancel=["touch", str(marker)])
    tethers.append(t)
    t.children()
    procs = _until_children(t, 2)
    assert len(procs) == 2, "sh and its background sleep"
    t.close()  # the kernel's end of the lifeline
    assert t.proc.wait(5) == 128 + signal.SIGTERM
    assert marker.exists(), "the --cancel command did not run"
    assert all(_until(lambda p=p: _gone(p.pid), 3.0) for p in procs), "a process of the group outlived it"
    assert t.proc.stderr is not None
    assert b"the kernel is gone" in t.proc.stderr.read()


def _until_children(t: _Tether, n: int) -> list[psutil.Process]:
    _until(lambda: len(psutil.Process(t.proc.pid).children(recursive=True)) >= n)
    return psutil.Process(t.proc.pid).children(recursive=True)


def test_tether_sigterm_stops_the_command_and_exits(tmp_path: Path, tethers: list[_Tether]) -> None:
    marker = tmp_path / "cancelled"
    t = _Tether(["sleep", "60"], cancel=["touch", str(marker)])
    tethers.append(t)
    (child,) = t.children()
    t.proc.send_signal(signal.SIGTERM)
    assert t.proc.wait(5) == 128 + signal.SIGTERM
    assert _until(lambda: _gone(child.pid), 3.0)
    assert marker.exists()


def test_tether_without_a_command_is_a_usage_error() -> None:
    read, write = os.pipe()
    try:
        done = subprocess.run(
            tether_argv(read, []), pass_fds=(read,), capture_output=True, timeout=10, check=False
        )
    finally:
        os.close(read)
        os.close(write)
    assert done.returncode == 2 and b"no command given" in done.stderr


# -- RemoteRank -------------------------------------------------------------------------------------

ROOT_CAUSE_ONLY = """\
[W] some earlier warning
============================================================
jupyter_shard.rank FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_12:00:00
  host      : nodeb
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 123)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 123
============================================================
"""

# torchrun lists the other failures first and the root cause (the first to fail) after them
TWO_FAILURES = """\
============================================================
jupyter_shard.rank FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2025-01-01_12:00:05
  host      : nodeb
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 457)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_12:00:00
  host      : nodeb
  rank      : 2 (local_rank: 0)
  exitcode  : -9 (pid: 456)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 456
============================================================
"""


def _agent(tmp_path: Path, node: int | None, host: str, log_text: str = "") -> AgentProcess:
    log = tmp_path / f"agent-{node}.log"
    log.write_text(log_text)
    return AgentProcess(node, host, _FakeProc(), log)  # type: ignore[arg-type]


def _exit(agent: AgentProcess, code: int) -> None:
    agent.proc.returncode = code


class _Delivered(list[tuple[int, int]]):
    def __call__(self, rank: int, sig: int) -> None:
        self.append((rank, sig))


def test_failure_reads_torchruns_root_cause(tmp_path: Path) -> None:
    agent = _agent(tmp_path, 1, "nodeb", ROOT_CAUSE_ONLY)
    assert agent.failure().startswith("rank 1 was killed by SIGKILL")


def test_failure_names_the_root_cause_not_another_failure(tmp_path: Path) -> None:
    agent = _agent(tmp_path, 1, "nodeb", TWO_FAILURES)
    assert agent.failure().startswith("rank 2 was killed by SIGKILL"), agent.failure()


def test_failure_is_empty_without_a_summary_or_a_log(tmp_path: Path) -> None:
    assert _agent(tmp_path, 0, "a", "just output\nrank: nothing\n").failure() == ""
    agent = _agent(tmp_path, 0, "a")
    agent.log_path.unlink()
    assert agent.failure() == "" and agent.tail() == ""


def test_rank_runs_while_its_agent_runs(tmp_path: Path) -> None:
    agents = [_agent(tmp_path, 0, "nodea"), _agent(tmp_path, 1, "nodeb")]
    rank = RemoteRank(2, agents, _Delivered())
    assert rank.poll() is None and rank.wait(0.05) is None
    rank.bind(pid=4242, host="nodeb", node=1)
    assert rank.poll() is None and not rank.node_down
    assert rank.agent() is agents[1]


def test_bound_rank_depends_only_on_its_own_nodes_agent(tmp_path: Path) -> None:
    a0 = _agent(tmp_path, 0, "nodea")
    a1 = _agent(tmp_path, 1, "nodeb", ROOT_CAUSE_ONLY)
    rank = RemoteRank(3, [a0, a1], _Delivered())
    rank.bind(pid=4242, host="nodeb.example", node=1)
    _exit(a0, 1)
    assert rank.poll() is None and not rank.node_down, "node 0's agent is not this rank's"
    _exit(a1, 1)
    assert rank.poll() == 1
    assert rank.wait(0.0) == 1
    assert rank.node_down
    reason = rank.exit_reason(1)
    assert "node 1 (nodeb.example)" in reason
    assert "its node agent exited with status 1" in reason
    assert "after rank 1 was killed by SIGKILL" in reason
    assert reason.endswith(f"agent log: {a1.log_path}")
    _exit(a1, 0)
    assert rank.poll() == 1, "the first exit code sticks"


def test_unbound_rank_ends_when_any_agent_exits(tmp_path: Path) -> None:
    a0, a1 = _agent(tmp_path, 0, "nodea"), _agent(tmp_path, 1, "nodeb")
    rank = RemoteRank(0, [a0, a1], _Delivered())
    _exit(a1, 255)
    assert rank.poll() == 255 and rank.node_down
    reason = rank.exit_reason(255)
    assert "host nodeb" in reason and "status 255" in reason and str(a1.log_path) in reason


def test_slurm_rank_names_the_job_step_and_its_end_note(tmp_path: Path) -> None:
    step = _agent(tmp_path, None, "slurm")
    step.end_note = lambda: "SLURM job 11 CANCELLED"
    rank = RemoteRank(1, [step], _Delivered())
    rank.bind(pid=77, host="c2", node=1)
    assert rank.agent() is step
    _exit(step, 143)
    assert rank.poll() == 143
    reason = rank.exit_reason(143)
    assert "went down with node 1 (c2): its SLURM job step exited with status 143" in reason
    assert "(SLURM job 11 CANCELLED)" in reason and str(step.log_path) in reason


def test_silent_bound_rank_is_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "SILENT_AFTER", 0.15)
    rank = RemoteRank(1, [_agent(tmp_path, 0, "a"), _agent(tmp_path, 1, "nodeb")], _Delivered())
    time.sleep(0.2)
    assert rank.poll() is None, "a rank not yet ready is not timed out"
    rank.bind(pid=4242, host="nodeb", node=1)
    for _ in range(3):
        time.sleep(0.06)
        rank.heard()
        assert rank.poll() is None
    time.sleep(0.2)
    assert rank.poll() == -signal.SIGKILL
    assert not rank.node_down
    reason = rank.exit_reason(-signal.SIGKILL)
    assert "heartbeat" in reason and "node 1 (nodeb)" in reason and "0.15 s" in reason


def test_send_signal_reaches_the_rank_only_once_bound_and_alive(tmp_path: Path) -> None:
    agent = _agent(tmp_path, 0, "a")
    delivered = _Delivered()
    rank = RemoteRank(5, [agent], delivered)
    rank.send_signal(signal.SIGINT)
    assert delivered == []
    rank.bind(pid=900, host="a", node=0)
    rank.send_signal(signal.SIGINT)
    assert delivered == [(5, signal.SIGINT)]
    assert agent.proc.signals == []  # type: ignore[attr-defined]
    _exit(agent, 0)
    rank.send_signal(signal.SIGUSR1)
    assert delivered == [(5, signal.SIGINT)]


def test_send_signal_survives_a_failing_deliver(tmp_path: Path) -> None:
    def deliver(rank: int, sig: int) -> None:
        raise ConnectionError("socket closed")

    rank = RemoteRank(0, [_agent(tmp_path, 0, "a")], deliver)
    rank.bind(pid=1, host="a", node=0)
    rank.send_signal(signal.SIGINT)


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(5)


def test_kill_tree_stops_the_agent_when_the_rank_does_not_die(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    monkeypatch.setattr(remote, "KILL_WAIT", 0.2)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    mine = subprocess.Popen(["sleep", "60"], start_new_session=True)
    sleepers += [other, mine]
    a0 = AgentProcess(0, "nodea", other, tmp_path / "node-0.log")
    a1 = AgentProcess(1, "nodeb", mine, tmp_path / "node-1.log")
    delivered = _Delivered()
    rank = RemoteRank(1, [a0, a1], delivered)
    rank.bind(pid=31337, host="nodeb", node=1)
    started = time.monotonic()
    rank.kill_tree()
    assert time.monotonic() - started < 1.0
    assert delivered == [(1, signal.SIGKILL)], "first the rank is asked to kill itself"
    assert mine.poll() is not None, "its node's agent was not stopped"
    assert other.poll() is None, "another node's agent was stopped"
    assert rank.poll() is not None
    rank.kill_tree()  # once dead, nothing more
    assert delivered == [(1, signal.SIGKILL)]


def test_kill_tree_does_not_stop_the_agent_when_the_rank_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "KILL_WAIT", 0.5)
    agent = _agent(tmp_path, 0, "a")

    def deliver(rank: int, sig: int) -> None:  # the rank kills itself; torchrun's agent then exits
        _exit(agent, 1)

    rank = RemoteRank(0, [agent], deliver)
    rank.bind(pid=4242, host="a", node=0)
    rank.kill_tree()
    assert rank.poll() == 1
    assert agent.proc.signals == [], "the agent was signalled though the rank died"  # type: ignore[attr-defined]


def test_agent_stop_terminates_a_real_process(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    sleepers.append(proc)
    agent = AgentProcess(0, "a", proc, tmp_path / "x.log")
    assert agent.pid == proc.pid and agent.poll() is None
    agent.stop(grace=2.0)
    assert proc.poll() == -signal.SIGTERM
    agent.stop()  # already ended: nothing to do


# -- Curve ------------------------------------------------------------------------------------------

Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def test_client_env_is_three_z85_keys() -> None:
    keys = CurveKeys.new()
    value = keys.client_env()
    parts = value.split(" ")
    assert parts == [k.decode() for k in (keys.server_public, keys.client_public, keys.client_secret)]
    assert all(len(p) == 40 and set(p) <= Z85 for p in parts)
    assert keys.server_secret.decode() not in value
    assert CurveKeys.new().client_env() != value, "every pool gets fresh keys"


def test_secure_client_takes_the_env_value_apart() -> None:
    keys = CurveKeys.new()
    sock = SimpleNamespace()
    _curve.secure_client(sock, keys.client_env())  # type: ignore[arg-type]
    assert sock.curve_serverkey == keys.server_public
    assert sock.curve_publickey == keys.client_public
    assert sock.curve_secretkey == keys.client_secret


def test_only_the_pools_client_key_gets_in() -> None:
    keys, stranger = CurveKeys.new(), CurveKeys.new()
    check = _OnlyOurClient(keys.client_public)
    assert check.callback("*", keys.client_public) is True
    assert check.refused == 0
    assert check.callback("*", stranger.client_public) is False
    assert check.callback("*", keys.server_public) is False
    assert check.callback("", b"") is False
    assert check.refused == 3
    assert check.callback("*", keys.client_public) is True
    assert check.refused == 3


def test_the_launcher_contract_answers_what_the_pool_asks_without_names() -> None:
    from jupyter_shard.launchers import get_launcher
    from jupyter_shard.launchers.local import LocalLauncher

    local, torchrun, slurm = LocalLauncher(), TorchrunLauncher(), SlurmLauncher()
    assert (local.meets_on_agent_store, torchrun.meets_on_agent_store, slurm.meets_on_agent_store) == (
        False,
        True,
        True,
    )
    assert local.restart_hint == torchrun.restart_hint == "on the same hosts"
    assert slurm.restart_hint == "in a new SLURM allocation"
    assert isinstance(get_launcher("slurm"), SlurmLauncher)
    sent: list[tuple[int, int]] = []
    for launcher in (local, torchrun, slurm):
        launcher.set_signal_sender(lambda rank, sig: sent.append((rank, sig)))
    torchrun.deliver(3, signal.SIGINT)
    slurm.deliver(4, signal.SIGTERM)
    assert sent == [(3, signal.SIGINT), (4, signal.SIGTERM)]


def test_a_remote_rank_says_why_it_never_started_from_its_agents_log(tmp_path: Path) -> None:
    log = tmp_path / "node-0.log"
    log.write_text("ssh: Could not resolve hostname nodeX\n")
    proc = SimpleNamespace(pid=1, poll=lambda: 255)
    agent = remote.AgentProcess(0, "nodeX", proc, log)  # type: ignore[arg-type]
    rank = remote.RemoteRank(0, [agent], lambda r, s: None)
    assert rank.startup_tail() == "ssh: Could not resolve hostname nodeX"
    assert rank.node_down is False
    assert rank.poll() == 255 and rank.node_down is True
    assert remote.RemoteRank(0, [], lambda r, s: None).startup_tail() is None
