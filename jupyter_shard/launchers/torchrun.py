"""``--launcher torchrun``: ranks started by ``torch.distributed.run`` agents, one per node.

- ``--hosts a,b``: one agent per host. A host that is this machine gets its agent as a local process;
  any other host gets it over ``ssh`` (``ssh -o BatchMode=yes host``; the same Python path and working
  directory are assumed there, as on a cluster with a shared file system). The pool key and the Curve
  client keys go to the remote agent on ssh's stdin, never on a command line.
- No ``--hosts``: one node is this machine; with ``--nodes N`` > 1 the pool prints the command to run
  on each node (keys read from a 0600 file) and waits for the nodes to join.

The agents meet through torch's static rendezvous: each is told its node's index, and node 0 hosts a
TCPStore, bound to the address the other nodes reach it by (:mod:`~jupyter_shard.launchers.node_agent`);
nothing in it is pickled. Ranks then build their process group on that store. Every rank dials back to the
kernel at the address :meth:`TorchrunLauncher.bind_address` chose.
"""

from __future__ import annotations

import os
import shlex
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from jupyter_shard._util.net import free_port
from jupyter_shard.env import CURVE, KEY, NODE, PREFIX, SECRETS
from jupyter_shard.launchers.base import RankHandle, RankLaunch
from jupyter_shard.launchers.commands import agent_args, agent_command
from jupyter_shard.launchers.remote import (
    AgentProcess,
    KeptAgents,
    RemoteRank,
    interfaces_here,
    is_this_machine,
    job_env,
    need_interface,
    resolve_interface,
    spawn_agent,
)
from jupyter_shard.spec import LauncherOptions, LaunchSpec, SpecError

RDZV_PORT = 29400  # torchrun's own default, for a first node that is not this machine


@dataclass(frozen=True)
class TorchrunOptions(LauncherOptions):
    """``--hosts``: one host per node (ssh, or here for this machine); ``--interface``: where the
    ranks dial back, an interface name or an address of this machine."""

    hosts: tuple[str, ...] = field(default=(), metadata={"hint": "one host per node"})
    interface: str | None = field(default=None, metadata={"hint": "remote ranks"})

    def check(self, nodes: int) -> None:
        if self.hosts and len(self.hosts) != nodes:
            raise SpecError(
                f"--hosts names {len(self.hosts)} host(s) but --nodes is {nodes}; give one host per node"
            )


def options_of(spec: LaunchSpec) -> TorchrunOptions:
    """The spec's torchrun options (their defaults for a spec built without them)."""
    options = spec.launcher_options
    return options if isinstance(options, TorchrunOptions) else TorchrunOptions()


