"""Building a model no rank holds whole: on the meta device, then each rank's shard filled in place.

``with shard.init_module(): model = Big()`` under FSDP builds ``Big`` on the meta device: shapes and
dtypes, no storage. ``shard.prepare`` shards the meta model, allocates only this rank's shard
(``to_empty``), and fills it here with exactly the values a plain ``Big()`` on the CPU would have had
from the CPU generator as it was when the ``with`` block was entered; the generator is left as it was.

The rule: initialisers are replayed in the order the constructors ran them. :func:`meta_build`
records each outermost call of ``reset_parameters``, ``_reset_parameters`` or ``init_weights`` with
the tensors it touched, each copy of a tensor (the layers ``copy.deepcopy`` makes in
``nn.TransformerEncoder``; ``.to(dtype)``) and each reseed. A child's initialiser thus comes in its
own construction, a parent's after its children, whose tensors it may rewrite (``nn.MultiheadAttention``
zeroes ``out_proj.bias``; ``nn.Transformer`` redraws every matrix below it). Each runs on full-size
CPU stand-ins for the tensors it touches, and a rank keeps its slice of a tensor once no later
initialiser touches it. The peak is one shard plus the tensors alive at once: those the largest
initialiser touches (its subtree at most) and those touched again later (an attention layer's
``out_proj``; all of an ``nn.Transformer``). A top-level module with ``init_weights()`` (the
torchtitan way) that the build did not call runs it last, as ``model.init_weights()`` after a plain
build would; it holds the whole model at full size on the CPU. A model put on the meta device some
other way runs each module's initialiser, children before parents.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.modules import module as module_hooks
from torch.nn.modules.loss import _Loss
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "built_on_meta",
    "check_initialisable",
    "materialise",
    "meta_build",
    "release_storage",
    "values_from_checkpoint",
]

INITIALISERS = ("reset_parameters", "_reset_parameters", "init_weights")
_KINDS = ("_parameters", "_buffers")
# Tensor functions whose result holds the same values as their input: a recorded copy.
_COPIES = frozenset(
    {torch.clone, torch.Tensor.clone, torch.Tensor.__deepcopy__, torch.Tensor.to, torch.Tensor.contiguous}
    | {torch.Tensor.half, torch.Tensor.float, torch.Tensor.double, torch.Tensor.bfloat16}
)
_records: dict[int, _Record] = {}  # by id of the generator state meta_build yielded


@contextlib.contextmanager
def meta_build() -> Iterator[torch.Tensor]:
    """Build on the meta device; yields the CPU generator state the model's values will come from."""
    state = torch.get_rng_state()
    recorder = _Recorder(state)
    with torch.device("meta"), recorder.watching():
        yield state
    _records[id(state)] = recorder.record
    weakref.finalize(state, _records.pop, id(state), None)


def built_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def check_initialisable(model: nn.Module, rng_state: torch.Tensor | None = None) -> None:
    """Every parameter and buffer must be set by an initialiser that can run again (see above)."""
    _plan(model, _records.get(id(rng_state)) if rng_state is not None else None)


@contextlib.contextmanager
def values_from_checkpoint() -> Iterator[None]:
    """While the block runs, :func:`materialise` allocates a sharded meta model and initialises
    nothing: a checkpoint fills every parameter and persistent buffer next (a resume). Buffers that
    hold values (a rotary table no state dict holds) keep them."""
    token = _from_checkpoint.set(True)
    try:
        yield
    finally:
        _from_checkpoint.reset(token)


_from_checkpoint: contextvars.ContextVar[bool] = contextvars.ContextVar("from_checkpoint", default=False)


