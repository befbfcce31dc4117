"""The pool's default process group in a rank: built at start-up, rebuilt after a release, and what a
cell's own ``init_process_group`` and ``destroy_process_group`` do to it.

A script written for ``torchrun`` calls ``init_process_group`` itself and ``destroy_process_group``
at its end. In a rank the group already exists, so :meth:`PoolGroup.install` replaces
``torch.distributed.init_process_group`` with a check: a call that matches the pool (backend, world
size, rank; any rendezvous, since the pool provides it) is accepted and changes nothing; one that
does not is a :class:`ValueError` saying what to change. ``destroy_process_group`` is torch's own: it
closes the group, and a later ``init_process_group`` in the same cell builds a new one on the pool's
store (every rank counts its rebuilds, so all of them meet under the same key). A cell that ends
without a group reports it in its ``done``; the kernel rebuilds the group before the next cell.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, PrefixStore

_DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA GPUs"}


class PoolGroup:
    """The default process group of this rank and the store it meets on."""

    def __init__(self, backend: str, device_type: str, rank: int, world_size: int, timeout: float) -> None:
        self.backend = backend
        self.device_type = device_type
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout)
        self.on_rebuilt: Callable[[], object] = lambda: None  # the shard helper's: its model's group changed
        self.agent_store: Any = None  # the torchrun agent's store, for ranks it started
        self._store: Any = None  # the store of the current generation of groups
        self._rebuilds = 0  # groups a cell built after destroying the pool's, since the last build
        self._original_init: Callable[..., None] | None = None
        self._retired: list[Any] = []  # groups a cell destroyed, freed at the next cell (see install)

    # -- built by the pool --------------------------------------------------------------------------

    def build_on_file(self, path: str) -> None:
        """The group on a FileStore in the pool's private directory (ranks this machine started)."""
        self._build(FileStore(path, self.world_size))

    def build_on_prefix(self, prefix: str) -> None:
        """The group on a prefix of the node agent's store (ranks torchrun started)."""
        self._build(PrefixStore(prefix, self.agent_store))

    def _build(self, store: Any) -> None:
        self.free_retired()
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a group broken by a release: drop it anyway
                dist.destroy_process_group()
        self._store, self._rebuilds = store, 0
        self._init(store)

    def _init(self, store: Any) -> None:
        init = self._original_init or dist.init_process_group
        init(self.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=self.timeout)

    @staticmethod
    def alive() -> bool:
        return bool(dist.is_initialized())

    # -- what a cell's own calls do ---------------------------------------------------------------

    def install(self) -> None:
        """Route ``torch.distributed.init_process_group`` (both names of it) through :meth:`user_init`."""
        original = dist.distributed_c10d.init_process_group
        self._original_init = original
        signature = inspect.signature(original)

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> None:
            arguments = signature.bind(*args, **kwargs).arguments
            mismatch = self.mismatch(arguments)
            if mismatch:
                raise ValueError(mismatch)
            self.user_init(arguments)

        dist.init_process_group = init_process_group
        dist.distributed_c10d.init_process_group = init_process_group

        # A gloo group freed while one of its worker threads still frees a work item deadlocks: the
        # thread freeing the group holds the GIL and joins the workers, and the worker needs the GIL
        # (torch 2.13 keeps a Python object in the work's thread-local state during backward). A
        # script's DDP model that goes out of scope right after destroy_process_group() frees its
        # group just then. Destroyed groups are therefore kept until the next cell, when the
        # workers are long idle.
        destroy = dist.distributed_c10d.destroy_process_group

        @functools.wraps(destroy)
        def destroy_process_group(group: Any = None) -> None:
            world = dist.distributed_c10d._world
            self._retired.extend(
                world.pg_map if group is None or group is dist.GroupMember.WORLD else [group]
            )
            destroy(group)

        dist.destroy_process_group = destroy_process_group
        dist.distributed_c10d.destroy_process_group = destroy_process_group

    def free_retired(self) -> None:
        """Free the groups cells destroyed (between cells: no work of theirs is in flight)."""
        self._retired.clear()

    def user_init(self, arguments: dict[str, Any]) -> None:
        """A cell's ``init_process_group(**arguments)`` that matches the pool: accepted."""
        if dist.is_initialized():
            return  # the pool's group is the one the script asked for
        self._rebuilds += 1
        self._init(PrefixStore(f"jupyter_shard/cell-group-{self._rebuilds}/", self._store))
        self.on_rebuilt()

    def mismatch(self, arguments: dict[str, Any]) -> str:
        """What to change when the call does not match this pool; empty when it does."""
        backend = arguments.get("backend")
        if backend and not self._backend_matches(str(backend)):
            where = _DEVICE_NAMES.get(self.device_type, self.device_type)
            other = "--device cuda" if self.device_type == "cpu" else "--device cpu"
            return (
                f'init_process_group(backend="{backend}"): this pool\'s ranks run on {where}, where its '
                f'process group uses {self.backend}. Pass backend="{self.backend}" or leave backend out, '
                f"or start the pool with %%distributed {other}"
            )
        world_size = int(arguments.get("world_size", -1))
        if world_size not in (-1, self.world_size):
            return (
                f"init_process_group(world_size={world_size}): this pool has {self.world_size} ranks. "
                f"Leave world_size out (WORLD_SIZE is set) or pass {self.world_size}, or start a pool "
                f"of {world_size} with %%distributed --nproc {world_size}"
            )
        rank = int(arguments.get("rank", -1))
        if rank not in (-1, self.rank):
            return (
                f"init_process_group(rank={rank}) on rank {self.rank}: the pool numbers its ranks. "
                'Leave rank out, or pass int(os.environ["RANK"])'
            )
        return ""

    def _backend_matches(self, backend: str) -> bool:
        """``gloo``, or a ``device:backend`` list whose entry for this pool's device is its backend."""
        wanted = backend.lower()
        if ":" not in wanted:
            return wanted == self.backend
        pairs = dict(part.split(":", 1) for part in wanted.split(",") if ":" in part)
        return pairs.get(self.device_type, self.backend) == self.backend
