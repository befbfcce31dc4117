"""The environment contract between the kernel, the zygote, the launchers and a rank, declared once.

The kernel writes a :class:`RankEnv` into each rank's environment (:meth:`RankEnv.to_env`); a rank
reads it back at start-up (:meth:`RankEnv.from_env`). Between them, a zygote or a node agent may
drop or replace parts: an agent sets the torch launcher variables of its own ranks
(:data:`PER_RANK`), a zygote keeps none of the pool's variables in its own environment
(:func:`without_pool_variables`), and the secrets (:data:`SECRETS`) never go on a command line.
The user-facing switches (log and runtime directories, start timeout, zygote, metrics directory)
are named here too, so every ``JUPYTER_SHARD_*`` name is in this one module.

Nothing here imports from the kernel, the rank, the launchers or the notebook layer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CURVE",
    "KEY",
    "NODE",
    "PER_RANK",
    "PREFIX",
    "SECRETS",
    "RankEnv",
    "pop_secrets",
    "progress_lines",
    "without_per_rank",
    "without_pool_variables",
]

PREFIX = "JUPYTER_SHARD_"

KEY = PREFIX + "KEY"  # the pool's HMAC key, hex; popped from os.environ as the rank starts
CURVE = PREFIX + "CURVE"  # CurveZMQ client keys of a pool whose ranks dial back over TCP
SECRETS = (KEY, CURVE)

ADDRESS = PREFIX + "ADDRESS"
DIRECT = PREFIX + "DIRECT"  # the kernel's Unix socket for local ranks' direct links
STORE = PREFIX + "STORE"
MAX_FRAME_VAR = PREFIX + "MAX_FRAME"
LIFELINE_FD = PREFIX + "LIFELINE_FD"
PARENT_PID = PREFIX + "PARENT_PID"
DEVICE = PREFIX + "DEVICE"
STRATEGY = PREFIX + "STRATEGY"
OPTIONS = PREFIX + "OPTIONS"
TIMEOUT = PREFIX + "TIMEOUT"
LOG = PREFIX + "LOG"
RANK_LOGS = PREFIX + "RANK_LOGS"
NODE = PREFIX + "NODE"  # set per node by the torchrun and SLURM launchers

# User-facing settings, read where they apply (``_VAR``: the variable's name, not its value).
ZYGOTE_SWITCH = PREFIX + "ZYGOTE"  # "0" spawns every rank instead of forking it from a zygote
LOG_DIR_VAR = PREFIX + "LOG_DIR"
RUNTIME_DIR_VAR = PREFIX + "RUNTIME_DIR"
START_TIMEOUT_VAR = PREFIX + "START_TIMEOUT"
METRICS_DIR_VAR = PREFIX + "METRICS_DIR"  # where an exported script writes its shard.log records
CHECK_PROTOCOL_VAR = PREFIX + "CHECK_PROTOCOL"
# "0": no live progress lines in the kernel (suspend, resume, the dry run's tracing), for a notebook
# run whose outputs are kept (nbconvert, papermill, nbval), which would store the line's fragments
PROGRESS_SWITCH = PREFIX + "PROGRESS"
SHARED_MEMORY_VAR = PREFIX + "SHARED_MEMORY"  # "0": pushes and pulls travel in messages only

# What torchrun gives each worker (torch.distributed.elastic's local agent), so that libraries which
# check how they were launched (torch.distributed.is_torchelastic_launched, Lightning's
# TorchElasticEnvironment) see a torchrun launch.
TORCH_PER_RANK = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
)
# Per-rank variables the pool sets for a local rank; a node agent (torchrun) sets its own.
PER_RANK = (*TORCH_PER_RANK, LIFELINE_FD, PARENT_PID, STORE, LOG, DIRECT)


@dataclass(frozen=True)
class RankEnv:
    """What one rank is told: who it is in the world, where the kernel is, what to build.

    ``store``, ``lifeline_fd``, ``parent_pid``, ``log`` and ``direct`` are set for ranks this machine
    starts directly; ``curve`` and ``rank_logs`` for ranks that dial back over TCP from a node agent.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_port: int
    key: str
    address: str
    max_frame: int
    device: str
    strategy: str
    timeout: float
    options: Mapping[str, Any] = field(default_factory=dict)
    group_rank: int = 0
    group_world_size: int = 1
    master_addr: str = "127.0.0.1"
    run_id: str = "none"  # torchrun's rendezvous id; the pool's name for local ranks
    error_file: str | None = None  # where torch.distributed.elastic's @record writes a failure
    store: str | None = None
    lifeline_fd: int | None = None
    parent_pid: int | None = None
    log: str | None = None
    curve: str | None = None
    rank_logs: str | None = None
    node: int | None = None
    direct: str | None = None  # where the kernel accepts direct links (:mod:`jupyter_shard.pool.links`)
    check_protocol: str | None = None  # a file: every message signed is checked and recorded there

    def to_env(self) -> dict[str, str]:
        """The variables, as a launcher passes them to the rank process."""
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(self.group_world_size),
            "ROLE_RANK": str(self.rank),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            KEY: self.key,
            ADDRESS: self.address,
            MAX_FRAME_VAR: str(self.max_frame),  # one message limit on both ends
            DEVICE: self.device,
            STRATEGY: self.strategy,
            OPTIONS: json.dumps(dict(self.options)),
            TIMEOUT: str(self.timeout),
        }
        optional = {
            "TORCHELASTIC_ERROR_FILE": self.error_file,
            STORE: self.store,
            LIFELINE_FD: self.lifeline_fd,
            PARENT_PID: self.parent_pid,
            LOG: self.log,
            CURVE: self.curve,
            RANK_LOGS: self.rank_logs,
            NODE: self.node,
            DIRECT: self.direct,
            CHECK_PROTOCOL_VAR: self.check_protocol,
        }
        env.update({name: str(value) for name, value in optional.items() if value is not None})
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RankEnv:
        """Read the variables back in the rank (those of a node agent included)."""

        def number(name: str) -> int | None:
            value = environ.get(name)
            return int(value) if value else None

        return cls(
            rank=int(environ["RANK"]),
            local_rank=int(environ["LOCAL_RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE") or environ["WORLD_SIZE"]),
            group_rank=int(environ.get("GROUP_RANK") or 0),
            group_world_size=int(environ.get("GROUP_WORLD_SIZE") or 1),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            run_id=environ.get("TORCHELASTIC_RUN_ID") or "none",
            error_file=environ.get("TORCHELASTIC_ERROR_FILE") or None,
            master_port=int(environ.get("MASTER_PORT") or 0),
            key=environ[KEY],
            address=environ[ADDRESS],
            max_frame=int(environ.get(MAX_FRAME_VAR) or 0),
            device=environ[DEVICE],
            strategy=environ[STRATEGY],
            timeout=float(environ[TIMEOUT]),
            options=json.loads(environ.get(OPTIONS) or "{}"),
            store=environ.get(STORE),
            lifeline_fd=number(LIFELINE_FD),
            parent_pid=number(PARENT_PID),
            log=environ.get(LOG),
            curve=environ.get(CURVE) or None,
            rank_logs=environ.get(RANK_LOGS),
            node=number(NODE),
            direct=environ.get(DIRECT) or None,
            check_protocol=environ.get(CHECK_PROTOCOL_VAR) or None,
        )

    @property
    def node_index(self) -> int:
        """The node this rank runs on: the launcher's count, else torchrun's group rank."""
        return self.node if self.node is not None else self.group_rank


def progress_lines(environ: Mapping[str, str] | None = None) -> bool:
    """Whether long work shows its live line (unless ``JUPYTER_SHARD_PROGRESS=0``)."""
    return (os.environ if environ is None else environ).get(PROGRESS_SWITCH, "1").strip() != "0"


def pop_secrets(environ: MutableMapping[str, str]) -> None:
    """Remove the pool's key and Curve keys, so cells and the processes they start do not see them."""
    for name in SECRETS:
        environ.pop(name, None)


def without_per_rank(env: Mapping[str, str]) -> dict[str, str]:
    """A rank's environment for a node agent: the per-rank variables removed (it sets its own)."""
    return {k: v for k, v in env.items() if k not in PER_RANK}


def without_pool_variables(env: Mapping[str, str]) -> dict[str, str]:
    """An environment with every ``JUPYTER_SHARD_*`` variable removed (the kernel's own, a zygote's)."""
    return {k: v for k, v in env.items() if not k.startswith(PREFIX)}


def is_pool_variable(name: str) -> bool:
    """Whether ``name`` is one of the pool's ``JUPYTER_SHARD_*`` variables."""
    return name.startswith(PREFIX)
