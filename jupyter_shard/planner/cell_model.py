"""The model a cell's code builds, as a builder the dry run (or a rank's trial step) can call.

Why it exists: ``%%dist_picker --batch EXPR`` and ``dry_run(code, ...)`` take the code that builds
the model rather than a model, so that a model too big for this machine is planned from the code
that would build it: the dry run calls the builder under fake tensors on the meta device, and a 7B
model allocates nothing. The code runs in a scratch namespace layered over the caller's (a copy of
it: the code reads the user's names, and whatever it defines stays in the copy), fresh at every call.
The model is the code's last expression, or else the variable ``model`` the code defines.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from typing import Any

from jupyter_shard.errors import SpecError, one_line

__all__ = ["MODEL_NAME", "compile_model_code", "model_builder", "run_model_code"]

#: the variable a cell that does not end in the model assigns it to
MODEL_NAME = "model"
_HINT = "end the code with the model as its last expression, or assign it to `model`"


def model_builder(code: str, namespace: Mapping[str, Any] | None = None) -> Callable[[], Any]:
    """A function of no arguments that runs ``code`` over ``namespace`` and returns its model.

    The code is compiled here, so a syntax error or empty code is one :class:`SpecError` line now;
    a failure when the builder runs is one line too.
    """
    compiled = compile_model_code(code)
    base = dict(namespace or {})

    def build() -> Any:
        return run_model_code(compiled, base)

    return build


def run_model_code(compiled: tuple[Any, Any | None], namespace: Mapping[str, Any]) -> Any:
    """Run :func:`compile_model_code`'s result in a scratch copy of ``namespace``; the model."""
    from torch import nn

    body, last = compiled
    scratch = _scratch(namespace)
    try:
        exec(body, scratch)
        value = eval(last, scratch) if last is not None else scratch.get(MODEL_NAME)
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"the model code raised {one_line(exc)}; fix the code that builds the model") from exc
    if last is None and (MODEL_NAME not in scratch or _inherited(scratch, namespace)):
        raise SpecError(f"the model code defines no model; {_HINT}")
    if not isinstance(value, nn.Module):
        what = "last expression" if last is not None else "`model`"
        raise SpecError(f"the model code's {what} is a {type(value).__name__}, not an nn.Module; {_HINT}")
    return value


def compile_model_code(code: str) -> tuple[Any, Any | None]:
    """The code's statements, and its last expression (None when it ends in a statement)."""
    if not isinstance(code, str) or not code.strip():
        raise SpecError("the model code is empty; write the code that builds the model, ending in it")
    try:
        tree = ast.parse(code, "<model code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        assert last is None or isinstance(last, ast.Expr)
        body = compile(tree, "<model code>", "exec")
        expr = compile(ast.Expression(last.value), "<model code>", "eval") if last is not None else None
    except SyntaxError as exc:
        where = f" (line {exc.lineno})" if exc.lineno else ""
        raise SpecError(
            f"the model code has a syntax error{where}: {exc.msg}; pass plain Python that builds the model"
        ) from None
    return body, expr


def _scratch(namespace: Mapping[str, Any]) -> dict[str, Any]:
    import torch
    from torch import nn

    return {"torch": torch, "nn": nn, **namespace}


def _inherited(scratch: Mapping[str, Any], namespace: Mapping[str, Any]) -> bool:
    """Whether ``model`` in the scratch namespace is the caller's, untouched by the code."""
    return MODEL_NAME in namespace and scratch[MODEL_NAME] is namespace[MODEL_NAME]
