"""The zygote: one preloaded process per interpreter environment that ranks on this host are forked
from, so that torch is imported once, not once per rank and restart.

Two processes, one module each: :mod:`.client` runs in the driving process (the kernel starts a
zygote, asks it to fork ranks and hears how they end), :mod:`.server` runs in the zygote itself
(preload, fork, reap), with :mod:`.cuda_driver`, its check that forking is safe. Only the client's
names are exported here; the zygote process imports the server by name.
"""

from jupyter_shard.launchers.zygote.client import (
    ENV_SWITCH,
    ZygoteClient,
    ZygoteUnavailable,
    close_all,
    close_idle,
    enabled,
    failure,
    interpreter_key,
    mark_failed,
    zygote_for,
)

__all__ = [
    "ENV_SWITCH",
    "ZygoteClient",
    "ZygoteUnavailable",
    "close_all",
    "close_idle",
    "enabled",
    "failure",
    "interpreter_key",
    "mark_failed",
    "zygote_for",
]
