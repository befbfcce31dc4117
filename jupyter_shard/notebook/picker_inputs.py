"""The model, batch and step that ``%dist_picker MODEL --batch EXPR [--step FN]`` names (or the code
of a ``%%dist_picker`` cell that builds the model), read out of the kernel for the dry run.

Why it exists: the user writes expressions in the notebook's terms (a variable, ``torch.randn(8, 1024)``),
and any of them can fail; each failure must become one line saying what to pass, so the picker stays
usable. The batch is evaluated once on the meta device (nothing allocated) and kept as shapes and
dtypes, so that ``--find-batch`` can write it back at any batch size.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jupyter_shard.errors import one_line
from jupyter_shard.spec import SpecError

__all__ = [
    "BatchShape",
    "batch_shape",
    "check_cell",
    "resolve_cell_model",
    "resolve_model",
    "resolve_step",
]


def resolve_model(text: str, namespace: Mapping[str, Any]) -> Any:
    """The module, or zero-argument builder, that ``MODEL`` evaluates to in the kernel."""
    from torch import nn

    hint = "pass a variable holding an nn.Module, or a function of no arguments that builds one"
    value = _evaluate(text, namespace, f"the model expression {text!r}", hint)
    if not isinstance(value, nn.Module) and not callable(value):
        raise SpecError(f"%dist_picker: {text} is a {type(value).__name__}; {hint}")
    return value


def check_cell(line: str, cell: str) -> None:
    """``%%dist_picker``'s line holds options only, and its cell holds code."""
    try:
        first = next(iter(shlex.split(line)), "")
    except ValueError:
        first = ""  # an unclosed quote: the parser says so
    if first and not first.startswith("--"):
        raise SpecError(
            f"%%dist_picker: the cell builds the model, so the line takes no MODEL ({first!r}); drop it, or "
            f"run the line magic %dist_picker {first} --batch ... without the cell"
        )
    if not cell.strip():
        raise SpecError(
            "%%dist_picker: the cell is empty; write the code that builds the model in it, ending in the "
            "model (or assigning it to `model`)"
        )


def resolve_cell_model(code: str, namespace: Mapping[str, Any]) -> Callable[[], Any]:
    """``%%dist_picker``'s cell as a builder: its code, compiled now, runs at each dry run under fake
    tensors in a scratch copy of the kernel's namespace, so it defines no name there."""
    from jupyter_shard.planner.cell_model import model_builder

    try:
        return model_builder(code, namespace)
    except SpecError as exc:
        raise SpecError(f"%%dist_picker: {exc}") from None


def resolve_step(text: str | None, namespace: Mapping[str, Any]) -> Callable[[Any, Any], object] | None:
    if text is None:
        return None
    hint = "pass a function step(model, batch) that runs forward, backward and the optimizer step"
    value = _evaluate(text, namespace, f"--step {text!r}", hint)
    if not callable(value):
        raise SpecError(f"%dist_picker: --step {text} is a {type(value).__name__}; {hint}")
    step: Callable[[Any, Any], object] = value
    return step


def _evaluate(text: str, namespace: Mapping[str, Any], what: str, hint: str, device: str = "") -> Any:
    import torch

    scope = {"torch": torch, **namespace}
    try:
        if device:
            with torch.device(device):
                return eval(text, scope)
        return eval(text, scope)
    except Exception as exc:
        raise SpecError(f"%dist_picker: {what} raised {one_line(exc)}; {hint}") from None


@dataclass(frozen=True)
class BatchShape:
    """The batch as shapes and dtypes: evaluated once on the meta device (nothing allocated), then
    written back as an expression for any batch size, which the dry run evaluates under fake tensors.
    The batch size is the first dimension of the first tensor; every tensor whose first dimension
    equals it follows it."""

    structure: Any
    size: int

    def expression(self, size: int | None = None) -> str:
        return _render(self.structure, self.size, self.size if size is None else size)


def batch_shape(text: str, namespace: Mapping[str, Any]) -> BatchShape:
    import torch

    hint = 'write a tensor expression whose first dimension is the batch, such as "torch.randn(8, 1024)"'
    value = _evaluate(text, namespace, f"--batch {text!r}", hint, device="meta")
    structure = _describe(value, torch, hint)
    first = _first_shape(structure)
    if first is None:
        raise SpecError(f"%dist_picker: --batch {text!r} holds no tensor; {hint}")
    if not first:
        raise SpecError(f"%dist_picker: --batch {text!r} is a 0-dimensional tensor; {hint}")
    if first[0] < 1:
        raise SpecError(f"%dist_picker: --batch {text!r} has batch size {first[0]}; {hint}")
    return BatchShape(structure, first[0])


def _describe(value: Any, torch: Any, hint: str) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(int(d) for d in value.shape), str(value.dtype))
    if isinstance(value, tuple | list):
        return (type(value).__name__, [_describe(v, torch, hint) for v in value])
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return ("dict", {k: _describe(v, torch, hint) for k, v in value.items()})
    raise SpecError(f"%dist_picker: --batch is a {type(value).__name__}, not tensors; {hint}")


def _first_shape(structure: Any) -> tuple[int, ...] | None:
    kind, body = structure[0], structure[1:]
    if kind == "tensor":
        shape: tuple[int, ...] = body[0]
        return shape
    items = body[0].values() if kind == "dict" else body[0]
    return next((s for s in map(_first_shape, items) if s is not None), None)


def _render(structure: Any, old: int, new: int) -> str:
    kind = structure[0]
    if kind == "tensor":
        shape, dtype = list(structure[1]), structure[2]
        if shape and shape[0] == old:
            shape[0] = new
        return f"torch.zeros({tuple(shape)!r}, dtype={dtype})"
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {_render(v, old, new)}" for k, v in structure[1].items()) + "}"
    items = [_render(v, old, new) for v in structure[1]]
    return (
        f"[{', '.join(items)}]" if kind == "list" else f"({', '.join(items)}{',' if len(items) == 1 else ''})"
    )
