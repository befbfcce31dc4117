"""jupyter_shard.notebook.headstart without ranks: which cells may be sent ahead, from IPython's own
transform of the cell, and which requests are left alone."""

from __future__ import annotations

import ast
import asyncio
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

from jupyter_shard.notebook.headstart import HeadStart, Repeat, Repeats, cell_magic_call


@pytest.fixture(scope="module")
def shell(ipython: InteractiveShell) -> InteractiveShell:
    return ipython


@pytest.mark.parametrize(
    ("code", "call"),
    [
        ("%%distributed --nproc 2\npass", ("distributed", "--nproc 2", "pass\n")),  # as IPython adds it
        ("%%distributed\nx = 1\n\nprint(x)\n", ("distributed", "", "x = 1\n\nprint(x)\n")),
        ("%%distributed --ranks 0   \n  y\n", ("distributed", "--ranks 0", "  y\n")),
        ("%%distributed", ("distributed", "", "")),
        ("%%rank 0\npass", ("rank", "0", "pass\n")),
        ("print(1)", None),
        ("%time pass", None),
        ("x = 1\n%%distributed\npass", None),
    ],
)
def test_the_call_is_read_from_ipythons_own_transform(
    shell: InteractiveShell, code: str, call: tuple[str, str, str] | None
) -> None:
    assert cell_magic_call(shell, code) == call


def test_an_ast_transformer_could_change_the_call_so_none_is_read(shell: InteractiveShell) -> None:
    shell.ast_transformers.append(ast.NodeTransformer())
    try:
        assert cell_magic_call(shell, "%%distributed\npass") is None
    finally:
        shell.ast_transformers.clear()


class StubPool:
    """The two methods of :class:`Pool` the head start calls, counted."""

    def __init__(self) -> None:
        self.spec = object()
        self.sent: list[tuple[Any, ...]] = []
        self.settled = 0

    def send_ahead(self, *args: Any) -> bool:
        self.sent.append(args)
        return True

    def settle_ahead(self) -> None:
        self.settled += 1


class StubMagics:
    def __init__(self, shell: InteractiveShell, pool: StubPool, line: str) -> None:
        self.shell, self.pool, self.default_line = shell, pool, ""
        self.repeats = Repeats()
        self.repeats.add(Repeat(line, "", pool, pool.spec, (1,), 9.0))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def magic_is_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """As after %load_ext: IPython's %%distributed is the magics object's."""
    monkeypatch.setattr(HeadStart, "_owns_magic", lambda self, shell: True)


class StubKernel:
    def __init__(self) -> None:
        self.handled: list[str] = []
        self.shell_handlers = {"execute_request": self.execute_request}

    async def execute_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        self.handled.append(parent["content"]["code"])


def request(code: str, **content: Any) -> dict[str, Any]:
    return {"content": {"code": code, "silent": False, "store_history": True, **content}}


def test_only_a_repeat_of_the_last_line_on_the_same_pool_is_sent(shell: InteractiveShell) -> None:
    pool, kernel = StubPool(), StubKernel()
    magics = StubMagics(shell, pool, "--nproc 2")
    head = HeadStart(kernel, magics)  # type: ignore[arg-type]
    head.install()
    handle = kernel.shell_handlers["execute_request"]
    for code in [
        "%%distributed --nproc 2\nx = 1",  # sent
        "%%distributed --nproc 4\nx = 1",  # another line
        "%%distributed\nx = 1",  # a bare line, while the default line is not this one
        "%%rank 0\nx = 1",
        "%%distributed --nproc 2",  # no body: IPython refuses it
        "\n%%distributed --nproc 2\nx = 1",  # not at the start: run as before
    ]:
        asyncio.run(handle(None, [], request(code)))
    asyncio.run(handle(None, [], request("%%distributed --nproc 2\nx = 1", silent=True)))
    asyncio.run(handle(None, [], request("%%distributed --nproc 2\nx = 1", store_history=False)))
    assert pool.sent == [("# %%distributed --nproc 2\nx = 1\n", (1,), 9.0, shell.execution_count)]
    assert pool.settled == 1, "after the cell it sent: the pool ends it if no run took it"
    assert len(kernel.handled) == 8, "every request still reaches the kernel's handler"
    magics.pool = StubPool()  # the pool was shut down and another started
    asyncio.run(handle(None, [], request("%%distributed --nproc 2\nx = 1")))
    assert len(pool.sent) == 1 and magics.pool.sent == []
    head.uninstall()
    assert kernel.shell_handlers["execute_request"] == kernel.execute_request


