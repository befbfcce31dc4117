"""The prompts of one cell's ranks (``input()``, pdb), put to a person one at a time, in rank order,
each named by its rank: ``[rank 1] (Pdb)``.

A prompt is shown once the output its rank wrote before it has arrived (the request's ``io_count``,
or after :data:`OUTPUT_WAIT`), so the person reads what led to it first. The answer goes to that rank
only, and the exchange is written into the rank's own output (its tab in JupyterLab, its
``[rank k]`` lines elsewhere), except a password. Where no one can answer, every waiting rank is told
why at once; a background run says that a rank waits and keeps the prompt for ``%dist_wait``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jupyter_shard.pool.output import RankSink
from jupyter_shard.pool.ranks import RankRecord, RankTable
from jupyter_shard.pool.stdin import EOF, StdinSource
from jupyter_shard.wire.messages import ANSWER
from jupyter_shard.wire.protocol import Message

__all__ = ["Prompts"]

OUTPUT_WAIT = 2.0  # seconds a prompt waits for its rank's earlier output before it is shown anyway
TOGETHER = 0.1  # prompts that come within this of the first are "at once": asked in rank order

Send = Callable[[Sequence[RankRecord], str, dict[str, Any]], None]


def _debugging(prompt: str) -> bool:
    return "(Pdb)" in prompt or "ipdb>" in prompt


def refusal(rank: int, prompt: str, why: str) -> str:
    """What a rank's ``input()`` or pdb raises when no one can answer: why, and what to do instead."""
    if _debugging(prompt):
        return (
            f"pdb on rank {rank} needs the notebook's input box, but {why}. Debug in JupyterLab or "
            f"Notebook; without a prompt, look with print(), %dist_stacks or %dist_pull NAME --rank {rank}"
        )
    return (
        f"input() on rank {rank} needs the notebook's input box, but {why}. Run the cell in JupyterLab "
        "or Notebook, pass Pool(stdin=...) from a script, or %dist_push the value instead"
    )


class Prompts:
    """The prompts a cell's ranks wait at; :meth:`serve` runs each step of the cell."""

    def __init__(self) -> None:
        self.waiting: dict[int, tuple[Message, float]] = {}  # rank -> its request, when it came
        self.asking: tuple[int, StdinSource] | None = None
        self._told: set[int] = set()  # ranks of a background run said to wait for %dist_wait
        self._lock = threading.Lock()  # a background run: its watcher tells, %dist_wait's thread asks

    def add(self, r: RankRecord, msg: Message) -> None:
        self.waiting[r.rank] = (msg, time.monotonic())
        r.waiting = str(msg.body["prompt"]).strip() or "input()"

    @staticmethod
    def refuse(send: Send, r: RankRecord, why: str) -> None:
        send([r], *ANSWER({"value": "", "error": why, "eof": False}))
        r.waiting = ""

    def serve(self, ranks: RankTable, source: StdinSource | None, send: Send, sink: RankSink) -> None:
        """Show the next prompt, or pass on the answer to the one shown; with no ``source`` (a
        background run's watcher), say which ranks wait."""
        with self._lock:
            self._serve(ranks, source, send, sink)

    def _serve(self, ranks: RankTable, source: StdinSource | None, send: Send, sink: RankSink) -> None:
        if self.asking is not None and source is not None:
            rank, asked = self.asking
            answer = asked.poll()
            if answer is None:
                return
            self.asking = None
            msg, _ = self.waiting.pop(rank)
            r = ranks[rank]
            r.waiting = ""
            value = "" if answer is EOF else str(answer)
            send([r], *ANSWER({"value": value, "error": "", "eof": answer is EOF}))
            if not msg.body["password"]:
                sink.stream(rank, "stdout", f"{msg.body['prompt']}{value}\n")
        now = time.monotonic()
        if not self.waiting or now - min(since for _, since in self.waiting.values()) < TOGETHER:
            return
        ready = [
            k
            for k, (msg, since) in sorted(self.waiting.items())
            if ranks[k].io_received >= int(msg.body["io_count"]) or now - since > OUTPUT_WAIT
        ]
        if not ready or self.asking is not None:
            return
        if source is None:
            # when the pool's watcher steps a background run: %dist_wait's thread asks
            for k in ready:
                if k not in self._told:
                    self._told.add(k)
                    prompt = str(self.waiting[k][0].body["prompt"]).strip() or "input()"
                    sink.notice(f"rank {k} is waiting at a prompt ({prompt}): %dist_wait shows it")
            return
        why = source.unavailable()
        if why:
            for k in ready:
                msg, _ = self.waiting.pop(k)
                self.refuse(send, ranks[k], refusal(k, str(msg.body["prompt"]), why))
            return
        rank = ready[0]
        msg, _ = self.waiting[rank]
        sink.flush()
        source.start(f"[rank {rank}] {msg.body['prompt']}", bool(msg.body["password"]))
        self.asking = (rank, source)
