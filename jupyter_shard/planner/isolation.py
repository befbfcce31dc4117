"""Running a function beside a real default process group without touching it.

Why it exists: the dry run makes a fake process group the default one for its length, and torch has
one default group per process. Inside a rank, or any process that already joined a real group, that
group must be neither replaced nor destroyed, so :func:`forked` runs the function in a child process,
whose registry of process groups starts empty, and hands back its result (or its one-line error).

The child is forked from multiprocessing's fork server, a fresh interpreter that has only imported
the dry run's modules (:data:`PRELOAD`), never from the caller, whose threads a fork does not copy.
After a backward on a CUDA build of torch (every GPU machine's; a fake tensor mode alone installs a
CUDA device guard there) autograd runs device threads, and a backward in a child forked from that
process fails: "Unable to handle autograd's threading in combination with fork-based
multiprocessing". A forked child also holds the caller's gloo group without its worker threads, and
freeing it there waits for them forever. Two other ways were rejected: forking only while autograd's
threads have not started needs a flag torch does not expose (the check lives in C++) and leaves the
group's threads; a non-default fake group beside the real one breaks torch's assumptions
(``DeviceMesh`` takes the rank, and each group its members, from the default group).

So the function travels by value (cloudpickle: a builder or class defined in the notebook travels
whole), and every tensor it refers to travels as its shape, since a dry run reads no tensor's
values: a parameter arrives as a meta tensor (a 7B model's structure costs nothing to send), any
other tensor (a batch, a buffer) as an uninitialised CPU tensor of its size and strides. None
arrives on a GPU, so the child makes no CUDA context.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import sys
import types
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import cloudpickle
import torch
from torch import nn

from jupyter_shard.errors import SpecError, one_line

T = TypeVar("T")

#: imported once by the fork server, so that each child starts with what the dry run needs
PRELOAD = [
    "jupyter_shard.planner.dry_run",
    "torch.distributed.fsdp",
    "torch.distributed._tools.fsdp2_mem_tracker",
    "torch.testing._internal.distributed.fake_pg",
]


def forked(function: Callable[[], T]) -> T:
    """``function()`` in a child forked from the fork server, with no process group; a
    :class:`SpecError` it raises is raised here with the same message, any other failure (including
    one to send the function) as a one-line :class:`SpecError`. The function and what it refers to
    are sent by value, each tensor as its shape; the result comes back by value."""
    try:
        payload = _dumps(function)
    except Exception as exc:
        raise SpecError(
            f"the dry run plans beside this process group in a fresh process and cannot send it the "
            f"model, batch or step ({one_line(exc)}); pass a function that builds the model instead"
        ) from exc
    context = multiprocessing.get_context("forkserver")
    # multiprocessing's one fork server: this takes effect if it has not started yet (it replaces a
    # preload list set before); a server started earlier leaves each child to import these itself
    context.set_forkserver_preload(PRELOAD)
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(payload, send), daemon=True)
    with _main_left_behind():
        process.start()
    send.close()
    try:
        kind, value = cloudpickle.loads(receive.recv_bytes())
    except EOFError:
        raise SpecError("the dry run's child process died before answering; run it outside a rank") from None
    except BaseException:
        process.kill()  # interrupted (Ctrl-C, a timeout): the child is not waited for
        raise
    finally:
        receive.close()
        process.join()
    if kind == "error":
        raise SpecError(value)
    result: T = value
    return result


def _child(payload: bytes, send: Connection) -> None:
    """In the child: run the function and send back ``("ok", result)`` or ``("error", message)``."""
    try:
        try:
            answer: tuple[str, Any] = ("ok", cloudpickle.loads(payload)())
            message = cloudpickle.dumps(answer)
        except SpecError as exc:
            message = cloudpickle.dumps(("error", str(exc)))
        except BaseException as exc:
            text = " ".join(str(exc).split())[:200]
            message = cloudpickle.dumps(
                ("error", f"the dry run failed in its child process: {type(exc).__name__}: {text}")
            )
        send.send_bytes(message)
    finally:
        os._exit(0)


@contextlib.contextmanager
def _main_left_behind() -> Iterator[None]:
    """While the child starts, a bare ``__main__``: multiprocessing would have the child run the
    caller's main script again (one that plans at its top level, unguarded by ``if __name__ ==
    "__main__"``, would start another child), and the child needs nothing from it, since cloudpickle
    sends what the function uses from there by value."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _dumps(function: Callable[[], object]) -> bytes:
    buffer = io.BytesIO()
    _ShapesPickler(buffer).dump(function)
    return buffer.getvalue()


class _ShapesPickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, with every tensor sent as its shape, dtype and strides."""

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:
                raise TypeError(f"a {obj.layout} tensor cannot be sent to the dry run; pass a dense one")
            shape = (tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.requires_grad)
            return _tensor, (*shape, isinstance(obj, nn.Parameter))
        return super().reducer_override(obj)


def _tensor(
    shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, parameter: bool
) -> torch.Tensor:
    """A tensor sent by :class:`_ShapesPickler`, rebuilt in the child without its values."""
    if parameter:
        return nn.Parameter(torch.empty_strided(shape, stride, dtype=dtype, device="meta"), requires_grad)
    return torch.empty_strided(shape, stride, dtype=dtype).requires_grad_(requires_grad)
