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

On CUDA ranks the group is device-mapped (``"cpu:gloo,cuda:nccl"``, see :mod:`.device`) and bound
to the rank's GPU (``device_id``), so NCCL starts, and fails, at ``init_process_group`` rather than
in the first collective. Freeing ranks blocked in a collective differs by backend
(:meth:`PoolGroup.release_steps`), and so does telling that a group is still usable
(:meth:`PoolGroup.alive`): NCCL's watchdog records an error where gloo records none, and where that
record cannot be read the group is rebuilt after a cell that failed inside torch.distributed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, PrefixStore

from jupyter_shard.rank.cuda_errors import exception_chain
from jupyter_shard.rank.device import device_backends
from jupyter_shard.wire.messages import GROUP_DESTROYED, GROUP_UNKNOWN

_DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA GPUs"}

Role = Literal["idle", "blocked"]  # a rank that left the cell, or one still waiting in a collective
Step = Literal["destroy", "abort", "close"]

# torch's names for the NCCL watchdog's error handling, first set wins, and its default (3: end the
# process); ProcessGroupNCCL.hpp in torch's include directory documents them.
_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
_ERROR_HANDLING_DEFAULT = "3"
UNKNOWN = GROUP_UNKNOWN  # the NCCL backend's health where it cannot be read
_DISTRIBUTED_DIR = os.path.dirname(dist.__file__) + os.sep


def broken_by(error: str, handling: str) -> bool:
    """Whether an NCCL group whose watchdog recorded ``error`` (an ``ErrorType`` name) can no longer
    be used, given ``TORCH_NCCL_ASYNC_ERROR_HANDLING``. With handling 0 (the pool's) a timeout is
    only recorded: the collective goes on and may still complete, so the group is kept; any other
    handling aborts the communicators on a timeout (or ends the process). A communication error or
    one signalled by a peer always leaves the communicators unusable."""
    if error == "SUCCESS":
        return False
    if error == "TIMEOUT":
        return handling.strip() != "0"
    return True


def collective_failed(failure: BaseException) -> bool:
    """Whether a cell's ``failure`` came out of torch.distributed: a ``DistError`` (NCCL's errors,
    a watchdog's timeout), or any exception raised inside a torch.distributed call (a collective, a
    barrier, FSDP's gathers), found in the tracebacks of the chain. Read from the exception alone."""
    for exc in exception_chain(failure):
        if isinstance(exc, dist.DistError):
            return True
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_DISTRIBUTED_DIR):
                return True
            tb = tb.tb_next
    return False


