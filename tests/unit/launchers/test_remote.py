"""jupyter_shard.launchers.remote: interfaces and addresses of this machine, the environment agents get,
RemoteRank's view of its node agent.

No torch, no SLURM, no ranks: agents are fakes shaped like Popen or short-lived ``sleep`` processes.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from jupyter_shard.env import KEY as KEY_ENV
from jupyter_shard.env import PER_RANK as PER_RANK_ENV
from jupyter_shard.launchers import remote
from jupyter_shard.launchers.remote import AgentProcess, RemoteRank, job_env, resolve_interface
from jupyter_shard.launchers.slurm import SlurmLauncher
from jupyter_shard.launchers.torchrun import TorchrunLauncher
from jupyter_shard.spec import SpecError
from tests.unit.launchers._helpers import ELSEWHERE, KEY, _FakeProc, _lo_address, _one_line, _spec

# -- interfaces and addresses -----------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
@pytest.mark.parametrize("choice", ["lo", "127.0.0.1"])
def test_interface_lo_or_its_address_resolves_to_loopback(launcher: str, choice: str) -> None:
    spec = _spec(launcher=launcher, interface=choice, **({"nodes": 2} if launcher == "slurm" else {}))
    launcher_obj = TorchrunLauncher() if launcher == "torchrun" else SlurmLauncher()
    assert launcher_obj.bind_address(spec) == "127.0.0.1"


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
