"""What a dry run returns: a :class:`Plan` per strategy, the :class:`Plans` of one call (with the
plans that could not be traced), and the :class:`Progress` line a call over several plans shows.

Why it exists: the picker, ``find_batch`` and user code read these; the tracing in
:mod:`jupyter_shard.planner.dry_run` makes them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_shard.env import progress_lines
from jupyter_shard.errors import SpecError


class Plans(dict[str, "Plan"]):
    """The plans of one call by name; ``failed`` holds, by name, the one line each plan that could not
    be traced failed with (the rest are still planned: a plan that fails does not sink the others)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: dict[str, str] = {}

    def __missing__(self, name: str) -> Plan:
        if name in self.failed:  # the reason, not a bare KeyError
            raise SpecError(f"{name} was not planned: {self.failed[name]}")
        raise KeyError(name)


class Progress:
    """One live line on stderr while a call traces several plans (``dry run: tracing fsdp FULL_SHARD,
    2 of 6...``), shown from ``quiet_for`` seconds on and cleared at the end; none under
    ``JUPYTER_SHARD_PROGRESS=0``."""

    def __init__(self, total: int, quiet_for: float = 1.0) -> None:
        self.total, self.count, self.started, self.shown = total, 0, time.monotonic(), 0
        self.quiet_for = quiet_for

    def tracing(self, name: str) -> None:
        self.count += 1
        if self.total > 1 and progress_lines() and time.monotonic() - self.started >= self.quiet_for:
            self._show(f"dry run: tracing {name}, {self.count} of {self.total}... (Ctrl-C stops it)")

    def stopped(self) -> None:
        if self.total > 1:
            self._show(f"dry run stopped by Ctrl-C while tracing plan {self.count} of {self.total}\n")
            self.shown = 0

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r" + " " * self.shown + "\r")
            sys.stderr.flush()
            self.shown = 0

    def _show(self, text: str) -> None:
        sys.stderr.write("\r" + text.ljust(self.shown))
        sys.stderr.flush()
        self.shown = len(text.rstrip("\n"))


@dataclass(frozen=True)
class Plan:
    """What one rank holds at the peak of a training step with one strategy, in bytes.

    ``parameters``, ``gradients``, ``optimizer``, ``activations`` and ``transient`` (gathered
    parameters, collective and bucket buffers, backward temporaries) are the breakdown at the peak,
    so they add up to ``peak_bytes``, the device's. ``host_bytes`` is what an offload plan keeps in
    host memory (split from the trace by role, :data:`OFFLOAD`), 0 for the others. ``precision`` is
    the ``--precision`` the plan was traced with.
    ``largest_unit`` is the name and whole size of the largest group of parameters gathered at once
    (None where parameters are never gathered). ``source`` says, per figure, whether it was traced or
    comes from a formula, and how far off that has been.
    """

    strategy: str
    options: dict[str, Any]
    world_size: int
    device: str
    peak_bytes: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    transient: int
    host_bytes: int = 0
    largest_unit: tuple[str, int] | None = None
    source: dict[str, str] = field(default_factory=dict)
    precision: str = "32"
    #: a CUDA plan's peak of the caching allocator's reserved segments (``max_memory_reserved``), at
    #: least ``peak_bytes``; 0 for a CPU plan
    reserved_bytes: int = 0


def ds_estimate() -> str:
    """Whether DeepSpeed's own estimator could be consulted (it assumes fp16 training on GPUs)."""
    try:
        from deepspeed.runtime.zero import stage3

        present = hasattr(stage3, "estimate_zero3_model_states_mem_needs_all_cold")
    except Exception:
        present = False
    where = "importable" if present else "not installed"
    return f"DeepSpeed's estimate_zero3_model_states_mem_needs_all_cold is {where} and assumes fp16 on GPUs"
