"""A pool's spec as plain JSON values, and back: what suspends and kept-pool records store.

Why it exists: both used to store the spec pickled, so reading a suspend directory or a kept pool's
record unpickled a file in the kernel, and whoever could write that file ran code there before any
check. A spec is a handful of numbers, strings and enums, plus the launcher's own options, whose
class the launcher registry names: :func:`to_record` writes them as JSON values and
:func:`from_record` builds the spec again field by field, checking each type, so nothing read can
make the kernel run anything.
"""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any

from jupyter_shard.launchers import get_launcher
from jupyter_shard.spec import Device, LaunchSpec, Offload, Precision, SpecError


def to_record(spec: LaunchSpec) -> dict[str, Any]:
    """``spec`` as JSON values: enums by value, paths as strings, tuples as lists."""
    record = {f.name: _plain(getattr(spec, f.name)) for f in fields(spec) if f.name != "launcher_options"}
    options = spec.launcher_options
    record["launcher_options"] = {f.name: _plain(getattr(options, f.name)) for f in fields(options)}
    return record


def from_record(record: object) -> LaunchSpec:
    """The spec :func:`to_record` wrote; :class:`ValueError` naming the field for anything else."""
    if not isinstance(record, dict):
        raise ValueError("the spec is not a JSON object")
    try:
        launcher = _of(record, "launcher", str)
        options_type = type(get_launcher(launcher)).options_type
        given = _of(record, "launcher_options", dict)
        names = {f.name for f in fields(options_type)}
        if not set(given) <= names:
            raise ValueError(f"launcher option {sorted(set(given) - names)[0]!r} is not {launcher}'s")
        options = options_type(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
        env = [tuple(pair) for pair in _of(record, "env", list)]
        if not all(len(p) == 2 and all(isinstance(x, str) for x in p) for p in env):
            raise ValueError("env is not a list of name and value pairs")
        gpus = record.get("gpus")
        config = _of(record, "config", str, none=True)
        return LaunchSpec(
            nproc=_of(record, "nproc", int),
            device=Device(_of(record, "device", str)),
            strategy=_of(record, "strategy", str),
            zero_stage=_of(record, "zero_stage", int, none=True),
            offload=Offload(_of(record, "offload", str)),
            precision=Precision(_of(record, "precision", str)),
            launcher=launcher,
            nodes=_of(record, "nodes", int),
            timeout=float(_of(record, "timeout", (int, float))),
            config=Path(config) if config is not None else None,
            accumulate=_of(record, "accumulate", int),
            clip_grad_norm=_of(record, "clip_grad_norm", (int, float), none=True),
            env=tuple((str(k), str(v)) for k, v in env),
            launcher_options=options,
            gpus=tuple(int(g) for g in _of(record, "gpus", list)) if gpus is not None else None,
        )
    except (KeyError, TypeError, SpecError) as exc:
        raise ValueError(f"the spec does not read back: {exc}") from None


def _plain(value: object) -> object:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _of(record: dict[str, Any], name: str, kind: type | tuple[type, ...], none: bool = False) -> Any:
    value = record[name]
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} is {value!r}")
    return value
