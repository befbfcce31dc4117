"""The package's shape: no import cycles (function-level imports included), layers that point down,
no module over 500 lines. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jupyter_shard"
MAX_LINES = 500

# What each room may import, as docs/architecture.md ("What each package may import") states it: a
# module may import its own room and the rooms named here, nothing else of the package. The notebook
# layer sits on top; the pool (the driving side) and the ranks meet only through the wire, the
# transfer helpers and the contracts at the root (errors, env, gpus, spec).
_P = "jupyter_shard."
ROOT = (_P + "errors", _P + "env", _P + "gpus", _P + "spec")
_DRIVER = (*ROOT, _P + "_util", _P + "wire", _P + "transfer", _P + "launchers", _P + "strategies")
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    _P + "errors": (),
    _P + "env": (),
    _P + "_util": (),
    _P + "gpus": (_P + "errors",),
    _P + "spec": (_P + "errors", _P + "gpus", _P + "_util", _P + "strategies"),
    _P + "wire": (_P + "env", _P + "errors"),
    _P + "transfer": (_P + "wire", _P + "env", _P + "errors"),
    _P + "strategies": (_P + "errors", _P + "_util"),
    _P + "planner": (
        _P + "_util",
        _P + "spec",
        _P + "gpus",
        _P + "errors",
        _P + "env",  # JUPYTER_SHARD_PROGRESS, for its live line
        _P + "strategies",
    ),  # a dry run wraps as they do
    _P + "launchers": (*ROOT, _P + "_util"),
    # the fork server preloads the rank runtime in the process ranks are forked from
    _P + "launchers.zygote.server": (*ROOT, _P + "_util", _P + "launchers", _P + "rank"),
    _P + "rank": (*ROOT, _P + "_util", _P + "wire", _P + "transfer", _P + "strategies"),
    _P + "pool": _DRIVER,
    _P + "export": (*ROOT, _P + "_util", _P + "pool", _P + "launchers", _P + "strategies"),
    _P + "notebook": (*_DRIVER, _P + "planner", _P + "pool", _P + "export"),
    _P + "__main__": (_P + "errors", _P + "pool"),  # python -m jupyter_shard pools | stop ID
}
# What a room may also name in ``if TYPE_CHECKING:`` blocks (types only).
MAY_NAME_FOR_TYPES: dict[str, tuple[str, ...]] = {
    _P + "planner": (_P + "pool.ranks",),  # the RankSnapshot a running pool reports
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


def _walk(tree: ast.AST, type_only: bool) -> Iterator[ast.AST]:
    """Every node that runs, and with ``type_only`` those in ``if TYPE_CHECKING:`` blocks too."""
    for child in ast.iter_child_nodes(tree):
        if _type_checking_block(child) and not type_only:
            continue
        yield child
        yield from _walk(child, type_only)


def _imports(name: str, path: Path, type_only: bool = False) -> set[str]:
    """The package modules ``name`` imports when it runs, at any level (functions included); with
    ``type_only``, also those it names for types only."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _walk(ast.parse(path.read_text()), type_only):
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
# A type-only import ties two modules as much as one that runs: cycles are looked for in this one.
TYPED_GRAPH = {name: _imports(name, path, type_only=True) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_reader_sees_imports() -> None:
    """The checks below are only worth something if imports are found at all."""
    assert "jupyter_shard.pool.connection" in GRAPH["jupyter_shard.pool.pool"]
    assert "jupyter_shard.notebook.display" in GRAPH["jupyter_shard"]  # a function-level import


def test_the_reader_sees_type_only_imports() -> None:
    assert "jupyter_shard.pool.ranks" in TYPED_GRAPH["jupyter_shard.planner.free_memory"]  # for types
    assert "jupyter_shard.pool.ranks" not in GRAPH["jupyter_shard.planner.free_memory"]


@pytest.mark.parametrize("graph", ["runtime", "with type-only imports"])
def test_no_import_cycles(graph: str) -> None:
    cycle = _cycle(GRAPH if graph == "runtime" else TYPED_GRAPH)
    assert cycle is None, " -> ".join(cycle or [])


def _room(name: str) -> str:
    """The most specific room of MAY_IMPORT that holds module ``name`` ("" for the package root)."""
    rooms = [r for r in MAY_IMPORT if name == r or name.startswith(r + ".")]
    return max(rooms, key=len, default="")


def _within(target: str, rooms: tuple[str, ...]) -> bool:
    return any(target == r or target.startswith(r + ".") for r in rooms)


def _wrong_imports(graph: dict[str, set[str]], for_types: bool) -> list[str]:
    wrong = []
    for name, imported in sorted(graph.items()):
        room = _room(name)
        if not room:
            continue
        home = room if room != _P + "launchers.zygote.server" else _P + "launchers"
        allowed = (home, *MAY_IMPORT[room], *(MAY_NAME_FOR_TYPES.get(room, ()) if for_types else ()))
        wrong += [f"{name} imports {t}" for t in sorted(imported) if not _within(t, allowed)]
    return wrong


def test_every_module_belongs_to_a_room_with_a_rule() -> None:
    homeless = [n for n in MODULES if n != "jupyter_shard" and not _room(n)]
    assert homeless == [], f"add these to MAY_IMPORT (and docs/architecture.md): {homeless}"


@pytest.mark.parametrize("graph", ["runtime", "with type-only imports"])
def test_each_room_imports_only_what_its_rule_allows(graph: str) -> None:
    wrong = _wrong_imports(GRAPH, False) if graph == "runtime" else _wrong_imports(TYPED_GRAPH, True)
    assert wrong == [], wrong


def test_the_rules_catch_an_import_upward() -> None:
    """The check is worth something: a rank module importing the pool, a type-only planner import
    outside its exception, and the wire importing the transfer helpers are each reported."""
    fake = {
        _P + "rank.shell": {_P + "pool.pool"},
        _P + "planner.choice": {_P + "pool.cell"},
        _P + "wire.protocol": {_P + "transfer.pickling"},
    }
    assert len(_wrong_imports(fake, True)) == 3


def test_no_module_is_over_500_lines() -> None:
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert {n: c for n, c in long.items() if c > MAX_LINES} == {}


def test_the_pool_is_a_small_facade() -> None:
    """``Pool`` delegates to its parts (connection, ranks, cell, escalation, lifecycle)."""
    assert len(MODULES["jupyter_shard.pool.pool"].read_text().splitlines()) <= 400


# The notebook talks to the pool through the facade's own names: never its parts, never a private
# name of the pool layer. Private names of objects that are not the pool's, used on purpose:
NOT_THE_POOLS = {
    "shell._showtraceback",  # IPython's, to show a traceback as the kernel does
    "distributed_parser()._actions",  # argparse's, for Tab completion
    "debug._jupyter_shard",  # the notebook's own mark on its %debug wrapper
}
POOL_PARTS = {"cells", "values", "ahead", "connection", "escalation", "lifecycle"}


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _pool_privates() -> dict[str, set[str]]:
    """The private methods and attributes each class of the pool layer defines, by class name."""
    out: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if not name.startswith("jupyter_shard.pool"):
            continue
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef):
                names = out.setdefault(cls.name, set())
                for node in ast.walk(cls):
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
                        names.add(node.name)
                    elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self":
                        names.update({node.attr} if _private(node.attr) else set())
    return out


