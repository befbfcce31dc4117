"""Which modules of a model FSDP2 shards as units of their own, and with which precision policy.

Why it exists: ``fully_shard`` per module is what FSDP2 asks of its user, and the wrong choice
crashes or wastes memory on the models people train: a ``ModuleList`` has no ``forward`` (FSDP2
refuses it), a tied embedding split between two units is refused as "shared with a parameter already
managed by another FSDP group", an embedding chosen as the "block" because it is big makes a whole
stack one unit, and BatchNorm's float32 statistics refuse bfloat16 parameters. The fsdp strategy
and the dry run both take their units from here, so a plan wraps what a pool wraps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import MixedPrecisionPolicy

WRAPPED = "_checkpoint_wrapped_module."

SPLIT_ABOVE = 1 << 20  # parameters: a smaller model stays one unit (one all-gather per step is cheaper)
#: modules that hold others but never run themselves: FSDP2 refuses them as units, and their hooks
#: would never fire
_NO_FORWARD = (nn.ModuleList, nn.ModuleDict)
#: instances of a stacked class this many times apart in size are stages, not blocks
UNEVEN = 3


def default_units(model: nn.Module) -> list[nn.Module]:
    """One FSDP unit per repeated block, and one per other large module; children before parents.

    The block is the repeated layer of the model's stack: of the classes with two or more instances
    that hold other modules and stand side by side in a ``ModuleList`` or ``Sequential`` (a
    transformer's layer, a ResNet's block, not its ``Linear`` or its two ``T5Stack``s), the one whose
    instances hold the most parameters. Without such a class, the coarsest class with two or more
    instances that together hold a third of the parameters (a stack of ``Linear``). The rest of the
    model's modules get a unit of their own when they hold at least as many parameters as an average
    block (an embedding, an output head), so that no unit, the root included, is much bigger than a
    block. A model under :data:`SPLIT_ABOVE` parameters stays one unit.

    A parameter shared between modules (tied input and output embeddings, T5's shared table) belongs
    to the smallest module that holds every module using it, as FSDP2 requires: no module that holds
    only some of its users becomes a unit, so a tied embedding is left to the root. A module without
    a ``forward`` of its own (``ModuleList``, ``ModuleDict``) is never a unit.
    """
    total = sum(p.numel() for p in model.parameters())
    if total < SPLIT_ABOVE:
        return []
    named = [(n, m) for n, m in model.named_modules() if n and not n.endswith(WRAPPED[:-1])]
    barred = split_sharers(model)
    able = [(n, m) for n, m in named if id(m) not in barred and not without_forward(m)]
    blocks = _blocks(able, _listed([("", model), *named]), total)  # the root may hold the stack
    chosen = {id(m) for m in blocks}
    claimed = {id(p) for m in blocks for p in m.parameters()}
    in_blocks = sum(p.numel() for m in blocks for p in m.parameters())
    threshold = in_blocks // len(blocks) if blocks else total // 8  # an average block
    targets: list[nn.Module] = []
    for _, module in reversed(able):
        if id(module) in chosen:
            targets.append(module)
            continue
        free = [p for p in module.parameters() if id(p) not in claimed]
        if free and sum(p.numel() for p in free) >= threshold:
            targets.append(module)
            claimed.update(id(p) for p in free)
    return targets


def unit_policies(
    model: nn.Module, targets: list[nn.Module], dtype: torch.dtype | None
) -> list[tuple[nn.Module, MixedPrecisionPolicy]]:
    """Every module ``fully_shard`` is called on, children first and the root last, with its mixed
    precision policy: ``targets`` and the root compute in ``dtype`` and reduce in float32; under a
    low ``dtype`` each of :func:`fp32_units` is a unit first that keeps float32."""
    low = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=dtype)
    fp32 = fp32_units(model) if dtype is not None else []
    kept = {id(m) for m in fp32}
    units = [(m, keep) for m in fp32 if m is not model]
    units += [(m, low) for m in targets if id(m) not in kept]
    return [*units, (model, keep if id(model) in kept else low)]


def fp32_units(model: nn.Module) -> list[nn.Module]:
    """The modules that keep float32 parameters under a low ``--precision``, each its own FSDP unit:
    batch norms, whose running statistics stay float32 and which CPU kernels refuse to mix with
    bfloat16 parameters (``expected scalar type BFloat16 but found Float``). Their unit computes in
    float32 and hands its output on in the low dtype."""
    norms: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return norms[::-1]


def unit_problem(model: nn.Module, module: nn.Module, name: str) -> str | None:
    """Why ``module`` (called ``name`` in ``model``) cannot be an FSDP unit of its own, or None."""
    if without_forward(module):
        return f"{name} is a {type(module).__name__}, which has no forward of its own"
    if id(module) in split_sharers(model):
        return f"{name} shares a parameter with a module outside it (tied weights)"
    return None


def check_named_units(model: nn.Module, classes: frozenset[str]) -> None:
    """One line for an ``auto_wrap`` class that cannot be a unit: no forward, or a split tied weight."""
    for name, module in model.named_modules():
        if name and class_name(module) in classes:
            problem = unit_problem(model, module, name)
            if problem is not None:
                raise ValueError(
                    f"fsdp auto_wrap names {class_name(module)}, but {problem}; name the class of the "
                    "model's repeated layer instead, or leave auto_wrap out"
                )


def _blocks(able: list[tuple[str, nn.Module]], parents: set[int], total: int) -> list[nn.Module]:
    """The repeated block's instances (see :func:`default_units`), or none; ``parents`` are the
    modules that stand in a list beside others of their class (:func:`_listed`)."""
    by_class = _outermost_by_class(able)
    stacked = {
        kind: instances
        for kind, instances in by_class.items()
        if sum(id(m) in parents for m in instances) >= 2 and any(True for _ in instances[0].children())
    }
    if stacked:
        blocks = _most_covering(stacked.values())
        sizes = [_size(m) for m in blocks]
        if max(sizes) > UNEVEN * max(min(sizes), 1):
            # stages of uneven width, each a stack of blocks (a ResNet): the blocks inside them
            inside = {id(m) for b in blocks for m in b.modules() if m is not b}
            inner = [ms for ms in stacked.values() if all(id(m) in inside for m in ms)]
            blocks = _most_covering(inner) if inner else blocks
        return blocks
    blocks = []
    for instances in by_class.values():
        covered = sum(_size(m) for m in instances)
        if len(instances) >= 2 and 3 * covered >= total and (not blocks or len(instances) < len(blocks)):
            blocks = instances
    return blocks


def _most_covering(groups: Iterable[list[nn.Module]]) -> list[nn.Module]:
    """The group whose modules hold the most parameters; of equals, the one with fewer modules."""
    return max(groups, key=lambda ms: (sum(_size(m) for m in ms), -len(ms)))


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _listed(named: list[tuple[str, nn.Module]]) -> set[int]:
    """Modules that stand in a ``ModuleList`` or ``Sequential`` beside another of their class."""
    found: set[int] = set()
    for _, module in named:
        if isinstance(module, nn.ModuleList | nn.Sequential):
            kids = list(module.children())
            kinds = [class_name(k) for k in kids]
            found.update(id(k) for k, kind in zip(kids, kinds, strict=True) if kinds.count(kind) >= 2)
    return found


def split_sharers(model: nn.Module) -> set[int]:
    """Modules that hold some but not all of the modules using a shared parameter (by identity)."""
    paths: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(name.rsplit(".", 1)[0] if "." in name else "")
    barred_names: set[str] = set()
    for owners in paths.values():
        if len(set(owners)) < 2:
            continue
        common = _common_prefix([o.split(".") if o else [] for o in owners])
        for owner in owners:
            parts = owner.split(".") if owner else []
            for depth in range(len(common) + 1, len(parts) + 1):
                barred_names.add(".".join(parts[:depth]))
    if not barred_names:
        return set()
    return {id(m) for n, m in model.named_modules(remove_duplicate=False) if n in barred_names}


def _common_prefix(paths: list[list[str]]) -> list[str]:
    common = paths[0]
    for path in paths[1:]:
        size = 0
        while size < min(len(common), len(path)) and common[size] == path[size]:
            size += 1
        common = common[:size]
    return common


def without_forward(module: nn.Module) -> bool:
    inner = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
    return isinstance(inner, _NO_FORWARD) or type(inner).forward is nn.Module.forward


def _outermost_by_class(named: list[tuple[str, nn.Module]]) -> dict[str, list[nn.Module]]:
    """Instances of each module class (by name) that are not inside another instance of that class."""
    found: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in named:
        if not any(True for _ in module.parameters()):
            continue
        kind = class_name(module)
        seen = found.setdefault(kind, [])
        if not any(name.startswith(outer + ".") for outer, _ in seen):
            seen.append((name, module))
    return {kind: [m for _, m in pairs] for kind, pairs in found.items()}


def class_name(module: nn.Module) -> str:
    inner = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
    return type(inner).__name__
