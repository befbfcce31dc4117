"""A digest of a value that is the same on two ranks exactly when the value is, for telling which
names each rank held its own value of (a resume at another world size names them).

The pickles a suspend writes cannot be compared for this: cloudpickle gives every class defined in
a cell a random id, and a tensor's storage is keyed by its address. Here a value is pickled once
more with those written by what they are: a tensor as its dtype, shape and a digest of its bytes, a
class defined in a cell as its name, and what the namespace refers to (the prepared model) as its
tag. Anything that cannot be pickled has no digest.
"""

from __future__ import annotations

import hashlib
import io
import marshal
import types
from collections.abc import Mapping
from typing import Any

import cloudpickle
import torch

__all__ = ["fingerprints"]


def fingerprints(
    values: Mapping[str, Any],
    refs: Mapping[int, str],
    namespace: object = None,
    rebuilt: tuple[type, ...] = (),
) -> dict[str, str]:
    """Name -> digest (16 hex digits) of each value; ``refs`` maps ``id(obj)`` to a tag. A function
    defined in a cell (its globals are ``namespace``) counts as its code and closure, not as the
    names it reads (each compared on its own); objects of the ``rebuilt`` types (remade for each
    rank on resume) count as their type."""
    out: dict[str, str] = {}
    for name, value in values.items():
        buffer = io.BytesIO()
        try:
            _Pickler(buffer, refs, namespace, rebuilt).dump(value)
        except Exception:
            continue
        out[name] = hashlib.blake2b(buffer.getbuffer(), digest_size=8).hexdigest()
    return out


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    def __init__(
        self, file: io.BytesIO, refs: Mapping[int, str], namespace: object, rebuilt: tuple[type, ...]
    ) -> None:
        super().__init__(file, protocol=5)
        self._refs, self._namespace, self._rebuilt = refs, namespace, rebuilt

    def persistent_id(self, obj: Any) -> Any:
        tag = self._refs.get(id(obj))
        if tag is not None:
            return tag
        if self._rebuilt and isinstance(obj, self._rebuilt):
            return ("rebuilt", type(obj).__qualname__)
        if isinstance(obj, types.FunctionType) and obj.__globals__ is self._namespace:
            cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            return ("function", obj.__qualname__, marshal.dumps(obj.__code__), self._digest_of(cells))
        if isinstance(obj, torch.Tensor):
            return ("tensor", str(obj.dtype), tuple(obj.shape), _tensor_digest(obj))
        if isinstance(obj, type) and obj.__module__ == "__main__":
            return ("class", obj.__qualname__)
        return None

    def _digest_of(self, value: Any) -> str:
        buffer = io.BytesIO()
        _Pickler(buffer, self._refs, self._namespace, self._rebuilt).dump(value)
        return hashlib.blake2b(buffer.getbuffer(), digest_size=8).hexdigest()


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _tensor_digest(t: torch.Tensor) -> str:
    local = getattr(t, "to_local", None)  # a DTensor: this rank's shard (no collective)
    if callable(local):
        t = local()
    if t.is_meta or t.layout != torch.strided:
        return "unreadable"
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=8).hexdigest()