def test_a_failure_to_send_leaves_the_cell_to_the_magic(shell: InteractiveShell, capfd: Any) -> None:
    pool, kernel = StubPool(), StubKernel()

    def broken(*args: Any) -> bool:
        raise RuntimeError("no")

    pool.send_ahead = broken  # type: ignore[method-assign]
    head = HeadStart(kernel, StubMagics(shell, pool, ""))  # type: ignore[arg-type]
    head.install()
    asyncio.run(kernel.shell_handlers["execute_request"](None, [], request("%%distributed\npass")))
    assert kernel.handled == ["%%distributed\npass"] and pool.settled == 1  # nothing to settle
    assert "could not send the cell ahead: RuntimeError('no')" in capfd.readouterr().err


def test_a_cell_run_again_is_not_transformed_again_unless_the_transform_changed(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jupyter_shard.notebook.headstart as module

    calls: list[str] = []

    def counting(shell: Any, code: str) -> Any:
        calls.append(code)
        return cell_magic_call(shell, code)

    monkeypatch.setattr(module, "cell_magic_call", counting)
    pool, kernel = StubPool(), StubKernel()
    head = HeadStart(kernel, StubMagics(shell, pool, "--nproc 2"))  # type: ignore[arg-type]
    head.install()
    cell = request("%%distributed --nproc 2\nx = 1")
    for _ in range(3):
        asyncio.run(kernel.shell_handlers["execute_request"](None, [], cell))
    assert len(calls) == 1 and len(pool.sent) == 3
    shell.input_transformers_post.append(lambda lines: lines)
    try:
        asyncio.run(kernel.shell_handlers["execute_request"](None, [], cell))
    finally:
        shell.input_transformers_post.clear()
    assert len(calls) == 2, "a new transformer: the cell is transformed again"
    asyncio.run(kernel.shell_handlers["execute_request"](None, [], request("%%distributed --nproc 2\nx = 2")))
    assert len(calls) == 3 and pool.sent[-1][0] == "# %%distributed --nproc 2\nx = 2\n"


def test_the_lines_kept_are_the_most_recent_ones() -> None:
    repeats = Repeats()
    made = [Repeat(f"--timeout {n}", "", None, None, None, float(n)) for n in range(Repeats.LIMIT + 1)]  # type: ignore[arg-type]
    for repeat in made[:-1]:
        repeats.add(repeat)
    repeats.add(made[0])  # run again: the most recent now
    repeats.add(made[-1])
    assert repeats.get("--timeout 0") is made[0] and repeats.get("--timeout 1") is None
    assert repeats.get(f"--timeout {Repeats.LIMIT}") is made[-1]
    repeats.clear()
    assert repeats.get("--timeout 0") is None


def test_unloaded_under_another_wrapper_it_passes_requests_on_untouched(shell: InteractiveShell) -> None:
    pool, kernel = StubPool(), StubKernel()
    head = HeadStart(kernel, StubMagics(shell, pool, ""))  # type: ignore[arg-type]
    head.install()
    ours = kernel.shell_handlers["execute_request"]

    async def later(stream: Any, ident: Any, parent: dict[str, Any]) -> None:  # another extension's
        await ours(stream, ident, parent)

    kernel.shell_handlers["execute_request"] = later
    head.uninstall()
    assert kernel.shell_handlers["execute_request"] is later
    asyncio.run(later(None, [], request("%%distributed\npass")))
    assert kernel.handled == ["%%distributed\npass"] and pool.sent == []
    head.install()  # %reload_ext: in the chain again, and sending
    asyncio.run(kernel.shell_handlers["execute_request"](None, [], request("%%distributed\npass")))
    assert len(pool.sent) == 1
