"""jupyter_shard.planner.cell_model, and ``dry_run`` on a string of code: the model is the code's last
expression or else its ``model``; the code reads the caller's names and defines none there; a model
bigger than this machine plans from code without memory; bad code is one line saying what to pass."""

from __future__ import annotations

import resource
from typing import Any

import pytest
import torch
from torch import nn

from jupyter_shard.errors import SpecError
from jupyter_shard.planner.cell_model import model_builder
from jupyter_shard.planner.dry_run import dry_run, find_batch

LAST_EXPRESSION = """
layers = [m for _ in range(2) for m in (nn.Linear(width, width), nn.ReLU())]
nn.Sequential(*layers, nn.Linear(width, 1))
"""
NAMED = """
import torch.nn as tnn
model = tnn.Sequential(tnn.Linear(width, 1))
other = 3
"""


def mlp(width: int) -> nn.Module:
    layers = [m for _ in range(2) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def test_the_last_expression_is_the_model_and_the_callers_names_are_read_not_written() -> None:
    namespace: dict[str, Any] = {"width": 32}
    built = model_builder(LAST_EXPRESSION, namespace)()
    assert isinstance(built, nn.Sequential) and built[0].in_features == 32
    assert namespace == {"width": 32}, "the code defines nothing in the caller's namespace"


def test_without_a_last_expression_the_model_is_the_variable_model() -> None:
    namespace: dict[str, Any] = {"width": 8, "model": "the user's"}
    builder = model_builder(NAMED, namespace)
    first, second = builder(), builder()
    assert isinstance(first, nn.Sequential) and first[0].in_features == 8
    assert first is not second, "each call runs the code afresh"
    assert namespace == {"width": 8, "model": "the user's"}


def test_a_plan_from_code_is_the_plan_of_the_same_builder() -> None:
    from_code = dry_run(LAST_EXPRESSION, "torch.randn(4, 64)", 2, "cpu", ["ddp"], namespace={"width": 64})
    from_builder = dry_run(lambda: mlp(64), "torch.randn(4, 64)", 2, "cpu", ["ddp"])
    assert from_code["ddp"] == from_builder["ddp"]
    assert find_batch("nn.Linear(64, 1)", lambda n: f"torch.randn({n}, 64)", 2, 1 << 20, "ddp", device="cpu")


def test_a_model_bigger_than_this_machine_plans_from_code_without_allocating_it() -> None:
    """6.4 billion parameters (26 GB of float32, more than this machine's RAM), built by code."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    code = "blocks = [nn.Linear(40_000, 40_000) for _ in range(4)]\nmodel = nn.Sequential(*blocks)"
    plan = dry_run(code, "torch.randn(2, 40000)", 8, strategies=["fsdp FULL_SHARD"])["fsdp FULL_SHARD"]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert plan.parameters == pytest.approx(4 * 40_000 * 40_001 * 4 / 8, rel=0.01)
    assert grown < 500 * 2**20, f"the dry run grew the process by {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("nn.Linear(4,", "the model code has a syntax error (line 1)"),
        ("   \n", "the model code is empty"),
        ("raise ValueError('boom')", "the model code raised ValueError: boom"),
        ("missing_name(4)", "the model code raised NameError: name 'missing_name' is not defined"),
        ("x = nn.Linear(4, 4)", "the model code defines no model; end the code with the model"),
        ("model.eval()\nx = 1", "the model code defines no model"),  # the caller's model, untouched
        ("3 + 4", "the model code's last expression is a int, not an nn.Module"),
        ("model = 'text'", "the model code's `model` is a str, not an nn.Module"),
    ],
)
def test_bad_code_is_one_line_saying_what_to_pass(code: str, says: str) -> None:
    with pytest.raises(SpecError) as caught:
        dry_run(code, "torch.randn(4, 4)", 2, "cpu", ["ddp"], namespace={"model": nn.Linear(4, 4)})
    message = str(caught.value)
    assert says in message and "\n" not in message
    assert not torch.distributed.is_initialized(), "the fake process group is destroyed after a failure too"
