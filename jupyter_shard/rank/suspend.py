"""Suspend and resume, on each rank: the prepared model and optimizer through DCP, the rest of the
namespace through cloudpickle.

:func:`save` runs on every rank of a pool that is being suspended (``%dist_suspend``). The prepared
model and optimizer go through ``torch.distributed.checkpoint`` in the form the strategy gives
(:meth:`~jupyter_shard.strategies.base.StrategyBase.dcp_state`): each rank writes its own part, and a
pool of another size reads the parts it needs. Rank 0 writes how to build the model again
(:mod:`.recipe`). Every other name in the namespace is pickled on its own with cloudpickle (classes
and functions defined in cells by value), so one that cannot be kept (a generator, an open file) is
named with its reason and the others are kept. A value that refers to the prepared model, one of
its modules or parameters, or the optimizer (a learning-rate scheduler, ``head = model.head``) is
written as a reference and bound to the rebuilt object on resume, never copied.

:func:`load` runs on every rank of the resumed pool: it builds and prepares the model at the new
world size, lets DCP fill it (resharding), then restores the namespace and, at the same world size,
each rank's random generators, so the next step is the one that would have come. At another world
size every rank gets rank 0's namespace (rank-specific values, such as a data shard, are then to be
rebuilt) and freshly seeded generators. The pool (:mod:`jupyter_shard.pool.suspend`) makes the
directory atomic and keeps the manifest.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cloudpickle
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from jupyter_shard._util.atomic import write_private
from jupyter_shard._util.digests import check_digest, digest_bytes
from jupyter_shard.rank import live_objects, optimizer_state, training_state
from jupyter_shard.rank import shard as shard_module
from jupyter_shard.rank.dcp_digests import HashingWriter, digests_of, without_crc32
from jupyter_shard.rank.dcp_reader import DirectReader, touch
from jupyter_shard.rank.fingerprint import fingerprints
from jupyter_shard.rank.loader_state import (
    LoaderIterator,
    ShardLoader,
    ShardSampler,
    live_positions,
    resharding,
)
from jupyter_shard.rank.recipe import Recipe
from jupyter_shard.rank.state_check import StateCheck
from jupyter_shard.strategies.fsdp_units import WRAPPED
from jupyter_shard.strategies.sharded_init import values_from_checkpoint

__all__ = ["load", "save"]

FORMAT = 1
STATE_DIR = "state"  # the DCP checkpoint of the prepared model and optimizer
RECIPE_FILE = "model.pkl"
NAMESPACE_FILE = "namespace-{rank}.pkl"

# IPython's own names and the pool's (the shard helper is the new pool's own)
_NOT_USERS = re.compile(
    r"^(_|__|___|_i{1,3}|_i\d+|_\d+|_oh|_dh|_ih|In|Out|exit|quit|get_ipython|shard|_js_\w*|__\w+__)$"
)


def save(directory: str) -> dict[str, Any]:
    """Write this rank's part of a suspend into ``directory``; what was kept and what was not."""
    helper = _helper()
    root = Path(directory)
    model, optimizer = helper.prepared_model, helper.prepared_optimizer
    grads = training_state.accumulated(helper) if model is not None else None  # refused before any write
    digests: dict[str, str] = {}  # each file this rank wrote, for the signed manifest
    stateless = False
    if model is not None:
        recipe = helper.recipe
        if helper.rank == 0:
            data = _recipe_bytes(recipe)
            _write(root / RECIPE_FILE, data)
            digests[RECIPE_FILE] = digest_bytes(data)
        # an optimizer without state is kept as its hyperparameters (training_state says why)
        stateless = optimizer is not None and not optimizer.state and helper.impl.dcp_format == "torch"
        state = helper.impl.dcp_state(model, None if stateless else optimizer)
        writer = HashingWriter(root / STATE_DIR)  # each file hashed as it is written, not read again
        with without_crc32():
            dcp_save(state, storage_writer=writer, checkpoint_id=root / STATE_DIR)
        written = [*(root / STATE_DIR).glob(f"__{helper.rank}_*")]
        written += [root / STATE_DIR / ".metadata"] if helper.rank == 0 else []
        digests |= {f"{STATE_DIR}/{name}": d for name, d in digests_of(writer, written).items()}
    ns, hidden = _namespace()
    values, modules, lost = pickle_namespace(ns, hidden, _references(helper))
    payload = {
        "format": FORMAT,
        "rank": helper.rank,
        "world_size": helper.world_size,
        "strategy": helper.strategy,
        "dcp_format": helper.impl.dcp_format if model is not None else "",
        "prepared": model is not None,
        "progress": helper.progress,
        "values": values,
        "modules": modules,
        "lost": lost,
        "rng": training_state.rng_state(),
        "scaler": helper.impl.scaler.state_dict() if model is not None and helper.impl.scaler else None,
        "grads": grads,
        "groups": training_state.optimizer_groups(optimizer) if stateless and optimizer else None,
    }
    data = pickle.dumps(payload, protocol=5)
    _write(root / NAMESPACE_FILE.format(rank=helper.rank), data)
    digests[NAMESPACE_FILE.format(rank=helper.rank)] = digest_bytes(data)
    mine = [root / NAMESPACE_FILE.format(rank=helper.rank), *(root / STATE_DIR).glob(f"__{helper.rank}_*")]
    return {
        "digests": digests,
        "kept": sorted([*values, *modules]),
        "lost": lost,
        "bytes": sum(p.stat().st_size for p in mine if p.is_file()),
        "prepared": model is not None,
        "dcp_format": payload["dcp_format"],
        "between_steps": bool(grads),
        "loaders": live_positions(),
        "rebuilt": sorted(n for n, v in ns.items() if n in values and isinstance(v, _REBUILT)),
        "name_digests": fingerprints(
            {n: ns[n] for n in values if n in ns}, _reference_ids(helper), ns, _REBUILT
        ),
    }


