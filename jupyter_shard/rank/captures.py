"""Whether a CUDA graph capture is under way anywhere in this rank process.

The I/O thread reads CUDA memory for the heartbeat while a cell may be capturing a CUDA graph on the
main thread. ``torch.cuda.mem_get_info`` calls ``cudaMemGetInfo``, which a capture in the default
``"global"`` mode prohibits on every thread: the call fails and the user's capture is invalidated.
The allocator's counters (``memory_allocated``…) are host-side and stay safe.

torch has no process-wide question for this: ``torch.cuda.is_current_stream_capturing()`` asks about
the calling thread's current stream only (the I/O thread's is never the one capturing), and the
caching allocator's count of captures under way is not exposed. Every capture torch starts goes
through ``capture_begin`` and ``capture_end`` of ``torch.cuda.CUDAGraph`` (``torch.cuda.graph``,
``make_graphed_callables``, ``torch.compile``'s CUDA graphs) or of ``torch.accelerator.Graph``, which
are Python methods: :func:`watch` wraps them once, on the class, so every graph is counted, made
before or after (:mod:`~jupyter_shard.rank.shard` calls it as the rank imports it, before any cell).
A capture begun past torch (``torch._C._CUDAGraph`` itself, CuPy, a C++ extension) is not seen.
Captures in ``"thread_local"`` or ``"relaxed"`` mode would allow the probe from another thread, but
they are counted too: they are short, and a missed reading costs nothing.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["under_way", "unless_capturing", "watch"]

_capturing: set[int] = set()  # id() of each graph between capture_begin and capture_end
_lock = threading.Lock()
_WATCHED = "_jupyter_shard_watched"


def under_way() -> bool:
    """True from the start of a watched capture (any thread) until its end, failed or not."""
    return bool(_capturing)


def unless_capturing(call: Callable[[], T]) -> T | None:
    """``call()`` when no watched capture is under way, else None; a capture that begins meanwhile
    waits for ``call`` to return, so the two never overlap."""
    with _lock:
        return None if _capturing else call()


def watch() -> None:
    """Count the captures of torch's graph classes from now on (again: nothing more happens)."""
    import torch.cuda.graphs

    watch_class(torch.cuda.graphs.CUDAGraph)
    try:
        from torch.accelerator.graphs import Graph
    except ImportError:  # a torch without the device-generic graph
        return
    watch_class(Graph)


def watch_class(cls: type) -> None:
    """Wrap ``cls.capture_begin`` and ``cls.capture_end`` to count its captures under way."""
    begin: Callable[..., Any] = cls.capture_begin  # type: ignore[attr-defined]
    end: Callable[..., Any] = cls.capture_end  # type: ignore[attr-defined]
    if getattr(begin, _WATCHED, False):
        return

    @functools.wraps(begin)
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:  # counted before it starts: the probe may be skipped early, never run late
            _capturing.add(id(self))
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            with _lock:
                _capturing.discard(id(self))
            raise

    @functools.wraps(end)
    def capture_end(self: Any) -> Any:
        try:
            return end(self)
        finally:  # a capture that fails at its end is over too
            with _lock:
                _capturing.discard(id(self))

    setattr(capture_begin, _WATCHED, True)
    cls.capture_begin = capture_begin  # type: ignore[attr-defined]
    cls.capture_end = capture_end  # type: ignore[attr-defined]
