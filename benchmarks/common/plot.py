"""Plots are drawn to files on machines with no display: matplotlib's Agg backend, imported only
when a benchmark draws (matplotlib is in the ``bench`` extra)."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