_REBUILT = (ShardLoader, ShardSampler, LoaderIterator)


def load(
    directory: str,
    saved_world_size: int,
    digests: dict[str, str],
    positions: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """Restore a suspend from ``directory`` into this rank; what came back and what did not.
    ``digests`` are the signed manifest's: nothing is unpickled before every rank has found the
    files it checks unchanged, and each pickle is loaded from the bytes that were checked.
    ``positions`` (at another world size) are each suspended rank's samples read, by loader iterator:
    the prepared loaders go on with what no rank had read (:mod:`.loader_state`)."""
    helper = _helper()
    root = Path(directory)
    same = helper.world_size == saved_world_size
    source = helper.rank if same else 0
    # DCP's files, hashed while the model is built
    checking = StateCheck(helper.rank, helper.world_size, root, STATE_DIR, digests)
    try:
        name = NAMESPACE_FILE.format(rank=source)
        data = (root / name).read_bytes()
        check_digest(data, name, digests)
        payload: dict[str, Any] = pickle.loads(data)
        if payload.get("format") != FORMAT:
            raise RuntimeError(
                f"{root} was written by another version of jupyter_shard (format {payload.get('format')})"
            )
        if payload["prepared"]:
            _prepare_again(helper, root, payload, digests, checking)
        else:
            checking.agree()
    except BaseException:
        checking.stop()  # no more hashing for a resume that failed
        raise
    ns, _ = _namespace()
    reopened: dict[str, str] = {}
    with resharding(helper.rank, helper.world_size, None if same else (positions or {})):
        restored, lost = unpickle_namespace(payload["values"], _references(helper), ns, reopened)
    for name, module in payload["modules"].items():
        try:
            ns[name] = importlib.import_module(module)
        except Exception as exc:
            lost[name] = f"import {module}: {_line(exc)}"
        else:
            restored.append(name)
    if same:
        training_state.set_rng_state(payload["rng"])
    return {"restored": sorted(restored), "lost": lost, "namespace_of_rank": source, "reopened": reopened}


def _prepare_again(
    helper: shard_module.Shard,
    root: Path,
    payload: Mapping[str, Any],
    digests: dict[str, str],
    checking: StateCheck,
) -> None:
    """Build, prepare and fill the model and optimizer at this pool's world size."""
    data = (root / RECIPE_FILE).read_bytes()
    check_digest(data, RECIPE_FILE, digests)
    recipe: Recipe = cloudpickle.loads(data)
    # FSDP allocates only this rank's shard of a meta model, which the checkpoint then fills
    on_meta = helper.strategy == "fsdp"
    model, optimizer = recipe.build(meta=on_meta)
    clip = recipe.clip_grad_norm
    with values_from_checkpoint() if on_meta else contextlib.nullcontext():
        prepared = helper.prepare(model, optimizer, accumulate=recipe.accumulate, clip_grad_norm=clip)
    wrapped, new_optimizer = (prepared[0], prepared[1]) if optimizer is not None else (prepared, None)
    saved, wanted = payload["dcp_format"], helper.impl.dcp_format
    if saved != wanted:
        raise RuntimeError(
            f"this suspend was written by --strategy {payload['strategy']} ({saved} state) and this pool's "
            f"--strategy {helper.strategy} reads {wanted} state, so it cannot load it; resume with "
            f"--strategy {payload['strategy']} and the options it was suspended with"
            + (" (ddp and fsdp read each other's)" if saved == "torch" else "")
        )
    groups = payload.get("groups")
    optimizer_kept = None if groups is not None else new_optimizer  # saved without state: none loaded
    reader = DirectReader(root / STATE_DIR, checking.metadata)  # the metadata from the checked bytes
    saved_keys = None
    if optimizer_kept is not None and wanted == "torch":
        saved_keys = reader.read_metadata().state_dict_metadata
        # state entries allocated as the checkpoint holds them, not made by a step at learning rate 0
        optimizer_state.allocate(optimizer_kept, _state_names(helper, wrapped), saved_keys)
    state = helper.impl.dcp_state(wrapped, optimizer_kept)
    if saved_keys is not None:
        training_state.keep_saved_state(state, saved_keys)
    touch(state)  # its memory mapped while the files are checked, so the load below only copies
    checking.agree()
    dcp_load(state, storage_reader=reader)
    helper.impl.load_dcp_state(wrapped, optimizer_kept, state)
    if groups is not None and new_optimizer is not None:
        training_state.set_groups(new_optimizer, groups)
    training_state.restore(helper, wrapped, payload)


def _state_names(helper: shard_module.Shard, wrapped: nn.Module) -> dict[int, str]:
    """Parameter id -> its name in a DCP state dict (wrappers' parts of the name left out)."""
    inner = helper.impl.unwrap(wrapped)
    return {id(p): n.replace(WRAPPED, "").replace("_orig_mod.", "") for n, p in inner.named_parameters()}


# -- the namespace -------------------------------------------------------------------------------


def pickle_namespace(
    ns: Mapping[str, Any], hidden: Mapping[str, Any], references: Mapping[str, Any]
) -> tuple[dict[str, bytes], dict[str, str], dict[str, str]]:
    """(pickled values, modules by name, names that could not be kept with why) of the user's names.

    ``references`` maps a tag to an object that is written as that tag, not by value.
    """
    refs = {id(obj): tag for tag, obj in references.items()}
    refs[id(ns)] = "namespace"
    values: dict[str, bytes] = {}
    modules: dict[str, str] = {}
    lost: dict[str, str] = {}
    # One pickler over every name: its memo spans them, so an object two names share (``b = a``, a
    # loader and its sampler) is written once and comes back as one object. A name that cannot be
    # pickled is left out and the stream written again without it (the memo cannot be wound back).
    chosen = {}
    for name, value in ns.items():
        if _NOT_USERS.match(name) or (name in hidden and hidden[name] is value):
            continue
        if isinstance(value, types.ModuleType):
            modules[name] = value.__name__
        else:
            try:  # an open file: reopened where it was, never copied
                record = live_objects.file_record(value)
            except OSError as exc:  # a text file read with next(): its position cannot be told
                lost[name] = f"{_line(exc)}; open it again after the resume"
                continue
            chosen[name] = _FileRecord(record) if record is not None else value
    while True:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, refs, ns)
        spans: dict[str, tuple[int, int]] = {}
        for name, value in chosen.items():
            start = buffer.tell()
            try:
                pickler.dump(value)
            except Exception as exc:
                lost[name] = _line(exc)
                break
            spans[name] = (start, buffer.tell())
        else:
            break
        del chosen[name]
    data = buffer.getbuffer()
    for name, (start, end) in spans.items():
        values[name] = bytes(data[start:end])
    return values, modules, lost


