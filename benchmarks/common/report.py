"""A benchmark's results section: its targets as a table and as the ``<!-- target: … -->`` lines that
``run_all.py`` collects, and writing the section (or only printing it, for ``--results -``).

A target line reads ``<!-- target: <what is promised> | <measured value> | met -->``; the last field
is ``met``, ``not met`` or ``n/a`` (not measured in this run), and the first two contain no ``|``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

TARGET_LINE = re.compile(
    r"^<!--\s*target:\s*(?P<name>[^|]+?)\s*\|\s*(?P<value>[^|]*?)\s*\|\s*(?P<met>met|not met|n/a)\s*-->\s*$"
)


def met(ok: bool | None) -> str:
    """The last field of a target line: None is a target not measured in this run."""
    return "n/a" if ok is None else "met" if ok else "not met"


def target_line(name: str, value: str, ok: bool | None) -> str:
    return f"<!-- target: {name} | {value} | {met(ok)} -->"


def target_table(targets: Iterable[tuple[str, str, bool | None]]) -> list[str]:
    """The targets as a markdown table, then as target lines."""
    goals = list(targets)
    out = ["| target | measured | |", "|---|---:|---|"]
    out += [f"| {name} | {value} | {met(ok)} |" for name, value, ok in goals]
    return [*out, "", *(target_line(*goal) for goal in goals)]


def write_section(text: str, results: str) -> None:
    """Print the section and write it to ``results``, unless that is ``-``."""
    print(text)
    if results != "-":
        path = Path(results)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"written to {path}")
