"""A ``%%distributed`` cell's value, as a notebook cell's own.

``Out[n]`` and ``_`` hold the object that the lowest rank the cell ran on (rank 0 for a cell on all
ranks) gave as its last expression: a copy in the kernel, its tensors on the CPU, when it pickles to
at most :data:`OUT_LIMIT`. A larger value (a whole model, say) or one that cannot be pickled is
shown but not copied; ``Out[n]`` is then a :class:`ShownOnly` that says so. The display is the
ranks' own (the repr a rank made, so a CUDA tensor reads ``device='cuda:0'``): one value when every
rank's display agrees, each rank's, labelled, when they differ, also when the lowest rank's value is
``None``. :func:`jupyter_shard.last_values` copies every rank's value.
"""

from __future__ import annotations

import html
from typing import Any

from IPython.core.interactiveshell import InteractiveShell
from IPython.display import display

from jupyter_shard.errors import PoolError
from jupyter_shard.pool.pool import Pool
from jupyter_shard.pool.results import RunResult

__all__ = ["OUT_LIMIT", "ShownOnly", "cell_value", "shown_bundle"]

OUT_LIMIT = 16 * 2**20  # bytes pickled: a value up to this is copied to the kernel for Out[n]


class ShownOnly:
    """``Out[n]`` for a value that was shown but not copied to the kernel."""

    def __init__(self, rank: int, bundle: dict[str, Any], why: str) -> None:
        self.rank = rank
        self.bundle = bundle
        self.why = why

    def __repr__(self) -> str:
        return f"<rank {self.rank}'s value, shown but not copied to the kernel: {self.why}>"


def shown_bundle(result: RunResult) -> dict[str, Any] | None:
    """What the cell shows as its value: the ranks' display when they all agree, else each rank's
    labelled; None when no rank ended its cell with a value."""
    bundles = {k: r.result for k, r in sorted(result.ranks.items())}
    valued = {k: b for k, b in bundles.items() if b is not None}
    if not valued:
        return None
    first = next(iter(bundles.values()))
    if all(b == first for b in bundles.values()):
        return first
    return _labelled(valued)


def cell_value(pool: Pool, result: RunResult, shell: InteractiveShell | None) -> Any:
    """The object for ``Out[n]`` (None for none), with the kernel's display hook set to show
    :func:`shown_bundle` for it; a cell whose lowest rank gave no value shows the others' here."""
    bundle = shown_bundle(result)
    if bundle is None:
        return None
    lowest = min(result.ranks)
    if result.ranks[lowest].result is None or shell is None:
        display(bundle, raw=True)  # Out[n] stays unset, as after a cell ending in a statement
        return None
    value: Any
    try:
        value = pool.last_value(lowest, OUT_LIMIT)
    except PoolError as exc:
        why = str(exc)
        value = ShownOnly(
            lowest, bundle, why if "could not be pickled" in why else f"{why} (last_values() copies it)"
        )
    _show_once_as(shell, value, bundle)
    return value


def _show_once_as(shell: InteractiveShell, value: Any, bundle: dict[str, Any]) -> None:
    """Have the display hook's next call show ``bundle`` for ``value`` (it still files ``value`` as
    ``Out[n]`` and ``_``); any other object is formatted as usual, and the override is gone either way."""
    hook: Any = shell.displayhook
    formatted = type(hook).compute_format_data

    def once(result: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        del hook.compute_format_data  # the class's own method again
        if result is value:
            return dict(bundle), {}
        out: tuple[dict[str, Any], dict[str, Any]] = formatted(hook, result)
        return out

    hook.compute_format_data = once


def _labelled(valued: dict[int, dict[str, Any]]) -> dict[str, Any]:
    text = "\n".join(_label(k, str(b.get("text/plain", ""))) for k, b in valued.items())
    bundle: dict[str, Any] = {"text/plain": text}
    if any("text/html" in b for b in valued.values()):
        bundle["text/html"] = "".join(
            f"<div><b>[rank {k}]</b></div>"
            + (b.get("text/html") or f"<pre>{html.escape(str(b.get('text/plain', '')))}</pre>")
            for k, b in valued.items()
        )
    return bundle


def _label(rank: int, text: str) -> str:
    lines = text.splitlines() or [""]
    pad = " " * len(f"[rank {rank}] ")
    return "\n".join([f"[rank {rank}] {lines[0]}", *(pad + line for line in lines[1:])])
