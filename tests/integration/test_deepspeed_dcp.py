"""``--strategy deepspeed`` suspended with ``torch.distributed.checkpoint`` and resumed on CPU ranks.

A pool trains three steps, saves ``shard.impl.dcp_state`` with ``dcp.save``, then trains a fourth:
the uninterrupted reference. A new pool at the same world size builds the model from another seed,
loads the checkpoint through ``load_dcp_state`` and trains the same fourth step: its loss and weights
must equal the reference's to the bit. A pool at another world size must gather exactly the saved
weights and keep training, and what it saves after that step a 2-rank pool must gather exactly.
Layer sizes are odd so ZeRO-3's partitions carry padding, and at 3 ranks one partition is all padding.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from jupyter_shard import Pool
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.spec import LaunchSpec

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.timeout(300)

# A model and batches from `seed`; `mine` is this rank's rows of a global batch of 6 (1, 2 or 3 ranks);
# `train` runs one step and returns the mean loss over ranks; `weights` is the gathered fp32 model.
SETUP = """
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch import nn
torch.manual_seed({seed})
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 33), nn.ReLU(), nn.Linear(33, 4))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)) for _ in range(5)]
def mine(x):
    n = x.shape[0] // shard.world_size
    return x[shard.rank * n:(shard.rank + 1) * n]
def train(x, y):
    loss = nn.functional.mse_loss(model(mine(x)).float(), mine(y))
    shard.backward(loss); shard.step()
    mean = loss.detach().float().clone(); dist.all_reduce(mean)
    return mean / shard.world_size
def weights():
    full = shard.full_model()
    return None if full is None else {{k: v.detach().clone() for k, v in full.state_dict().items()}}
model, opt = shard.prepare(net, opt)
"""

SAVE = """
for x, y in batches[:3]:
    train(x, y)