def _notebook_reaches_into_the_pool(path: Path, pool_privates: dict[str, set[str]]) -> list[str]:
    tree = ast.parse(path.read_text())
    wrong: list[str] = []
    from_pool: set[str] = set()  # names this module imports from the pool layer
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jupyter_shard.pool"):
            from_pool.update(a.asname or a.name for a in node.names)
            wrong += [f"imports {a.name}" for a in node.names if _private(a.name)]
    inherited: dict[ast.AST, set[str]] = {}  # a class's nodes -> private names of its pool base classes
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            bases = [ast.unparse(b) for b in cls.bases if ast.unparse(b) in from_pool]
            names = set().union(*(pool_privates.get(b, set()) for b in bases))
            for node in ast.walk(cls):
                inherited[node] = names
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base, where = ast.unparse(node.value), f"line {node.lineno}: {ast.unparse(node)}"
        if base.endswith(("pool", "pool()")) and node.attr in POOL_PARTS:
            wrong.append(f"{where} (a part of the pool: ask Pool itself)")
        elif not _private(node.attr) or ast.unparse(node) in NOT_THE_POOLS:
            continue
        elif base in ("self", "cls", "super()"):
            if node.attr in inherited.get(node, set()):
                wrong.append(f"{where} (private to a pool class it inherits)")
        else:
            wrong.append(f"{where} (private)")
    return wrong


def test_the_notebook_uses_only_public_names_of_the_pool() -> None:
    """Not ``pool.cells``, ``pool._refuse…``, nor another object's ``._x`` (a pool part is found in
    anything); nor, in a subclass of a pool class, a private name of that class."""
    privates = _pool_privates()
    assert "_begin" in privates["Pool"] and "_assemblers" in privates["RankSink"]  # the reader sees them
    wrong = {
        name: found
        for name, path in MODULES.items()
        if name.startswith("jupyter_shard.notebook")
        and (found := _notebook_reaches_into_the_pool(path, privates))
    }
    assert not wrong, wrong
