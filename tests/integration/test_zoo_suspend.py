"""The models users train, suspended and resumed under ``--strategy fsdp``: GPT-2 and Llama from
``transformers`` configs with tied input and output embeddings (``tests/zoo.py``). At the same world
size the steps after the resume equal an uninterrupted pool's, to the bit, and the tie holds (one
parameter under two names, not two copies that drift apart); at another world size the model, tie
kept, goes on training from where it was."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from jupyter_shard import Pool
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.pool.suspend import resume, suspend
from jupyter_shard.spec import LaunchSpec
from tests import zoo

pytestmark = pytest.mark.timeout(600)

TRAIN = """
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = shard.prepare(model, opt)
half = {k: v.chunk(shard.world_size)[shard.rank] for k, v in make_batch(12).items()}
losses = []
def train(steps):
    for _ in range(steps):
        loss = model(**half).loss
        shard.backward(loss)
        shard.step()
        losses.append(loss.detach().clone())
def tied():
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    return len(names) - len(list(model.parameters()))
"""


def _pool(nproc: int) -> Pool:
    spec = LaunchSpec.create(nproc=nproc, device="cpu", strategy="fsdp")
    return Pool(spec=spec, sink=ConsoleSink(io.StringIO(), io.StringIO()))


@pytest.mark.parametrize("name", ["gpt2 tied", "llama tied"])
def test_a_tied_transformers_model_resumes_exactly_and_at_another_world_size(
    name: str, tmp_path: Path
) -> None:
    with _pool(2) as reference:
        reference.run(zoo.code(name) + TRAIN + "\ntrain(4)")
        expected = [reference.pull("losses", r) for r in range(2)]
        weights = reference.pull("model", gather=True).state_dict()
    directory = tmp_path / "run"
    with _pool(2) as pool:
        pool.run(zoo.code(name) + TRAIN + "\ntrain(2)")
        assert _tied(pool) == 1
        suspend(pool, directory)
    resumed, report = resume(directory)
    with resumed:
        assert report.lost == {}, report.lost
        assert _tied(resumed) == 1, "the tied embedding came back as two parameters"
        resumed.run("train(2)")
        got = [resumed.pull("losses", r) for r in range(2)]
        after = resumed.pull("model", gather=True).state_dict()
    for rank in range(2):
        assert len(got[rank]) == 4
        for step, (a, b) in enumerate(zip(got[rank], expected[rank], strict=True)):
            assert a.equal(b), (rank, step, a, b)
    assert after.keys() == weights.keys()
    for key, value in weights.items():
        assert after[key].equal(value), key

    resumed, _ = resume(directory, {"nproc": 3})
    with resumed:
        assert _tied(resumed) == 1
        resumed.run("half = {k: v.chunk(shard.world_size)[shard.rank] for k, v in make_batch(12).items()}")
        resumed.run("train(2)")
        later = [float(x) for x in resumed.pull("losses", 2)[-2:]]
    assert all(math.isfinite(x) for x in later)
    assert later[1] < later[0], later  # it still learns on its own batch


def _tied(pool: Pool) -> int:
    """How many parameters rank 0's model holds under a second name."""
    pool.run("ties = tied()")
    return int(pool.pull("ties", 0))