class TorchrunLauncher(KeptAgents):
    name: ClassVar[str] = "torchrun"
    remote: ClassVar[bool] = True
    meets_on_agent_store: ClassVar[bool] = True
    options_type: ClassVar[type[LauncherOptions]] = TorchrunOptions

    @classmethod
    def parse_options(cls, given: Mapping[str, object], nodes: int) -> tuple[LauncherOptions, int]:
        hosts = _hosts(given.get("hosts"))  # type: ignore[arg-type]
        if hosts:
            if nodes not in (1, len(hosts)):
                raise SpecError(
                    f"--hosts names {len(hosts)} host(s) but --nodes is {nodes}; give one host per node"
                )
            nodes = len(hosts)
        interface = given.get("interface")
        return TorchrunOptions(hosts, None if interface is None else str(interface)), nodes

    def __init__(self) -> None:
        self.agents: list[AgentProcess] = []
        self._manual: str = ""

    def _hosts(self, spec: LaunchSpec) -> list[str]:
        hosts = options_of(spec).hosts
        return list(hosts) if hosts else ["localhost"] * (1 if spec.nodes == 1 else 0)

    def bind_address(self, spec: LaunchSpec) -> str:
        hosts = self._hosts(spec)
        elsewhere = [h for h in hosts if not is_this_machine(h)]
        interface = options_of(spec).interface
        if interface is not None:
            address = resolve_interface(interface)
            if address.startswith("127.") and elsewhere:
                where = ", ".join(elsewhere)
                raise SpecError(
                    f"--interface {interface} is loopback, which {where} cannot reach; "
                    f"give an interface of this machine they can reach ({interfaces_here()})"
                )
            return address
        if hosts and not elsewhere:
            return "127.0.0.1"
        if not hosts:
            raise need_interface(f"--nodes {spec.nodes} without --hosts runs ranks on other machines")
        others = ", ".join(h for h in hosts if not is_this_machine(h))
        raise need_interface(f"ranks on {others} are not on this machine")

    def start(self, spec: LaunchSpec, ranks: list[RankLaunch], lifeline_fd: int) -> list[RankHandle]:
        base = job_env(ranks[0].env)
        log_dir = ranks[0].log_path.parent
        hosts = self._hosts(spec)
        local = bool(hosts) and all(is_this_machine(h) for h in hosts)
        if not local:
            base.pop("GLOO_SOCKET_IFNAME", None)  # this machine's loopback name means nothing there
            base.pop("NCCL_SOCKET_IFNAME", None)
        # How the other nodes reach each node: as the user named it, and this machine (named
        # "localhost" or by one of its addresses) by the --interface address, else its host name.
        interface = options_of(spec).interface
        here = resolve_interface(interface) if interface is not None else socket.gethostname()
        reach = ["127.0.0.1" if local else (here if is_this_machine(h) else h) for h in hosts]
        first = reach[0] if hosts else "NODE0"
        port = str(free_port() if hosts and is_this_machine(hosts[0]) else RDZV_PORT)
        rdzv_id = f"jupyter_shard-{uuid.uuid4().hex[:12]}"
        cwd, pool_dir = ranks[0].cwd, ranks[0].pool_dir

        def agent_cmd(node: int) -> list[str]:
            # Node 0 hosts the rendezvous store (which the ranks' process groups use too), so losing
            # another node leaves it standing; losing node 0 ends every node.
            options = agent_args(str(spec.nodes), spec.nproc, str(node), first, port, rdzv_id)
            # Peers reach this node's store and ranks by the name the user gave it, not its own FQDN.
            options += ["--local-addr", reach[node]]
            return agent_command(options)

        try:
            for node, host in enumerate(hosts):
                env = {**base, NODE: str(node)}
                log = log_dir / f"node-{node}.log"
                if is_this_machine(host):
                    agent = spawn_agent(
                        node, host, agent_cmd(node), env, log, cwd, lifeline_fd, pool_dir=pool_dir
                    )
                else:
                    command, secrets = _ssh_command(host, env, agent_cmd(node), cwd)
                    public = {k: v for k, v in os.environ.items() if k not in SECRETS}
                    agent = spawn_agent(
                        node, host, command, public, log, cwd, lifeline_fd, stdin=secrets, pool_dir=pool_dir
                    )
                self.agents.append(agent)
        except BaseException:
            self.stop()
            raise
        if not hosts:
            options = agent_args(str(spec.nodes), spec.nproc, "K", first, port, rdzv_id)
            self._manual = _manual_instructions(spec, base, options, log_dir, cwd)
        return [RemoteRank(launch.rank, self.agents, self.signal_rank) for launch in ranks]

    def waiting(self) -> str | None:
        return self._manual or None

    def started_note(self) -> str:
        hosts = ", ".join(sorted({a.host for a in self.agents})) or "the nodes that joined"
        return f"torchrun agents on {hosts}; agent logs next to the rank logs"

    def local_pids(self) -> list[int]:
        return [a.pid for a in self.agents]

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()


def _ssh_command(host: str, env: dict[str, str], agent: list[str], cwd: Path) -> tuple[list[str], bytes]:
    """``ssh host <script>`` where the script reads the secrets from stdin; and those secrets."""
    exported = " ".join(
        f"{k}={shlex.quote(v)}"
        for k, v in sorted(env.items())
        if k.startswith((PREFIX, "OMP_", "PYTHON")) and k not in SECRETS
    )
    run = shlex.join(agent)
    script = (
        f"read -r {KEY} && read -r {CURVE} && export {KEY} {CURVE} && "
        f"cd {shlex.quote(str(cwd))} && exec env {exported} {run}"
    )
    secrets = f"{env[KEY]}\n{env[CURVE]}\n".encode()
    return ["ssh", "-o", "BatchMode=yes", host, script], secrets


def _manual_instructions(
    spec: LaunchSpec, env: dict[str, str], options: list[str], log_dir: Path, cwd: Path
) -> str:
    """Write the job's environment to a 0600 file; the line to run on every node."""
    path = log_dir / "node.env"
    wanted = {k: v for k, v in env.items() if k.startswith((PREFIX, "OMP_"))}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(wanted.items())))
    run = shlex.join(agent_command(options))
    return (
        f"waiting for {spec.nodes} nodes to join; on each node run (the file holds the pool's keys: copy it "
        f"there if {log_dir} is not shared, and keep it private):\n"
        f"  cd {shlex.quote(str(cwd))} && . {shlex.quote(str(path))} && {run}\n"
        f"where K is the node's index (0 on the first node, then 1 to {spec.nodes - 1}, each once) and NODE0 "
        "the first node's host name; interrupt the cell to give up"
    )


def _hosts(hosts: str | Sequence[str] | None) -> tuple[str, ...]:
    if hosts is None:
        return ()
    items = hosts.split(",") if isinstance(hosts, str) else list(hosts)
    names = tuple(h.strip() for h in items)
    if not names or any(not h or h.startswith("-") or any(c.isspace() for c in h) for h in names):
        raise SpecError(f"--hosts {hosts!r} is not valid; give host names like node1,node2")
    return names
