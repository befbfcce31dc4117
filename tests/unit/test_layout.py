"""The package's shape: no import cycles (function-level imports included), layers that point down,
no module over 500 lines. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jupyter_shard"
MAX_LINES = 500

# What each room must never import. The notebook layer sits on top; the pool (the driving side) and
# the ranks meet only through the wire, the transfer helpers and the contracts at the root (errors,
# spec, env, gpus); _util knows nothing of pools or ranks.
FORBIDDEN = {
    "jupyter_shard.pool": ("jupyter_shard.notebook", "jupyter_shard.rank", "jupyter_shard.export"),
    "jupyter_shard.rank": ("jupyter_shard.notebook", "jupyter_shard.pool", "jupyter_shard.launchers"),
    "jupyter_shard.launchers": ("jupyter_shard.notebook", "jupyter_shard.pool"),
    "jupyter_shard.rank.integrations": (
        "jupyter_shard.notebook",
        "jupyter_shard.pool",
        "jupyter_shard.launchers",
    ),
    "jupyter_shard.strategies": ("jupyter_shard.notebook", "jupyter_shard.pool", "jupyter_shard.launchers"),
    "jupyter_shard.planner": ("jupyter_shard.notebook",),
    "jupyter_shard.export": ("jupyter_shard.notebook",),
    "jupyter_shard.wire": ("jupyter_shard.",),
    "jupyter_shard.transfer": ("jupyter_shard.",),
    "jupyter_shard._util": ("jupyter_shard.",),
    "jupyter_shard.env": ("jupyter_shard.pool", "jupyter_shard.rank", "jupyter_shard.launchers"),
    "jupyter_shard.spec": ("jupyter_shard.pool", "jupyter_shard.launchers", "jupyter_shard.notebook"),
    "jupyter_shard.errors": ("jupyter_shard.",),
    "jupyter_shard.gpus": ("jupyter_shard.",),
}
# Exceptions to FORBIDDEN, by room: what it may import although the rule above names it.
ALLOWED_FOR = {
    "jupyter_shard.wire": (
        "jupyter_shard.env",
        "jupyter_shard.errors",
        "jupyter_shard.wire.messages",
        "jupyter_shard.wire.protocol",
        "jupyter_shard.wire.curve",
    ),
    "jupyter_shard.transfer": (
        "jupyter_shard.errors",
        "jupyter_shard.wire.messages",
        "jupyter_shard.transfer.mapping",
        "jupyter_shard.transfer.pickling",
        "jupyter_shard.transfer.segments",
        "jupyter_shard.transfer.peer_memory",
    ),
    "jupyter_shard._util": (
        "jupyter_shard._util.net",
        "jupyter_shard._util.atomic",
        "jupyter_shard._util.plugins",
    ),
    "jupyter_shard.gpus": ("jupyter_shard.errors",),
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk_runtime(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that runs, leaving out ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(tree):
        if _type_checking_block(child):
            continue
        yield child
        yield from _walk_runtime(child)


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports when it runs, at any level (functions included)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _walk_runtime(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and target != "jupyter_shard":
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(GRAPH):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_reader_sees_imports() -> None:
    """The checks below are only worth something if imports are found at all."""
    assert "jupyter_shard.pool.connection" in GRAPH["jupyter_shard.pool.pool"]
    assert "jupyter_shard.notebook.display" in GRAPH["jupyter_shard"]  # a function-level import


def test_no_import_cycles() -> None:
    assert _cycle() is None, " -> ".join(_cycle() or [])


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_point_down(layer: str) -> None:
    wrong = []
    for name, imported in GRAPH.items():
        if name != layer and not name.startswith(layer + "."):
            continue
        for target in imported:
            allowed = ALLOWED_FOR.get(layer, ())
            if target.startswith(FORBIDDEN[layer]) and target not in allowed:
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_no_module_is_over_500_lines() -> None:
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert {n: c for n, c in long.items() if c > MAX_LINES} == {}


def test_the_pool_is_a_small_facade() -> None:
    """``Pool`` delegates to its parts (connection, ranks, cell, escalation, lifecycle)."""
    assert len(MODULES["jupyter_shard.pool.pool"].read_text().splitlines()) <= 400