def materialise(
    model: nn.Module,
    device: torch.device,
    rng_state: torch.Tensor | None,
    params_on: torch.device | None = None,
) -> None:
    """Allocate this rank's part of a sharded meta model and initialise it (see above).

    Parameters go to ``params_on`` (the CPU when they are offloaded), buffers to ``device``.
    """
    if _from_checkpoint.get():
        held = [
            (module, name, b)
            for module in model.modules()
            for name, b in module._buffers.items()
            if b is not None and not b.is_meta
        ]
        model.to_empty(device=params_on or device)
        for module, name, b in held:
            module._buffers[name] = b.to(device)
        _buffers_to(model, device, params_on)
        return
    events, keys = _plan(model, _records.pop(id(rng_state), None) if rng_state is not None else None)
    model.to_empty(device=params_on or device)
    targets: dict[int, list[torch.Tensor]] = {}
    for slot, key in keys.items():
        targets.setdefault(key, []).append(slot.get())
    kept = torch.get_rng_state()
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    try:
        with torch.no_grad(), torch.device("cpu"):
            _replay(events, targets)
    finally:
        torch.set_rng_state(kept)
    _buffers_to(model, device, params_on)


def _buffers_to(model: nn.Module, device: torch.device, params_on: torch.device | None) -> None:
    """Buffers on ``device`` where the parameters were put elsewhere (offloaded to the CPU)."""
    if params_on is not None and params_on != device:
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(device)


def release_storage(params: list[nn.Parameter]) -> None:
    """Free the memory of parameters a wrapper has replaced (an optimizer may still refer to them)."""
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


# -- what a build did ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """Where a module holds a tensor: ``module._parameters[name]`` or ``module._buffers[name]``."""

    module: nn.Module
    kind: str
    name: str

    def get(self) -> Any:
        return getattr(self.module, self.kind).get(self.name)

    def put(self, value: torch.Tensor | None) -> None:
        getattr(self.module, self.kind)[self.name] = value


@dataclass
class _Init:
    """``module.<method>(*args, **kwargs)`` ran, after the generator was set to ``seed`` if given.

    ``slots``: each tensor it touched, before and after the call, as meta tensors of the build whose
    storage names them (:func:`_key`: a tensor, its views and its aliases share one)."""

    module: nn.Module
    method: str
    slots: list[tuple[_Slot, torch.Tensor | None, torch.Tensor | None]]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    seed: torch.Tensor | None = None

    def touches(self) -> set[int]:
        return {_key(t) for _, before, after in self.slots for t in (before, after) if t is not None}

    def run(self, full: dict[int, torch.Tensor]) -> None:
        """On full-size stand-ins, one per tensor (tied slots share it); the module's own are put back."""
        saved = [(s, s.name in getattr(s.module, s.kind), s.get()) for s, _, _ in self.slots]
        bound: dict[int, torch.Tensor] = {}
        if self.seed is not None:
            torch.set_rng_state(self.seed)
        try:
            for (slot, before, _), (_, _, old) in zip(self.slots, saved, strict=True):
                if before is None:
                    continue
                if (key := _key(before)) not in bound:
                    value = full.get(key)
                    value = torch.empty(before.shape, dtype=before.dtype) if value is None else value
                    grad = old is None or old.requires_grad
                    bound[key] = nn.Parameter(value, grad) if slot.kind == "_parameters" else value
                slot.put(bound[key])
            getattr(self.module, self.method)(*self.args, **self.kwargs)
            for slot, _, after in self.slots:
                if after is not None and slot.get() is not None:
                    full[_key(after)] = slot.get().detach()
        finally:
            for slot, present, old in reversed(saved):
                if present:
                    slot.put(old)
                else:
                    getattr(slot.module, slot.kind).pop(slot.name, None)


@dataclass
class _Copy:
    """``target`` was made from ``source`` with the same values (``copy.deepcopy``, ``.to(dtype)``)."""

    source: torch.Tensor
    target: torch.Tensor

    def touches(self) -> set[int]:
        return {_key(self.source), _key(self.target)}

    def run(self, full: dict[int, torch.Tensor]) -> None:
        if _key(self.source) in full:
            full[_key(self.target)] = full[_key(self.source)].to(self.target.dtype, copy=True)


_Event = _Init | _Copy


@dataclass
class _Record:
    events: list[_Event] = field(default_factory=list)
    slots: dict[_Slot, torch.Tensor] = field(default_factory=dict)  # each tensor when the block ended


def _key(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t)


def _slots(module: nn.Module) -> dict[_Slot, torch.Tensor]:
    return {
        _Slot(m, kind, name): t
        for m in module.modules()
        for kind in _KINDS
        for name, t in getattr(m, kind).items()
        if t is not None
    }


