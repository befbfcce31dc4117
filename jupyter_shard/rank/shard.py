"""``shard``: the helper every rank's namespace has (also ``from jupyter_shard import shard``).

It knows the rank's place in the world and the pool's strategy, and turns single-process training
code into distributed code: ``prepare`` wraps the model, rebuilds the optimizer over the wrapped
parameters and gives dataloaders a DistributedSampler; ``log`` sends scalars to the kernel.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import random
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from operator import itemgetter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from jupyter_shard.rank import captures
from jupyter_shard.rank.loaders import distributed_loader
from jupyter_shard.rank.recipe import Recipe, record
from jupyter_shard.strategies import create_strategy, strategy_class
from jupyter_shard.strategies.base import StrategyBase, StrategyContext
from jupyter_shard.wire.messages import METRICS, MetricsBody

Sender = Callable[[str, Mapping[str, Any], list[bytes]], None]


SENT_KEPT = 50_000  # logged records a rank keeps, per rank, for a kernel that attaches later


class Shard:
    """``shard`` in every rank: this rank's place in the pool, and single-process training made
    distributed for the pool's ``--strategy``.

    Where this rank is:
        ``rank``, ``local_rank``, ``world_size``, ``device`` (this rank's ``torch.device``),
        ``strategy``, ``is_main`` (rank 0).

    Training:
        ``with shard.init_module(): model = Big()`` builds a model too big for one device sharded
        (fsdp: on the meta device; ZeRO-3: partitioned);
        ``model, opt, loader = shard.prepare(model, opt, loader)`` wraps the model for the strategy,
        rebuilds the optimizer over the wrapped parameters and gives each dataloader a
        DistributedSampler; ``shard.backward(loss)`` and ``shard.step()`` (optimizer step and
        ``zero_grad``, with ``--accumulate`` and ``--clip-grad-norm``).

    Seeing and keeping it:
        ``shard.log(loss=loss)`` (the dashboard and ``jupyter_shard.history()``),
        ``shard.print0(...)`` (rank 0 only), ``shard.memory()``, ``shard.barrier()``,
        ``shard.save(path)`` / ``shard.load(path)`` (model, optimizer, step and random state; sharded
        under fsdp).

    The other public names here (``impl``, ``full_model``, ``flush_metrics``…) are used by the pool.
    """

    def __init__(
        self,
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
        strategy: str,
        send: Sender,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.device = device
        self.strategy = strategy
        self.is_main = rank == 0
        self._send = send
        self._options = dict(options or {})
        self._impl: StrategyBase | None = None
        self._model: nn.Module | None = None
        self._template: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._recipe: Recipe | None = None  # how to build the prepared model again (%dist_resume)
        self._step = 0
        self._micro = 0
        self._logged = 0
        self._stale = False  # the prepared model's wrapper holds a process group since replaced
        self._built_rng: torch.Tensor | None = None  # generator state of the last init_module
        # (step, wall time, values) per ``log`` call; drained by the I/O thread
        self._metrics: deque[tuple[float, float, dict[str, float]]] = deque()
        # records holding device scalars still on their way to the host (see ``log``)
        self._in_flight: deque[tuple[float, float, dict[str, Any]]] = deque()
        # what was sent, for a kernel that attaches to a kept pool (its dashboard carries on)
        self.sent: deque[tuple[float, float, dict[str, float]]] = deque(maxlen=SENT_KEPT)

    def __repr__(self) -> str:
        return (
            f"<shard rank {self.rank}/{self.world_size} local_rank {self.local_rank} "
            f"device {self.device} strategy {self.strategy}>"
        )

    @property
    def impl(self) -> StrategyBase:
        """The strategy object (built on first use from the pool's options)."""
        if self._impl is None:
            self._impl = self._build_strategy({})
        return self._impl

    def trial_strategy(self) -> StrategyBase:
        """A strategy object built from the pool's options as :meth:`prepare` builds one, and kept
        nowhere: a trial step (``%dist_picker --find-batch --confirm``) prepares its own model with
        it and leaves the prepared model, optimizer and step counter as they are."""
        return self._build_strategy({})

    def _build_strategy(self, overrides: dict[str, Any]) -> StrategyBase:
        common: dict[str, Any] = {"precision": "32", "accumulate": 1, "clip_grad_norm": None}
        settings = {**common, **{k: self._options[k] for k in common if self._options.get(k) is not None}}
        settings.update({k: v for k, v in overrides.items() if v is not None})
        accumulate = int(settings["accumulate"])
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate} is not valid; use 1 or more micro-steps per step")
        clip = settings["clip_grad_norm"]
        impl = create_strategy(self.strategy, **self._strategy_options())
        extra = {k: v for k, v in self._options.items() if k not in common and k != "strategy_options"}
        impl.setup(
            StrategyContext(
                rank=self.rank,
                local_rank=self.local_rank,
                world_size=self.world_size,
                device=self.device,
                precision=str(settings["precision"]),
                accumulate=accumulate,
                clip_grad_norm=float(clip) if clip is not None else None,
                extra=extra,
            )
        )
        return impl

    def _strategy_options(self) -> dict[str, Any]:
        """Strategy-specific options from ``--config FILE`` (JSON), for strategies that take them so."""
        config = self._options.get("config")
        if not config or not strategy_class(self.strategy).config_is_options:
            return {}
        with open(config) as fh:
            loaded = json.load(fh)
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {config}: expected a JSON object of {self.strategy} options")
        return loaded

    @contextlib.contextmanager
    def init_module(self) -> Iterator[None]:
        """Build a model in this block so that no rank ever holds all of it (sharding strategies).

        ``fsdp`` builds on the meta device and ``shard.prepare`` allocates only this rank's shard,
        initialised as a plain build from the same generator state would be (each module's
        ``reset_parameters()``); ``deepspeed`` at ZeRO stage 3 partitions each layer as it is built
        (``deepspeed.zero.Init``). Other strategies need the whole model on every rank and build it
        straight on the rank's device.
        """
        with self.impl.init_module() as state:
            yield
        self._built_rng = state

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *dataloaders: DataLoader[Any],
        accumulate: int | None = None,
        clip_grad_norm: float | None = None,
    ) -> Any:
        """Wrap ``model`` for the strategy; returns ``model`` or ``(model, optimizer, *loaders)``.

        ``optimizer`` is built by the user on the unwrapped model; it is rebuilt over the wrapped
        parameters with the same class and hyperparameters. ``accumulate`` and ``clip_grad_norm``
        override the pool's options of the same names.
        """
        self._impl = self._build_strategy({"accumulate": accumulate, "clip_grad_norm": clip_grad_norm})
        self._template = _meta_copy(model)
        self._recipe = record(model, self._template, optimizer, accumulate, clip_grad_norm)
        self._impl.built_rng, self._built_rng = self._built_rng, None
        wrapped, new_optimizer = self._impl.prepare(model, optimizer)
        self._model, self._optimizer = wrapped, new_optimizer
        self._stale = False
        self._micro = 0
        self._step = 0
        loaders = [self._distribute(loader) for loader in dataloaders]
        if optimizer is None and not loaders:
            return wrapped
        return (wrapped, new_optimizer, *loaders)

    def _distribute(self, loader: DataLoader[Any]) -> DataLoader[Any]:
        """``loader`` rebuilt with all its arguments over this rank's part of its dataset
        (:mod:`~jupyter_shard.rank.loaders`)."""
        return distributed_loader(loader, self.rank, self.world_size)

    @property
    def at_boundary(self) -> bool:
        """True when the next ``step()`` updates the weights (the last micro-step of an accumulation)."""
        return (self._micro + 1) % self.impl.ctx.accumulate == 0

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (accumulated micro-steps count once)."""
        return self._step

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass; gradients are synchronised only on the last micro-step of an accumulation."""
        model = self._require_model("backward")
        if self.at_boundary:
            self.impl.backward(loss, model)
        else:
            with self.impl.no_sync(model):
                self.impl.backward(loss, model)

    def step(self) -> None:
        """Optimizer step (clipping, loss scaling) at accumulation boundaries, then zero_grad."""
        model = self._require_model("step")
        if self._optimizer is None:
            raise RuntimeError("shard.step() needs an optimizer: call shard.prepare(model, optimizer) first")
        boundary = self.at_boundary
        self._micro += 1
        if boundary:
            self.impl.step(self._optimizer, model)
            self._step += 1

    def log(self, step: int | None = None, **scalars: float | torch.Tensor) -> None:
        """Send scalars (numbers or one-element tensors) to the kernel's dashboard and history.

        ``step`` defaults to a count of ``log`` calls. Cheap enough to call every step (about a
        microsecond): the record is queued here (one atomic append, no lock) and the I/O thread
        sends the queue in batches. A GPU tensor is not read here (that would wait for the device
        every step): it is copied to the host without blocking, and the I/O thread reads it once
        the copy is done.
        """
        on_device = False
        for name, value in scalars.items():
            kind = type(value)
            if kind is torch.Tensor and value.numel() == 1:  # type: ignore[union-attr]
                if value.device.type == "cpu":  # type: ignore[union-attr]
                    scalars[name] = value.item()  # type: ignore[union-attr]
                else:
                    scalars[name] = _HostCopy(value)  # type: ignore[assignment, arg-type]
                    on_device = True
            elif kind is not float:
                scalars[name] = _scalar(name, value)
        self._logged += 1
        record = (self._logged if step is None else step, time.time(), scalars)
        (self._in_flight if on_device else self._metrics).append(record)  # type: ignore[arg-type]

    def flush_metrics(self) -> None:
        """Send queued records (on the I/O thread) as float64 columns, a message per set of names.

        The conversion runs in C (``zip``, ``map``, ``itemgetter``), so the I/O thread holds the GIL
        for well under a microsecond per record and the training loop hardly waits for it.
        """
        queue = self._metrics
        batch = [queue.popleft() for _ in range(len(queue))]
        if self._in_flight:
            batch = sorted(batch + self._arrived(), key=itemgetter(1))
        if not batch:
            return
        self.sent.extend(batch)
        keysets = set(map(tuple, map(itemgetter(2), batch)))
        groups = (
            {keysets.pop(): batch}
            if len(keysets) == 1
            else {names: [r for r in batch if tuple(r[2]) == names] for names in keysets}
        )
        for names, records in groups.items():
            steps, times, values = zip(*records, strict=True)
            columns = [array("d", steps), array("d", times)]
            columns.extend(array("d", map(itemgetter(name), values)) for name in names)
            body: MetricsBody = {"rank": self.rank, "names": list(names), "count": len(records)}
            self._send(*METRICS(body), [c.tobytes() for c in columns])

    def _arrived(self) -> list[tuple[float, float, dict[str, float]]]:
        """Records whose device scalars have reached the host, oldest first; the rest wait."""
        done = []
        while self._in_flight and all(
            v.ready() for v in self._in_flight[0][2].values() if isinstance(v, _HostCopy)
        ):
            step, when, values = self._in_flight.popleft()
            done.append(
                (step, when, {k: v.value() if isinstance(v, _HostCopy) else v for k, v in values.items()})
            )
        return done

    def memory(self) -> dict[str, int]:
        """Bytes: ``rss``; ``parameters``/``gradients``/``optimizer`` as this rank holds them; CUDA on GPU."""
        report = memory_report(self.device)
        if self._model is not None:
            report.update(self.impl.memory(self._model, self._optimizer))
        return report

    def barrier(self) -> None:
        dist.barrier()

    def print0(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main:
            print(*args, **kwargs)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer, step and every rank's RNG state (sharded where the strategy shards)."""
        model = self._require_model("save")
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        all_rng: list[Any] = [None] * self.world_size
        dist.all_gather_object(all_rng, rng)
        extra = {"step": self._step, "rng": all_rng, "world_size": self.world_size, "strategy": self.strategy}
        self.impl.save(Path(path), model, self._optimizer, extra)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save` wrote into the prepared model and optimizer."""
        model = self._require_model("load")
        extra = self.impl.load(Path(path), model, self._optimizer)
        self._step = int(extra.get("step", 0))
        rngs = extra.get("rng") or []
        if len(rngs) == self.world_size:
            mine = rngs[self.rank]
            torch.set_rng_state(mine["torch"].cpu())
            random.setstate(mine["python"])
            if "cuda" in mine and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)
        dist.barrier()

    def full_model(self) -> nn.Module | None:
        """A plain (unwrapped, unsharded) CPU copy of the prepared model on rank 0; None elsewhere.

        Every rank must call it: sharded strategies gather collectively.
        """
        model = self._require_model("full_model")
        state = self.impl.full_state_dict(model)
        if state is None or self._template is None:
            return None
        plain = copy.deepcopy(self._template).to_empty(device="cpu")
        plain.load_state_dict(state)
        return plain

    @property
    def prepared_model(self) -> nn.Module | None:
        """The model returned by the last :meth:`prepare`."""
        return self._model

    @property
    def prepared_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer returned by the last :meth:`prepare` (None without one)."""
        return self._optimizer

    @property
    def recipe(self) -> Recipe | None:
        """How the last :meth:`prepare`'s model and optimizer are built again (``%dist_resume``)."""
        return self._recipe

    @property
    def progress(self) -> tuple[int, int]:
        """(optimizer steps, micro-steps): what a resumed pool continues from."""
        return self._step, self._micro

    @progress.setter
    def progress(self, value: tuple[int, int]) -> None:
        self._step, self._micro = value

    def group_rebuilt(self) -> bool:
        """The default process group was replaced; True if a prepared model's wrapper held the old one."""
        self._stale = self._model is not None and self.strategy != "none"
        return self._stale

    def _require_model(self, what: str) -> nn.Module:
        if self._model is None:
            raise RuntimeError(f"shard.{what}() needs a prepared model: call shard.prepare(model, ...) first")
        if self._stale:
            raise RuntimeError(
                f"shard.{what}(): the model was prepared before the process group was rebuilt (after a "
                f"desync), and its {self.strategy} wrapper still holds the old group. Run the cells that "
                "build and prepare the model again, or %dist_restart for fresh ranks"
            )
        return self._model


def _meta_copy(model: nn.Module) -> nn.Module | None:
    """The model's architecture without its data, to rebuild a plain module from a full state dict.

    Its tensors are meta tensors of the full shapes from the start (a partitioned ZeRO-3 parameter
    keeps its full shape in ``ds_shape``), so the copy never allocates the model's memory.
    """
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty(getattr(t, "ds_shape", t.shape), dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        return copy.deepcopy(model, memo)
    except Exception:
        return None


class _HostCopy:
    """A one-element device tensor on its way to the host: copied without blocking, read when there."""

    __slots__ = ("_event", "_host")

    def __init__(self, value: torch.Tensor) -> None:
        self._host = value.detach().to("cpu", non_blocking=True)
        self._event: Any = None
        if value.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def value(self) -> float:
        return float(self._host.item())


def _scalar(name: str, value: object) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"shard.log({name}=...) needs a scalar, got shape {tuple(value.shape)}")
        return float(value.item())
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(
            f"shard.log({name}=...) needs a number or a one-element tensor, got {value!r}"
        ) from None


# Counted from the rank's import of this module, before any cell can begin a capture.
captures.watch()


def memory_report(device: torch.device | None = None) -> dict[str, int]:
    """Bytes: ``rss``; on a CUDA device the allocator's counters, and the device's free and total
    memory unless a CUDA graph is being captured (:mod:`~jupyter_shard.rank.captures`: asking the
    driver then would break the capture)."""
    report = {"rss": _rss()}
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        report["cuda_allocated"] = torch.cuda.memory_allocated(device)
        report["cuda_reserved"] = torch.cuda.memory_reserved(device)
        report["cuda_peak"] = torch.cuda.max_memory_allocated(device)
        free_total = captures.unless_capturing(lambda: torch.cuda.mem_get_info(device))
        if free_total is not None:
            report["cuda_free"], report["cuda_total"] = free_total
    return report


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


_current: Shard | None = None


def set_current(helper: Shard) -> None:
    global _current
    _current = helper


def current() -> Shard | None:
    """This rank's ``shard``, or None outside a rank process."""
    return _current
