"""Byte counts as people read them, for every layer's messages."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(size: float) -> str:
    """``1.8 GiB``, ``512.0 MiB``, ``3.0 KiB``, ``12 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"