class _Recorder(TorchFunctionMode):
    """Records a meta build (see above): initialisers by patching their classes while the block runs,
    and, as a torch function mode, the tensors they touch and the copies made outside them."""

    def __init__(self, state: torch.Tensor) -> None:
        super().__init__()
        self.record = _Record()
        self._state, self._thread, self._depth, self._quiet = state, threading.get_ident(), 0, False
        self._touched: set[int] = set()
        self._modules: dict[int, nn.Module] = {}
        self._originals: dict[tuple[type, str], Callable[..., Any]] = {}

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        hooks = [
            module_hooks.register_module_module_registration_hook(lambda m, _, child: self._learn(m, child)),
            module_hooks.register_module_parameter_registration_hook(lambda m, _, p: self._learn(m)),
            module_hooks.register_module_buffer_registration_hook(self._buffer),
        ]
        try:
            with self:
                yield
        finally:
            for handle in hooks:
                handle.remove()
            for (owner, name), original in self._originals.items():
                setattr(owner, name, original)
        every = {id(m): m for module in self._modules.values() for m in module.modules()}
        self.record.slots = {s: t.detach() for m in every.values() for s, t in _slots(m).items()}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if self._quiet:
            return result
        if self._depth:
            leaves = tree_leaves((args, kwargs))
            self._touched.update(_key(t) for t in leaves if isinstance(t, torch.Tensor))
        elif func in _COPIES and isinstance(result, torch.Tensor) and args:
            source = args[0]
            if isinstance(source, torch.Tensor) and _key(source) != _key(result):
                self.record.events.append(_Copy(source.detach(), result.detach()))
        return result

    def _learn(self, *modules: nn.Module) -> None:
        """Patch the initialisers of a module's class (once) so that their calls are recorded."""
        for module in modules:
            if threading.get_ident() != self._thread or id(module) in self._modules:
                continue
            self._modules[id(module)] = module
            for name in INITIALISERS:
                owner = next((k for k in type(module).__mro__ if name in vars(k)), None)
                original = vars(owner).get(name) if owner is not None else None
                if owner is None or not inspect.isfunction(original) or (owner, name) in self._originals:
                    continue
                self._originals[(owner, name)] = original
                setattr(owner, name, self._recording(name, original))

    def _buffer(self, module: nn.Module, name: str, buffer: torch.Tensor | None) -> None:
        mine = threading.get_ident() == self._thread
        if mine and isinstance(module, _Loss) and buffer is not None and buffer.is_meta:
            raise ValueError(_loss_message(type(module).__name__, [name]))
        self._learn(module)

    def _recording(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def initialiser(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self._depth or threading.get_ident() != self._thread:
                return original(module, *args, **kwargs)
            self._quiet = True
            state = torch.get_rng_state()
            seed = None if torch.equal(state, self._state) else state
            before = {s: t.detach() for s, t in _slots(module).items()}
            self._quiet, self._depth, self._touched = False, 1, set()
            try:
                result = original(module, *args, **kwargs)
            finally:
                self._depth = 0
            self._quiet = True
            after = _slots(module)
            slots = []
            for slot in [*before, *(s for s in after if s not in before)]:
                b, a = before.get(slot), after.get(slot)
                keys = {_key(t) for t in (b, a) if t is not None}
                if len(keys) > 1 or keys & self._touched:
                    slots.append((slot, b, a if a is None else a.detach()))
            self.record.events.append(_Init(module, name, slots, args, kwargs, seed))
            self._state, self._quiet = torch.get_rng_state(), False
            return result

        return initialiser


# -- replaying it ----------------------------------------------------------------------------------


def _plan(model: nn.Module, record: _Record | None) -> tuple[list[_Event], dict[_Slot, int]]:
    """The events to replay for ``model``, and which tensor of the build each of its slots holds."""
    names = {id(m): f"{n or '(the model itself)'} ({type(m).__name__})" for n, m in model.named_modules()}
    for m in model.modules():
        if isinstance(m, _Loss) and _slots(m):
            raise ValueError(_loss_message(names[id(m)], [s.name for s in _slots(m)]))
    slots = _slots(model)
    if record is not None and all(s in record.slots for s in slots):
        refs, events = {s: record.slots[s] for s in slots}, list(record.events)
    else:  # built on the meta device without meta_build: each initialiser, children first
        fresh: dict[int, torch.Tensor] = {}  # a meta tensor of its own for each tensor of the model
        refs = {
            s: fresh.setdefault(id(t), torch.empty(t.shape, dtype=t.dtype, device="meta"))
            for s, t in slots.items()
        }
        events = [_whole(m, name, refs) for m in _children_first(model) if (name := _initialiser(m))]
    keys = {s: _key(t) for s, t in refs.items()}
    if callable(getattr(model, "init_weights", None)) and not any(
        isinstance(e, _Init) and e.module is model and e.method == "init_weights" for e in events
    ):
        events.append(_whole(model, "init_weights", refs))
    else:  # a constructor that never called its module's initialiser: run it after the rest, as before
        ran, defined = {id(e.module) for e in events if isinstance(e, _Init)}, _defined(events)
        late = [(m, n) for m in _children_first(model) if id(m) not in ran and (n := _initialiser(m))]
        events += [_whole(m, n, refs) for m, n in late if any(keys[s] not in defined for s in _slots(m))]
    defined, missing = _defined(events), dict[str, list[str]]()
    for slot, key in keys.items():
        if key not in defined:
            missing.setdefault(names[id(slot.module)], []).append(slot.name)
    if missing:
        shown = "; ".join(f"{m}: {', '.join(t)}" for m, t in list(missing.items())[:5])
        raise ValueError(
            f"built under shard.init_module(), these modules have parameters or buffers that no "
            f"initialiser sets: {shown}{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}. "
            "Give each module a reset_parameters() that fills its own parameters and buffers and call "
            "it from its constructor (as torch.nn layers do), give the model an init_weights() that "
            "initialises all of it, or build the model outside shard.init_module()"
        )
    return events, keys


def _loss_message(what: str, buffers: list[str]) -> str:
    return (
        f"{what} holds {', '.join(buffers)} as data: a loss's weight is given, not initialised, and under "
        "shard.init_module() it is built on the meta device, which keeps shapes but no values, so it "
        "cannot be rebuilt. Build the loss outside shard.init_module() (it has nothing to shard), or "
        "pass its weight after shard.prepare"
    )


def _initialiser(module: nn.Module) -> str | None:
    return next((n for n in INITIALISERS[:2] if callable(getattr(module, n, None))), None)


def _children_first(module: nn.Module, seen: set[int] | None = None) -> Iterator[nn.Module]:
    seen = set() if seen is None else seen
    seen.add(id(module))
    for child in module.children():
        if id(child) not in seen:
            yield from _children_first(child, seen)
    yield module


def _whole(module: nn.Module, method: str, refs: dict[_Slot, torch.Tensor]) -> _Init:
    """An initialiser that may touch any tensor of its subtree."""
    return _Init(module, method, [(s, refs[s], refs[s]) for s in _slots(module) if s in refs])


def _defined(events: Iterable[_Event]) -> set[int]:
    defined: set[int] = set()
    for e in events:
        if isinstance(e, _Init):
            defined.update(_key(after) for _, _, after in e.slots if after is not None)
        elif _key(e.source) in defined:
            defined.add(_key(e.target))
    return defined


def _replay(events: list[_Event], targets: dict[int, list[torch.Tensor]]) -> None:
    """Run the events; keep each tensor's slice once no later event touches it, then let it go."""
    last = {key: i for i, e in enumerate(events) for key in e.touches()}
    full: dict[int, torch.Tensor] = {}
    for i, event in enumerate(events):
        event.run(full)
        for key in event.touches():
            if last[key] == i and key in full:
                value = full.pop(key)
                for target in targets.get(key, ()):
                    _keep_slice(value, target)


def _keep_slice(full: torch.Tensor, target: torch.Tensor) -> None:
    """Copy the part of ``full`` that ``target`` holds on this rank into it."""
    full = full.detach()
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            full.shape, target.device_mesh, target.placements
        )
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        target.to_local().copy_(full[index])
    else:
        target.copy_(full)
