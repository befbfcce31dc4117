"""Python source for an exported script: values as literals or pickles, cells as plain Python.

What :mod:`~jupyter_shard.export.render` needs to know about code and values: a cell with IPython
syntax goes through IPython's own transform; a value is written as a literal when its ``repr``
reads back equal; a cell run on some ranks is indented under ``if shard.rank ...`` without touching
the inside of its multi-line strings. Pure: strings in, strings out.
"""

from __future__ import annotations

import ast
import io
import json
import pprint
import tokenize
from collections.abc import Sequence
from typing import Any

LITERAL_LIMIT = 64 * 1024  # characters above which a value is pickled even if it reads back as a literal
INDENT = "    "
_CHUNK = 96  # base64 characters per script line


def src(value: object) -> str:
    """Python source for an option value, strings in double quotes as ruff formats them."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def python_source(code: str) -> str:
    """The cell as plain Python: verbatim, or through IPython's transform when it has IPython syntax."""
    from IPython.core.inputtransformer2 import TransformerManager

    code = code if code.endswith("\n") else code + "\n"
    transformed = str(TransformerManager().transform_cell(code))
    return code if transformed == code else transformed


def load(blob: bytes) -> tuple[Any, bool]:
    import cloudpickle

    try:
        return cloudpickle.loads(blob), True
    except Exception:
        return None, False


def literal(value: Any) -> str | None:
    """``value`` as Python source if it reads back equal and of the same type, else None."""
    try:
        text = pprint.pformat(value, width=100, sort_dicts=False)
        if len(text) > LITERAL_LIMIT:
            return None
        back = ast.literal_eval(text)
        same = type(back) is type(value) and bool(back == value)
    except Exception:
        return None
    return text if same else None


def type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def chunks(text: str) -> str:
    if len(text) <= _CHUNK:
        return repr(text)
    parts = [f'{INDENT}"{text[i : i + _CHUNK]}"' for i in range(0, len(text), _CHUNK)]
    return "\n" + "\n".join(parts) + "\n"


def unique_name(name: str, taken: dict[str, bytes]) -> str:
    stem, n, candidate = name.removesuffix(".pkl"), 1, name
    while candidate in taken:
        n += 1
        candidate = f"{stem}-{n}.pkl"
    return candidate


def on_ranks(ranks: tuple[int, ...] | None, code: str) -> str:
    """``code`` as is, or inside ``if shard.rank ...:`` (lines inside multi-line strings kept as they are)."""
    if ranks is None:
        return code
    test = f"== {ranks[0]}" if len(ranks) == 1 else f"in {ranks!r}"
    try:
        empty = not ast.parse(code).body
    except SyntaxError:
        empty = False
    if empty:
        code += "pass\n"
    keep = _string_lines(code)
    lines = code.splitlines(keepends=True)
    body = [line if i in keep or not line.strip() else INDENT + line for i, line in enumerate(lines, start=1)]
    return f"if shard.rank {test}:\n" + "".join(body)


def _string_lines(code: str) -> set[int]:
    """Line numbers that continue a token begun on an earlier line (the inside of a multi-line string)."""
    rows: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.end[0] > token.start[0]:
                rows.update(range(token.start[0] + 1, token.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        pass
    return rows


def uses_name(code: str, name: str) -> bool:
    try:
        return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(ast.parse(code)))
    except SyntaxError:
        return name in code


def uses_unbound_display(blocks: Sequence[str]) -> bool:
    """``display(...)`` with no import or definition of ``display``: IPython's builtin, on the ranks."""
    used, bound = False, False
    for block in blocks:
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "display":
                used |= isinstance(node.ctx, ast.Load)
                bound |= isinstance(node.ctx, ast.Store)
            elif isinstance(node, ast.alias):
                bound |= (node.asname or node.name) == "display"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound |= node.name == "display"
    return used and not bound
