"""A rank handle for kernel-side unit tests: a record of a rank that no process backs."""

from __future__ import annotations

from jupyter_shard.launchers.base import RankHandle


class IdleHandle(RankHandle):
    """A rank that never exits; signalling or killing it is a test error."""

    def __init__(self, rank: int, host: str = "elsewhere") -> None:
        self.rank, self.pid, self.host = rank, 0, host

    def poll(self) -> int | None:
        return None

    def send_signal(self, sig: int) -> None:
        raise AssertionError("not used")

    def kill_tree(self) -> None:
        raise AssertionError("not used")

    def wait(self, timeout: float) -> int | None:
        return None
