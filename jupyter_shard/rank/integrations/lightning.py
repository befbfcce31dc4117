"""Lightning in a rank: Trainer and Fabric see a torchrun launch of the pool's ranks, and what
``self.log`` records reaches the dashboard and ``jupyter_shard.history()``.

- ``devices="auto"`` means the pool's ranks per node (Lightning counts one CPU "device", or every
  visible GPU), so ``Trainer(devices="auto")`` matches the pool as ``devices=N`` does.
- The pool's ranks are torchrun's workers even when a SLURM job runs them, so Lightning's SLURM
  environment (which would take the world size from SLURM's task count) is not chosen in a rank.
- ``fabric.log`` / ``fabric.log_dict`` also send their values to ``shard.log``.
- :func:`callbacks` is the entry point Lightning calls for external callbacks
  (``lightning.pytorch.callbacks_factory``): in a rank it adds a logger next to the user's own, so
  every record Lightning logs (at ``log_every_n_steps``, epoch ends, validation) is also sent to
  ``shard.log``. Outside a rank it adds nothing.

Both packagings are handled: ``lightning`` (``lightning.pytorch``, ``lightning.fabric``) and the
standalone ``pytorch_lightning`` / ``lightning_fabric``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Any

from jupyter_shard.rank.integrations.hooks import Adjust
from jupyter_shard.rank.integrations.metrics import also_to_dashboard, to_dashboard
from jupyter_shard.rank.shard import current

_FABRIC = ("lightning.fabric", "lightning_fabric")
_TRAINER = ("lightning.pytorch", "pytorch_lightning")


def adjustments(device_type: str) -> dict[str, Adjust]:
    """Module name → what to change in it once imported."""
    found: dict[str, Adjust] = {}
    for package in (*_FABRIC, *_TRAINER):
        found[f"{package}.accelerators.cpu"] = _auto_devices("CPUAccelerator", device_type == "cpu")
        found[f"{package}.accelerators.cuda"] = _auto_devices("CUDAAccelerator", device_type == "cuda")
    for package in (*_FABRIC, *_TRAINER):
        found[f"{package}.strategies.launchers.multiprocessing"] = _no_spawn
    for package in _FABRIC:
        found[f"{package}.fabric"] = _fabric_logs
        found[f"{package}.utilities.registry"] = _quiet_about_this_callback
        found[f"{package}.plugins.environments.slurm"] = _not_slurm
        found[f"{package}.plugins.environments.torchelastic"] = _pool_sized
    return found


def _auto_devices(name: str, pool_device: bool) -> Adjust:
    def adjust(module: ModuleType) -> None:
        cls = getattr(module, name, None)
        if cls is None or not pool_device:
            return
        cls.auto_device_count = staticmethod(_ranks_per_node)

    return adjust


def _ranks_per_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)


def _fabric_logs(module: ModuleType) -> None:
    """``fabric.log`` and ``fabric.log_dict`` (which ``log`` calls) also reach the dashboard."""
    cls = getattr(module, "Fabric", None)
    if cls is not None:
        also_to_dashboard(cls, "log_dict", "metrics")


def _quiet_about_this_callback(module: ModuleType) -> None:
    """Lightning announces each external callback on every fit; this one is the pool's plumbing."""
    logging.getLogger(module.__name__).addFilter(
        lambda record: "entry point 'jupyter_shard'" not in record.getMessage()
    )


def _not_slurm(module: ModuleType) -> None:
    cls = getattr(module, "SLURMEnvironment", None)
    if cls is not None:
        cls.detect = staticmethod(lambda: False)


def _no_spawn(module: ModuleType) -> None:
    """``ddp_spawn``, ``ddp_fork`` and ``ddp_notebook`` run on the pool's ranks, as ``ddp`` does.

    Those strategies start their own processes from the one that calls ``fit``; in a rank, the
    processes already exist (the pool's), so the function runs here, as Lightning's launcher for
    processes started externally (torchrun) runs it.
    """
    cls = getattr(module, "_MultiProcessingLauncher", None)
    if cls is None:
        return
    launch = cls.launch

    @functools.wraps(launch)
    def in_this_rank(self: Any, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        environment = getattr(self._strategy, "cluster_environment", None)
        if environment is None or not environment.creates_processes_externally:
            if trainer is not None:
                kwargs["trainer"] = trainer
            return launch(self, function, *args, **kwargs)
        return function(*args, **kwargs)

    cls.launch = in_this_rank


def _pool_sized(module: ModuleType) -> None:
    """Asking for another number of processes than the pool's ranks fails at once, saying what to pass.

    Lightning sizes its world from ``devices`` and ``num_nodes``; under torchrun it neither checks
    nor changes the real one, and a mismatch would shard the data for ranks that do not exist.
    """
    cls = getattr(module, "TorchElasticEnvironment", None)
    if cls is None:
        return

    def set_world_size(self: Any, size: int) -> None:
        if size != self.world_size():
            raise ValueError(pool_size_message(size))

    cls.set_world_size = set_world_size


def pool_size_message(asked: int) -> str:
    """What to pass instead of ``devices`` × ``num_nodes`` = ``asked`` processes."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    per_node = _ranks_per_node()
    fit = f"devices={per_node}" + (f", num_nodes={nodes}" if nodes > 1 else "")
    where = f" ({per_node} on each of {nodes} nodes)" if nodes > 1 else ""
    return (
        f"Lightning was asked for {asked} processes (devices × num_nodes), but this pool has {world} "
        f'ranks{where}: pass {fit} or devices="auto", or start a pool of {asked} ranks with '
        f"%%distributed --nproc {asked}"
    )


def callbacks() -> list[Any]:
    """Entry point of ``lightning.pytorch.callbacks_factory``."""
    return _callbacks("lightning.pytorch")


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point of ``pytorch_lightning.callbacks_factory``."""
    return _callbacks("pytorch_lightning")


def _callbacks(package: str) -> list[Any]:
    if current() is None:
        return []
    return [dashboard_classes(package)[0]()]


@functools.cache
def dashboard_classes(package: str) -> tuple[type, type]:
    """The callback and logger classes for ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    callback_base = importlib.import_module(package).Callback
    logger_base = importlib.import_module(f"{package}.loggers").Logger

    class DashboardLogger(logger_base):  # type: ignore[misc, valid-type]
        """Sends every record Lightning logs to ``shard.log``.

        Its name and version are empty and its directory is the trainer's, so where checkpoints
        and logs go is what it would be without it (Lightning builds paths from the first logger).
        """

        def __init__(self, root: str) -> None:
            super().__init__()
            self._root = root

        @property
        def name(self) -> str:
            return ""

        @property
        def version(self) -> str:
            return ""

        @property
        def save_dir(self) -> str:
            return self._root

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            to_dashboard(metrics, step)

    class DashboardCallback(callback_base):  # type: ignore[misc, valid-type]
        """Adds a :class:`DashboardLogger` to the trainer's loggers as it sets up."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if not any(isinstance(logger, DashboardLogger) for logger in trainer.loggers):
                trainer.loggers = [*trainer.loggers, DashboardLogger(trainer.default_root_dir)]

    return DashboardCallback, DashboardLogger