state = shard.impl.dcp_state(model, opt)
dcp.save(state, checkpoint_id={ckpt!r})
saved = weights()
next_loss = train(*batches[3])
after = weights()
"""

RESUME = """
state = shard.impl.dcp_state(model, opt)
dcp.load(state, checkpoint_id={ckpt!r})
shard.impl.load_dcp_state(model, opt, state)
loaded = weights()
next_loss = train(*batches[3])
after = weights()
"""

SAVE_AFTER = """
dcp.save(shard.impl.dcp_state(model, opt), checkpoint_id={ckpt!r})
"""

#: ZeRO stage, precision and offload of a pool
Run = tuple[int, str, str]
_SAVED = ("saved", "next_loss", "after")
_LOADED = ("loaded", "next_loss", "after")


def _pool(tmp: Path, nproc: int, stage: int, precision: str, offload: str, **options: Any) -> Pool:
    spec = LaunchSpec.create(
        nproc=nproc,
        device="cpu",
        strategy="deepspeed",
        zero_stage=stage,
        precision=precision,
        offload=offload,
        **options,
    )
    return Pool(spec=spec, log_dir=tmp, sink=ConsoleSink(io.StringIO(), io.StringIO()))


def _run(
    tmp: Path, nproc: int, run: Run, code: str, names: tuple[str, ...], **options: Any
) -> dict[str, Any]:
    """Run ``code`` in a fresh pool with the options ``run``; pull ``names`` from rank 0."""
    with _pool(tmp, nproc, *run, **options) as pool:
        pool.run(code)
        return {name: pool.pull(name) for name in names}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or that one side lacks)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


RUNS: list[Run] = [
    *((stage, precision, "none") for stage in (3, 2, 1, 0) for precision in ("32", "bf16-mixed")),
    (3, "32", "cpu"),  # DeepSpeedCPUAdam over offloaded masters, parameters offloaded too
    (2, "32", "cpu"),
]


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: f"zero{r[0]}-{r[1]}-offload_{r[2]}")
def suspended(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Run, Path, dict[str, Any]]]:
    """A 2-rank pool per ZeRO stage and precision that saved after three steps and trained a fourth."""
    run: Run = request.param
    ckpt = tmp_path_factory.mktemp("dcp")
    ref = _run(
        tmp_path_factory.mktemp("logs"), 2, run, SETUP.format(seed=0) + SAVE.format(ckpt=str(ckpt)), _SAVED
    )
    yield run, ckpt, ref


def test_same_world_size_continues_bit_exactly(
    suspended: tuple[Run, Path, dict[str, Any]], tmp_path: Path
) -> None:
    run, ckpt, ref = suspended
    stage = run[0]
    out = _run(tmp_path, 2, run, SETUP.format(seed=7) + RESUME.format(ckpt=str(ckpt)), _LOADED)
    assert not _equal(out["loaded"], ref["saved"]), f"ZeRO-{stage}: loaded weights differ"
    assert torch.equal(out["next_loss"], ref["next_loss"]), (
        f"ZeRO-{stage}: {out['next_loss'].item()!r} != {ref['next_loss'].item()!r}"
    )
    assert not _equal(out["after"], ref["after"]), f"ZeRO-{stage}: weights after the step differ"


def test_another_world_size_gathers_the_saved_weights(
    suspended: tuple[Run, Path, dict[str, Any]], tmp_path: Path
) -> None:
    run, ckpt, ref = suspended
    stage = run[0]
    nproc = 3 if stage == 3 else 1
    options: dict[str, Any] = {}
    if stage == 3:  # every parameter partitioned, none kept whole on every rank
        config = tmp_path / "ds.json"
        config.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
        options["config"] = config
    again = tmp_path / "again"
    code = SETUP.format(seed=7) + RESUME.format(ckpt=str(ckpt)) + SAVE_AFTER.format(ckpt=str(again))
    out = _run(tmp_path, nproc, run, code, _LOADED, **options)
    assert not _equal(out["loaded"], ref["saved"]), f"ZeRO-{stage} at {nproc} ranks: loaded weights differ"
    assert torch.isfinite(out["next_loss"]) and out["next_loss"] < 10
    changed = _equal(out["after"], out["loaded"])
    assert changed == sorted(ref["saved"]), f"ZeRO-{stage} at {nproc} ranks: training left {changed}"
    # the optimizer state came too: the step is close to the uninterrupted one (a step from a fresh
    # Adam state moves weights by about the learning rate, 1e-2)
    atol = 1e-5 if run[1] == "32" else 1e-3
    for name, value in ref["after"].items():
        torch.testing.assert_close(out["after"][name], value, rtol=1e-4, atol=atol)
    # and back: what this pool saved after its step, a 2-rank pool gathers exactly
    back = _run(tmp_path / "back", 2, run, SETUP.format(seed=9) + RESUME.format(ckpt=str(again)), _LOADED)
    assert not _equal(back["loaded"], out["after"]), f"ZeRO-{stage} from {nproc} ranks to 2: weights differ"


FIRST_STEPS = """
losses = [train(*b) for b in batches[:2]]
after = weights()
"""


@pytest.mark.parametrize("run", [(3, "32", "none"), (2, "32", "cpu")], ids=["zero3", "zero2-cpu_adam"])
def test_a_suspend_before_the_first_step_takes_no_step(run: Run, tmp_path: Path) -> None:
    """Saved before any optimizer step, then trained: the saving pool and a pool resumed from it both
    train exactly as a pool that never saved (no step taken at learning rate 0, Adam's step count
    and bias correction untouched)."""
    ckpt = tmp_path / "ckpt"
    names = ("losses", "after")
    plain = _run(tmp_path / "a", 2, run, SETUP.format(seed=0) + FIRST_STEPS, names)
    save = f"dcp.save(shard.impl.dcp_state(model, opt), checkpoint_id={str(ckpt)!r})\n"
    saving = _run(tmp_path / "b", 2, run, SETUP.format(seed=0) + save + FIRST_STEPS, names)
    load = "state = shard.impl.dcp_state(model, opt)\n"
    load += f"dcp.load(state, checkpoint_id={str(ckpt)!r})\nshard.impl.load_dcp_state(model, opt, state)\n"
    resumed = _run(tmp_path / "c", 2, run, SETUP.format(seed=7) + load + FIRST_STEPS, names)
    for label, out in (("the saving pool", saving), ("the resumed pool", resumed)):
        assert [x.item() for x in out["losses"]] == [x.item() for x in plain["losses"]], label
        assert not _equal(out["after"], plain["after"]), f"{label}: weights differ after two steps"
