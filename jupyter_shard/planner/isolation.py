"""Running a function beside a real default process group without touching it.

Why it exists: the dry run makes a fake process group the default one for its length, and torch has
one default group per process. Inside a rank, or any process that already joined a real group, that
group must be neither replaced nor destroyed: :func:`forked` runs the function in a forked child
whose registry of process groups starts empty, and hands back its result (or its one-line error).
Forking, not spawning, lets the child see the caller's objects (a model, a builder) without pickling.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import TypeVar

from jupyter_shard.errors import SpecError

T = TypeVar("T")


def forked(function: Callable[[], T]) -> T:
    """``function()`` in a forked child with no process group; a :class:`SpecError` it raises is raised
    here with the same message, any other failure as a one-line :class:`SpecError`."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        from torch.distributed import distributed_c10d

        try:
            distributed_c10d._world = distributed_c10d._World()
            send.send(("ok", function()))
        except SpecError as exc:
            send.send(("error", str(exc)))
        except BaseException as exc:
            text = " ".join(str(exc).split())[:200]
            send.send(("error", f"the dry run failed in its child process: {type(exc).__name__}: {text}"))
        finally:
            os._exit(0)

    process = context.Process(target=child, daemon=True)
    process.start()
    send.close()
    try:
        kind, value = receive.recv()
    except EOFError:
        raise SpecError("the dry run's child process died before answering; run it outside a rank") from None
    finally:
        process.join()
    if kind == "error":
        raise SpecError(value)
    result: T = value
    return result
