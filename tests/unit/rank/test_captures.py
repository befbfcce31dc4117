"""The heartbeat's memory probe and a user's CUDA graph capture (:mod:`jupyter_shard.rank.captures`):
while any thread captures, the driver is not asked (``cudaMemGetInfo`` would break the capture) and
the allocator's host-side counters still are. CUDA is faked: these run on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from jupyter_shard.rank import captures
from jupyter_shard.rank.shard import memory_report

CUDA = torch.device("cuda", 0)


class _Graph:
    """A graph class as torch's are: Python ``capture_begin``/``capture_end`` over the real ones."""

    fail_at: str = ""

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self.fail_at == "begin":
            raise RuntimeError("capture could not begin")

    def capture_end(self) -> None:
        if self.fail_at == "end":
            raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture
def graph_class(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Graph]]:
    class Graph(_Graph):
        pass

    monkeypatch.setattr(captures, "_capturing", set())
    captures.watch_class(Graph)
    yield Graph


@pytest.fixture
def driver_calls(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """A rank on an initialised CUDA device: allocator counters, and the driver query recorded."""
    calls: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        calls.append(device)
        return 3, 4

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 5)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return calls


def test_the_driver_is_not_asked_while_a_graph_is_captured(
    graph_class: type[_Graph], driver_calls: list[torch.device]
) -> None:
    counters = {"cuda_allocated": 1, "cuda_reserved": 2, "cuda_peak": 5}
    graph = graph_class()
    graph.capture_begin(capture_error_mode="global")
    assert captures.under_way()
    report = memory_report(CUDA)
    assert driver_calls == [], "cudaMemGetInfo during a global-mode capture invalidates it"
    assert {k: v for k, v in report.items() if k != "rss"} == counters
    graph.capture_end()
    assert not captures.under_way()
    assert {k: v for k, v in memory_report(CUDA).items() if k != "rss"} == {
        **counters,
        "cuda_free": 3,
        "cuda_total": 4,
    }
    assert driver_calls == [CUDA]


def test_a_capture_that_fails_to_begin_or_at_its_end_is_over(graph_class: type[_Graph]) -> None:
    graph = graph_class()
    graph.fail_at = "begin"
    with pytest.raises(RuntimeError, match="could not begin"):
        graph.capture_begin()
    assert not captures.under_way()
    graph.fail_at = "end"
    graph.capture_begin()
    with pytest.raises(RuntimeError, match="not permitted"):
        graph.capture_end()
    assert not captures.under_way()


def test_captures_are_counted_per_graph_and_watching_twice_wraps_once(graph_class: type[_Graph]) -> None:
    wrapped = graph_class.capture_begin
    captures.watch_class(graph_class)
    assert graph_class.capture_begin is wrapped
    first, second = graph_class(), graph_class()
    first.capture_begin()
    second.capture_begin()
    first.capture_end()
    assert captures.under_way(), "the second capture is still under way"
    second.capture_end()
    assert not captures.under_way()


@pytest.mark.skipif(
    torch.cuda.CUDAGraph.__bases__[0].__module__ != "torch._utils",
    reason="a CUDA build: its graph base class is torch's own and cannot be faked",
)
def test_torchs_own_graph_class_is_watched_once_the_rank_imports_shard(
    monkeypatch: pytest.MonkeyPatch, driver_calls: list[Any]
) -> None:
    """Through ``torch.cuda.CUDAGraph``'s own methods, as ``torch.cuda.graph`` and torch.compile's
    CUDA graphs call them; its C++ base is faked (a stand-in on a CPU build)."""
    from torch.cuda.graphs import CUDAGraph

    base = CUDAGraph.__bases__[0]
    monkeypatch.setattr(base, "capture_begin", lambda self, **kw: None, raising=False)
    monkeypatch.setattr(base, "capture_end", lambda self: None, raising=False)
    monkeypatch.setattr(captures, "_capturing", set())
    graph = object.__new__(CUDAGraph)
    graph._tracker = None
    graph.capture_begin()
    memory_report(CUDA)
    assert captures.under_way() and driver_calls == []
    graph.capture_end()
    memory_report(CUDA)
    assert not captures.under_way() and driver_calls == [CUDA]
