"""A model of 1.5 GB (fp32) on 2 CPU ranks under ``fsdp`` and ZeRO-3: built under
``shard.init_module()`` no rank ever holds the whole model, a model built normally is given up as it
is sharded, a training step holds this rank's shards plus a few layers, and both ways of building
give the same values, hence the same loss.

Peaks are this rank's resident memory above the cell's start (Linux's ``VmHWM``, reset at the
start), as fractions of the whole model's bytes ``M``; ``N`` is the number of ranks and ``L`` the
largest layer's bytes. The bounds are the strategy's formula plus a margin; before sharded
initialisation and per-block units, ``fsdp`` peaked at 2.1 M in ``prepare`` and 3.1 M in the step,
and ZeRO-3 at 4.6 M in the step.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard import Pool
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.spec import LaunchSpec
from tests.integration.training_cells import BIG_MODEL

pytestmark = pytest.mark.timeout(600)

N = 2
WIDTH, DEPTH = 4096, 22  # 22 blocks of a 4096 x 4096 Linear and a LayerNorm: 1.48 GB in fp32
LAYER = 4 * WIDTH * WIDTH
# FSDP and DeepSpeed allocate their lazily built state (DTensor dispatch, engine buffers) once per
# process: a small model prepared and stepped first keeps that out of the measured cell.
WARM_UP = """
_small = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
_m, _o = shard.prepare(_small, torch.optim.SGD(_small.parameters(), lr=0.1))
shard.backward(_m(torch.ones(2, 64)).sum()); shard.step()
del _small, _m, _o
"""


def _runs(tmp: Path, strategy: str, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``train_big`` built under ``shard.init_module()``, then built normally, in one pool."""
    spec = LaunchSpec.create(nproc=N, device="cpu", strategy=strategy, **options)
    with Pool(spec=spec, log_dir=tmp, sink=ConsoleSink(io.StringIO(), io.StringIO())) as pool:
        pool.run(BIG_MODEL + WARM_UP, timeout=300)
        pool.run(f"big = train_big({WIDTH}, {DEPTH}, sharded=True)", timeout=300)
        sharded = pool.pull("big")
        pool.run(f"big = train_big({WIDTH}, {DEPTH}, sharded=False)", timeout=300)
        plain = pool.pull("big")
    return sharded, plain


def _fractions(run: dict[str, Any]) -> dict[str, float]:
    return {phase: peak / run["model_bytes"] for phase, peak in run["peaks"].items()}


def test_fsdp_never_holds_the_whole_model(tmp_path: Path) -> None:
    sharded, plain = _runs(tmp_path, "fsdp")
    m = sharded["model_bytes"]
    assert m > 1.4e9
    assert sharded["held"]["parameters"] == pytest.approx(m / N, rel=0.01)  # this rank's shard only
    built = _fractions(sharded)
    assert built["build"] < 0.05, built  # the meta device: nothing allocated
    assert built["prepare"] <= 0.6, built  # the shard and one layer at a time
    step_bound = 2 / N + (4 * LAYER) / m + 0.05  # shards of parameters and gradients, a few layers
    assert built["step"] <= step_bound, built
    normal = _fractions(plain)
    assert normal["build"] >= 0.95, normal  # the whole model, as any plain build
    assert normal["prepare"] <= 1.15, normal  # given up unit by unit as it is sharded
    assert normal["step"] <= step_bound, normal
    # the same parameters either way (each module's reset_parameters from the same seed)
    assert sharded["loss"] == plain["loss"]


def test_zero3_partitions_while_building(tmp_path: Path) -> None:
    sharded, plain = _runs(tmp_path, "deepspeed", zero_stage=3)
    m = sharded["model_bytes"]
    held = sharded["held"]
    assert held["parameters"] == pytest.approx(m / N, rel=0.01)
    built = _fractions(sharded)
    assert built["build"] <= 1 / N + (2 * LAYER) / m, built  # each layer partitioned as it is built
    # ZeRO-3 in fp32 keeps three partitions: parameters, gradients and the optimizer's fp32 master
    assert held["gradients"] == pytest.approx(m / N, rel=0.01)
    assert held["optimizer"] == pytest.approx(m / N, rel=0.01)
    assert built["prepare"] <= 3 / N + 0.25, built
    assert built["step"] <= 2.4, built  # buffers sized by the largest layer (DeepSpeed's own: 4.6 M)
    normal = _fractions(plain)
    assert normal["build"] >= 0.95, normal
    assert normal["prepare"] <= 3 / N + 0.25, normal
    assert sharded["loss"] == plain["loss"]