class PoolGroup:
    """The default process group of this rank and the store it meets on."""

    def __init__(
        self,
        backend: str,
        device_type: str,
        rank: int,
        world_size: int,
        timeout: float,
        device_id: torch.device | None = None,
    ) -> None:
        self.backend = backend
        self.device_type = device_type
        self.device_id = device_id  # a CUDA rank's GPU: the group is bound to it (eager NCCL start)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout)
        self.on_rebuilt: Callable[[], object] = lambda: None  # the shard helper's: its model's group changed
        self.agent_store: Any = None  # the torchrun agent's store, for ranks it started
        self._store: Any = None  # the store of the current generation of groups
        self._rebuilds = 0  # groups a cell built after destroying the pool's, since the last build
        self._original_init: Callable[..., None] | None = None
        self._retired: list[Any] = []  # groups a cell destroyed, freed at the next cell (see install)
        self._abort_lock = threading.Lock()

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
                if "abort" in self.release_steps(self.backend, "idle"):
                    self.abort()  # NCCL's destroy waits for pending kernels, which may never end
                else:
                    dist.destroy_process_group()
        self._store, self._rebuilds = store, 0
        self._init(store)

    def _init(self, store: Any) -> None:
        init = self._original_init or dist.init_process_group
        init(self.backend, store=store, **self.init_options())

    def init_options(self) -> dict[str, Any]:
        """The pool's ``init_process_group`` arguments besides backend and store."""
        options: dict[str, Any] = {"rank": self.rank, "world_size": self.world_size, "timeout": self.timeout}
        if self.device_id is not None:
            options["device_id"] = self.device_id
        return options

    def alive(self, failure: BaseException | None = None) -> bool:
        """Whether this rank still has a usable default group after a cell that raised ``failure``
        (None: it succeeded): :meth:`unusable` names no reason."""
        return not self.unusable(failure)

    def unusable(self, failure: BaseException | None = None) -> str:
        """Why this rank's default group cannot be used after a cell that raised ``failure`` (None:
        it succeeded), for the kernel's notice; "" while it can. ``GROUP_DESTROYED``: there is none
        (a cell destroyed it, or a release aborted it). On NCCL, the error its watchdog recorded, when
        that breaks it (:func:`broken_by`); where the record cannot be read, :data:`UNKNOWN` after a
        cell whose failure came from torch.distributed (:func:`collective_failed`). The kernel
        rebuilds the group in each case."""
        if not dist.is_initialized():
            return GROUP_DESTROYED
        error = self._nccl_error()  # "SUCCESS" on gloo: no environment to read after every cell
        if error == "SUCCESS":
            return ""
        if error == UNKNOWN:
            return UNKNOWN if failure is not None and collective_failed(failure) else ""
        return error if broken_by(error, self._error_handling()) else ""

    def _nccl_error(self) -> str:
        """The NCCL backend's recorded error (an ``ErrorType`` name from ``Backend.get_error``);
        "SUCCESS" on a group without NCCL (gloo records none); :data:`UNKNOWN` where it cannot be
        read (a torch without ``get_error``, a group without an NCCL backend for CUDA)."""
        if "nccl" not in device_backends(self.backend).values():
            return "SUCCESS"
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
            return str(backend.get_error().name)
        except Exception:
            return UNKNOWN

    @staticmethod
    def _error_handling() -> str:
        for name in _ERROR_HANDLING_VARS:
            if os.environ.get(name):
                return os.environ[name]
        return _ERROR_HANDLING_DEFAULT

    # -- freeing ranks blocked in a collective ----------------------------------------------------

    @staticmethod
    def release_steps(backend: str, role: Role) -> tuple[Step, ...]:
        """What a rank does to free ranks blocked in a collective, by backend and by its ``role``.

        - gloo: an idle rank destroys its group and shuts down its TCP connections to the other ranks,
          so a peer's collective fails at once ("Connection closed by peer"); a blocked rank can do
          nothing for itself (torch's abort does not end a local gloo collective waiting on a peer).
        - nccl: every rank aborts its communicators (``ncclCommAbort`` stops their kernels, where
          ``destroy_process_group`` would wait for them); a blocked rank does so from its I/O thread,
          its main thread being stuck in a CUDA sync or an NCCL wait.
        - ``cpu:gloo,cuda:nccl``: both: the abort for the NCCL part, and the idle ranks' connections
          shut down for the gloo part (torch's abort leaves gloo as it is).
        """
        backends = set(device_backends(backend).values())
        nccl, gloo = "nccl" in backends, "gloo" in backends
        if role == "blocked":
            return ("abort",) if nccl else ()
        first: tuple[Step, ...] = ("abort",) if nccl else ("destroy",)
        return first + (("close",) if gloo else ())

    def abort(self) -> bool:
        """Abort every process group of this rank (torch's ``_abort_process_group``), from any thread;
        False when there was none. The kernel rebuilds the group before the next cell."""
        with self._abort_lock:  # the I/O thread's abort and a release or regroup may meet
            if not dist.is_initialized():
                return False
            dist.distributed_c10d._abort_process_group()
            return True

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
            mine = self._own_backend()
            uses = mine if mine == self.backend else f'{mine} (and gloo for CPU tensors: "{self.backend}")'
            return (
                f'init_process_group(backend="{backend}"): this pool\'s ranks run on {where}, where its '
                f'process group uses {uses}. Pass backend="{mine}" or leave backend out, '
                f"or start the pool with %%distributed {other}"
            )
        device_id = self._device_id_mismatch(arguments.get("device_id"))
        if device_id:
            return device_id
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

    def _own_backend(self) -> str:
        """The backend this pool's group uses for its ranks' own device (nccl on CUDA, gloo on CPU)."""
        return device_backends(self.backend).get(self.device_type, self.backend)

    def _backend_matches(self, backend: str) -> bool:
        """Whether ``backend`` names one for this pool's device, and the pool's backend for every
        device its ranks use (CPU, and CUDA on a CUDA pool): ``nccl`` or ``cpu:gloo,cuda:nccl`` on
        CUDA, ``gloo`` on CPU."""
        try:
            wanted = device_backends(backend)
        except ValueError:  # not a device:backend list torch can read
            return False
        mine = device_backends(self.backend)
        used = {self.device_type, "cpu"}
        return self.device_type in wanted and all(wanted[d] == mine.get(d) for d in used & set(wanted))

    def _device_id_mismatch(self, device_id: object) -> str:
        if device_id is None:
            return ""
        try:
            given = (
                torch.device("cuda", device_id)
                if isinstance(device_id, int)
                else torch.device(str(device_id))
            )
        except (RuntimeError, ValueError):
            return f'init_process_group(device_id={device_id!r}): not a device; pass torch.device("cuda", k)'
        if self.device_id is None:
            return (
                f"init_process_group(device_id={given}): this pool's ranks run on CPU. Leave device_id out, "
                "or start the pool with %%distributed --device cuda"
            )
        if given != self.device_id:
            return (
                f"init_process_group(device_id={given}) on rank {self.rank}: this rank's GPU is "
                f'{self.device_id}. Leave device_id out, or pass torch.device("cuda", '
                'int(os.environ["LOCAL_RANK"]))'
            )
        return ""