def unpickle_namespace(
    values: Mapping[str, bytes],
    references: Mapping[str, Any],
    ns: dict[str, Any],
    reopened: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Put the pickled values into ``ns``; (names restored, names that failed with why). Open files
    are reopened, each told to ``reopened`` by name."""
    reopened = {} if reopened is None else reopened
    restored: list[str] = []
    lost: dict[str, str] = {}
    references = {**references, "namespace": ns}
    memo: dict[int, Any] = {}  # carried from name to name, as the pickler's was (shared objects)
    for name, blob in values.items():
        unpickler = _Unpickler(io.BytesIO(blob), references)
        unpickler.memo = memo  # type: ignore[attr-defined]  # the same dict, kept as it is
        try:
            value = unpickler.load()
            if isinstance(value, _FileRecord):
                value, said = live_objects.reopen(value.record)
                reopened[name] = said
            ns[name] = value
        except Exception as exc:
            lost[name] = _line(exc)
        else:
            restored.append(name)
    return restored, lost


class _FileRecord:
    """An open regular file of the namespace, kept as where it was (:mod:`live_objects`)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, with the tagged objects written as references, and functions defined in cells
    written with the namespace itself as their globals (cloudpickle would give each its own copy of
    the globals it names, so a resumed ``train()`` would step a scheduler nobody else sees)."""

    def __init__(self, file: io.BytesIO, refs: Mapping[int, str], namespace: object) -> None:
        super().__init__(file, protocol=5)
        self._refs = refs
        self._namespace = namespace

    def persistent_id(self, obj: Any) -> str | None:
        return self._refs.get(id(obj))

    def reducer_override(self, obj: Any) -> Any:
        reason = live_objects.not_kept_reason(obj)
        if reason is not None:
            raise TypeError(reason)
        if isinstance(obj, types.FunctionType) and obj.__globals__ is self._namespace:
            cells = tuple(_cell_value(c) for c in obj.__closure__) if obj.__closure__ is not None else None
            attributes = (
                obj.__defaults__,
                obj.__kwdefaults__,
                obj.__qualname__,
                obj.__module__,
                obj.__dict__,
            )
            return _cell_function, (self._namespace, obj.__code__, obj.__name__, cells, attributes)
        return super().reducer_override(obj)


class _Empty:
    """An empty closure cell (a name the function's scope binds later)."""


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _Empty


def _cell_function(
    namespace: dict[str, Any], code: types.CodeType, name: str, cells: tuple[Any, ...] | None, attributes: Any
) -> types.FunctionType:
    """A function defined in a cell, rebuilt over the resumed rank's namespace."""
    closure = (
        None
        if cells is None
        else tuple(types.CellType() if v is _Empty else types.CellType(v) for v in cells)
    )
    function = types.FunctionType(code, namespace, name, None, closure)
    function.__defaults__, function.__kwdefaults__, function.__qualname__, function.__module__, extra = (
        attributes
    )
    function.__dict__.update(extra)
    return function


class _Unpickler(pickle._Unpickler):
    """pickle's Python unpickler, whose memo is a plain dict that can be handed from one name's part
    to the next (the C unpickler's memo cannot be set safely), with the tagged references."""

    def __init__(self, file: io.BytesIO, references: Mapping[str, Any]) -> None:
        super().__init__(file)
        self._references = references

    def persistent_load(self, pid: Any) -> Any:
        if pid not in self._references:
            raise pickle.UnpicklingError(f"{pid} is not part of the resumed pool's prepared model")
        return self._references[pid]


def _references(helper: shard_module.Shard) -> dict[str, Any]:
    """Tag -> object for the shard helper and the prepared model, its modules and parameters, and
    the optimizer: what the namespace refers to rather than holds."""
    refs: dict[str, Any] = {"shard": helper}
    model, optimizer = helper.prepared_model, helper.prepared_optimizer
    if model is None:
        return refs
    inner: nn.Module = helper.impl.unwrap(model)
    for name, module in inner.named_modules():
        refs[f"module:{name}"] = module
    for name, p in inner.named_parameters():
        refs[f"parameter:{name}"] = p
    refs["model"] = model
    if optimizer is not None:
        refs["optimizer"] = optimizer
    return refs


def _reference_ids(helper: shard_module.Shard) -> dict[int, str]:
    return {id(obj): tag for tag, obj in _references(helper).items()}


def _namespace() -> tuple[dict[str, Any], dict[str, Any]]:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("suspend and resume run inside a rank of a pool")
    return shell.user_ns, shell.user_ns_hidden


def _helper() -> shard_module.Shard:
    helper = shard_module.current()
    if helper is None:
        raise RuntimeError("suspend and resume run inside a rank of a pool")
    return helper


def _recipe_bytes(recipe: Recipe | None) -> bytes:
    if recipe is None:
        raise RuntimeError("the prepared model has no recipe; prepare it with shard.prepare")
    try:
        return bytes(cloudpickle.dumps(recipe, protocol=5))
    except Exception as exc:
        raise RuntimeError(f"the prepared model's architecture cannot be pickled ({_line(exc)})") from None


# -- files ---------------------------------------------------------------------------------------


def _write(path: Path, data: bytes) -> None:
    """Each part is whole once written; the pool renames the directory into place only after every
    rank returned."""
    write_private(path, data)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
