"""jupyter_shard.planner.trial in one process (strategy ``none``, no process group): the step is built
from the expressions over the namespace without writing to it, measured, and freed; a name the rank
lacks is one line saying where to define it; the batch keeps its values at another size. The real
pool's step (gloo, two ranks) is in tests/integration/test_picker_confirm.py."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

from jupyter_shard.planner.trial import (
    CPU_PEAK,
    TrialError,
    TrialOutOfMemory,
    TrialRequest,
    _batch,
    _free_names,
    _measured,
)
from jupyter_shard.rank.shard import Shard


def helper() -> Shard:
    return Shard(0, 0, 1, torch.device("cpu"), "none", lambda *a: None)


class Probe(nn.Linear):
    """A layer only these tests build, to count what a trial leaves alive."""


def build() -> nn.Sequential:
    return nn.Sequential(Probe(64, 256), nn.ReLU(), Probe(256, 1))


def request(**kw: Any) -> TrialRequest:
    base: TrialRequest = {
        "model": "build()",
        "code": None,
        "batch": "torch.randn(4, 64)",
        "batch_size": 4,
        "size": 32,
        "step": None,
    }
    return {**base, **kw}  # type: ignore[typeddict-item]


def live_probes() -> int:
    gc.collect()
    return sum(type(o) is Probe for o in gc.get_objects())


def test_the_step_is_measured_and_everything_it_made_is_freed() -> None:
    ns: dict[str, Any] = {"build": build}
    report = _measured(request(), helper(), ns)
    params = (64 * 256 + 256 + 256 + 1) * 4
    # parameters, gradients and AdamW's two moments at least, and the batch of 32
    assert report["peak"] > 4 * params + 32 * 64 * 4 and report["how"] == CPU_PEAK and report["free"] is None
    assert ns == {"build": build}, "nothing is defined in the namespace"
    assert live_probes() == 0, "the trial's model is freed"


def test_the_cells_code_builds_the_model_and_a_module_is_copied_not_touched() -> None:
    mine = nn.Sequential(nn.Linear(64, 8))
    first = mine[0]
    assert isinstance(first, nn.Linear)
    weights = first.weight.detach().clone()
    cell = "model = nn.Sequential(nn.Linear(64, 8))\nunused = 1"
    assert _measured(request(model=None, code=cell), helper(), {})["peak"] > 0
    assert _measured(request(model="mine"), helper(), {"mine": mine})["peak"] > 0
    assert torch.equal(first.weight, weights) and first.weight.grad is None


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"model": "make()"}, "the model expression 'make()' does not evaluate on the ranks (NameError"),
        ({"batch": "data"}, "--batch 'data' does not evaluate"),
        ({"model": None, "code": "model = make()"}, "define make in a %%distributed cell first"),
        ({"model": "3"}, "gives no nn.Module on the ranks"),
        ({"batch": "torch.randn(4, 7)"}, "the real step raised RuntimeError"),
    ],
)
def test_what_does_not_build_on_the_rank_is_one_line(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(TrialError) as caught:
        _measured(request(**kw), helper(), {"build": build})
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert live_probes() == 0, "the error's traceback keeps no frame that holds the model"


def test_the_batch_keeps_its_values_cut_or_repeated_to_the_size() -> None:
    ns = {"ids": torch.arange(4).reshape(4, 1)}
    grown = _batch(request(batch="(ids, {'mask': ids > 1})", size=6), ns, torch.device("cpu"))
    ids, mask = grown[0], grown[1]["mask"]  # type: ignore[index]
    assert ids.flatten().tolist() == [0, 1, 2, 3, 0, 1] and mask.shape == (6, 1)
    cut = _batch(request(batch="ids", size=2), ns, torch.device("cpu"))
    assert isinstance(cut, torch.Tensor) and cut.flatten().tolist() == [0, 1]
    assert cut.untyped_storage().nbytes() == 2 * 8, "a copy of the rows kept, not a view of them all"


def test_free_names_are_what_an_expression_reads() -> None:
    assert _free_names("build(n_layer=depth)") == ["build", "depth"]
    assert _free_names("torch.randn(8, 1024)") == ["torch"]
    assert _free_names("[f(i) for i in range(k)]") == ["f", "range", "k"]
    assert _free_names("(lambda x: x + y)(1)") == ["y"]
    assert _free_names("torch.randn(8,") == []


def test_a_step_out_of_memory_is_reported_as_such_and_frees_what_it_made() -> None:
    """What a CUDA rank meets at too large a batch, raised here by the step itself: the kernel steps the
    batch down on TrialOutOfMemory, and the model that did not fit is not kept alive by a traceback."""

    def step(model: nn.Module, batch: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with pytest.raises(TrialOutOfMemory, match=r"^rank 0: OutOfMemoryError: CUDA out of memory") as caught:
        _measured(request(step="oom"), helper(), {"build": build, "oom": step})
    assert caught.value.__traceback__ is not None and caught.value.__cause__ is None
    del caught
    assert live_probes() == 0
