"""``fsdp`` on real 2-rank CPU/gloo pools: FSDP2 training matches one process, parameters and
optimizer state are really sharded, sharded checkpoints survive a restart and a save that dies,
the full model gathers on rank 0, and accumulation and clipping match the single-process maths."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard import DistributedError, Pool
from jupyter_shard.pool.checkpoint import load_full_state_dict
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.spec import LaunchSpec

pytestmark = pytest.mark.timeout(240)

# Every rank holds the same GLOBAL batch (X, Y) and trains on its half (xs, ys); `reference` trains
# a plain model on the whole batch in the same cell, so the two must agree step by step.
SETUP = """
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import FSDPModule

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

torch.manual_seed(1)
X, Y = torch.randn(16, 16), torch.randn(16, 1)
xs, ys = X.chunk(2)[shard.rank], Y.chunk(2)[shard.rank]

def global_loss(model):
    loss = nn.functional.mse_loss(model(xs).float(), ys).detach().clone()
    torch.distributed.all_reduce(loss)
    return loss.item() / shard.world_size

def reference(steps=5):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(X), Y)
        loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    return losses

def train(steps=5):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = shard.prepare(model, opt)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(xs).float(), ys)
        shard.backward(loss); shard.step()
        reduced = loss.detach().clone(); torch.distributed.all_reduce(reduced)
        losses.append(reduced.item() / shard.world_size)
    return model, opt, losses

def rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
"""


@pytest.fixture(scope="module")
def config(pool_and_config: tuple[Pool, Path]) -> Path:
    return pool_and_config[1]


def fsdp_pool(tmp_path_factory: pytest.TempPathFactory, name: str, setup: str) -> Iterator[tuple[Pool, Path]]:
    """A 2-rank fsdp pool on CPU that has run ``setup``, and the ``--config`` file its next
    ``shard.prepare`` reads (module fixtures of this file and ``test_zoo_fsdp.py``)."""
    config = tmp_path_factory.mktemp(name) / "fsdp.json"
    config.write_text("{}")
    spec = LaunchSpec.create(nproc=2, device="cpu", strategy="fsdp", config=config)
    sink = ConsoleSink(io.StringIO(), io.StringIO())
    with Pool(spec=spec, log_dir=tmp_path_factory.mktemp("logs"), sink=sink) as p:
        p.run(setup)
        yield p, config


@pytest.fixture(scope="module")
def pool_and_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, Path]]:
    yield from fsdp_pool(tmp_path_factory, "fsdp", SETUP)


@pytest.fixture(scope="module")
def pool(pool_and_config: tuple[Pool, Path]) -> Pool:
    return pool_and_config[0]


def use(pool: Pool, config: Path, precision: str = "32", **options: Any) -> None:
    """Strategy options for the next ``shard.prepare`` (the config file is read there)."""
    config.write_text(json.dumps(options))
    if pool.spec.precision.value != precision:
        restart(pool, pool.spec.with_changes(precision=type(pool.spec.precision)(precision)))


def restart(pool: Pool, spec: LaunchSpec | None = None) -> None:
    pool.restart(spec)
    pool.run(SETUP)


SHARDINGS: dict[str, dict[str, Any]] = {
    "full": {"sharding": "FULL_SHARD"},
    "full-wrap-ckpt": {
        "sharding": "FULL_SHARD",
        "auto_wrap": ["Linear"],
        "activation_checkpointing": ["Linear"],
    },
    "grad-op-min-params": {"sharding": "SHARD_GRAD_OP", "auto_wrap": {"min_params": 500}},
    "hybrid-1x2": {"sharding": "HYBRID_SHARD"},
    "hybrid-2x1": {"sharding": "HYBRID_SHARD", "shard_group_size": 1},
    "no-shard": {"sharding": "NO_SHARD"},
    "cpu-offload": {"sharding": "FULL_SHARD", "cpu_offload": True},
}
MESHES = {"hybrid-1x2": (1, 2), "hybrid-2x1": (2, 1), "no-shard": (2, 1)}


# Whether each option took effect, seen from the trained model: its FSDP units, checkpoint wrappers
# and the Linear forwards one step runs (a checkpointed layer runs again in backward), whether a
# forward leaves the parameters sharded (SHARD_GRAD_OP keeps them gathered until backward), and the
# offload policy its units hold.
EFFECTS = """
def effects(model):
    import torch.nn as nn
    units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n)
    units = [n.replace("._checkpoint_wrapped_module", "") for n in units]
    calls = []
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for m in linears:  # the forward itself: a checkpoint's recomputation runs no forward hooks
        m.forward = lambda *a, _f=m.forward: (calls.append(1), _f(*a))[1]
    loss = nn.functional.mse_loss(model(xs).float(), ys)
    resharded = all(isinstance(p, DTensor) for p in model.parameters())  # after the forward
    shard.backward(loss)
    for m in linears:
        del m.forward
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    policy = {type(g.offload_policy).__name__ for g in groups if g is not None}
    return dict(units=units, calls=len(calls), resharded=resharded, offload=policy,
                wrapped=any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules()))
"""
# What each case must show (fields of ``effects``); None where the case does not decide it.
EXPECTED: dict[str, dict[str, Any]] = {
    "full": {"wrapped": False, "calls": 3, "resharded": True, "offload": {"OffloadPolicy"}},
    "full-wrap-ckpt": {"wrapped": True, "calls": 6, "units": ["0", "2", "4"], "resharded": True},
    "grad-op-min-params": {"wrapped": False, "calls": 3, "units": ["0", "2"], "resharded": False},
    "hybrid-1x2": {"wrapped": False, "calls": 3},
    "hybrid-2x1": {"wrapped": False, "calls": 3},
    "no-shard": {"wrapped": False, "calls": 3},
    "cpu-offload": {"wrapped": False, "calls": 3, "resharded": True, "offload": {"CPUOffloadPolicy"}},
}


@pytest.mark.parametrize("case", list(SHARDINGS))
def test_training_matches_one_process(pool: Pool, config: Path, case: str) -> None:
    use(pool, config, **SHARDINGS[case])
    pool.run(
        EFFECTS + "model, opt, losses = train()\n"
        "names = [n for n, _ in model.named_parameters()]\n"
        "summary = dict(diff=rel(losses, reference()), kind=repr(shard.impl),"
        " mesh=tuple(shard.impl.mesh().shape), fsdp=isinstance(model, FSDPModule),"
        " dtensors=all(isinstance(p, DTensor) for p in model.parameters()),"
        " rebuilt=[type(opt).__name__, opt.defaults['lr']],"
        " same=all(p is q for p, q in zip(opt.param_groups[0]['params'], model.parameters())),"
        " clean=[n.replace('._checkpoint_wrapped_module', '') for n in names])\n"
        "summary['effects'] = effects(model)"
    )
    summary = pool.pull("summary")
    assert summary["diff"] <= 1e-5, summary
    assert summary["kind"].startswith("<fsdp: FSDP2 fully_shard")
    assert summary["mesh"] == MESHES.get(case, (2,))
    assert summary["fsdp"] and summary["dtensors"] and summary["same"]
    assert summary["rebuilt"] == ["AdamW", 0.01]
    assert summary["clean"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    effects = summary["effects"]
    for field, wanted in EXPECTED[case].items():
        assert effects[field] == wanted, (case, field, effects)


def test_parameters_and_optimizer_state_are_sharded(pool: Pool, config: Path) -> None:
    use(pool, config, sharding="FULL_SHARD")
    pool.run(
        "model, opt, _ = train(1)\n"
        "m = shard.memory()\n"
        "full = sum(p.numel() * 4 for p in model.parameters())\n"
        "local = sum(p.to_local().numel() * 4 for p in model.parameters())\n"
        "states = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]\n"
        "local_opt = sum(v.to_local().numel() * 4 for v in states)"
    )
    memory, full = pool.pull_all("m"), pool.pull("full")
    local, local_opt = pool.pull_all("local"), pool.pull_all("local_opt")
    assert full == (16 * 32 + 32 + 32 * 32 + 32 + 32 + 1) * 4
    for rank in (0, 1):
        assert memory[rank]["parameters"] == local[rank]
        assert memory[rank]["optimizer"] == local_opt[rank] == 2 * local[rank], "AdamW: exp_avg + exp_avg_sq"
        assert abs(local[rank] / full - 0.5) < 0.03, (local, full)
    assert local[0] + local[1] == full


def test_a_pulled_parameter_is_each_ranks_shard_as_a_plain_cpu_tensor(pool: Pool, config: Path) -> None:
    """A DTensor never reaches the kernel (it would need the ranks' device mesh and process group):
    a pull gives the rank's local shard, and the shards of ``pull_all`` make up the whole."""
    import torch
    from torch.distributed.tensor import DTensor

    use(pool, config, sharding="FULL_SHARD")
    pool.run(
        "model, opt, _ = train(1)\n"
        "weight, detached = model[2].weight, model[2].weight.detach()\n"
        "full = model[2].weight.full_tensor()\n"
        "moments = {k: v['exp_avg'] for k, v in opt.state_dict()['state'].items()}"
    )
    weights, detached, moments = pool.pull_all("weight"), pool.pull_all("detached"), pool.pull("moments")
    full = pool.pull("full")
    for rank, weight in weights.items():
        assert type(weight) is torch.nn.Parameter and weight.requires_grad, rank
        assert type(detached[rank]) is torch.Tensor and not detached[rank].requires_grad, rank
        assert weight.device.type == "cpu" and weight.shape == (16, 32), (rank, weight.shape)
        assert torch.equal(weight.detach(), detached[rank])
    assert type(full) is torch.Tensor and full.shape == (32, 32)
    assert torch.equal(torch.cat([weights[0].detach(), weights[1].detach()]), full)
    assert moments and not any(isinstance(v, DTensor) for v in moments.values())
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in moments.values())
    assert moments[2].shape == (16, 32), "optimizer state: rank 0's shard of model[2].weight's moment"


def test_full_model_is_a_plain_module_with_the_same_outputs(pool: Pool, config: Path) -> None:
    use(pool, config, sharding="FULL_SHARD", auto_wrap=["Linear"])
    pool.run(
        "model, opt, _ = train(2)\n"
        "out = model(xs).detach()\n"
        "full = shard.full_model()\n"
        "check = None if full is None else dict(type=type(full).__name__,"
        " plain=not isinstance(full, FSDPModule)"
        " and not any(isinstance(p, DTensor) for p in full.parameters()),"
        " diff=(full(xs) - out).abs().max().item())"
    )
    assert pool.pull_all("check") == {0: {"type": "Sequential", "plain": True, "diff": 0.0}, 1: None}
    gathered = pool.pull("model", gather=True)
    pool.run("full_state = full.state_dict()", ranks=[0])
    full_state = pool.pull("full_state")
    assert type(gathered).__name__ == "Sequential"
    assert all(v.equal(full_state[k]) for k, v in gathered.state_dict().items())


ACCUMULATE_AND_CLIP = """
def sgd_reference(clip=None):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.mse_loss(model(X), Y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf")).item()
    opt.step()
    return model.state_dict(), norm

def weight_diff(full, state):
    if full is None:
        return None
    return max((full.state_dict()[k] - v).abs().max().item() for k, v in state.items())

# accumulate=2: each rank's half batch in two micro-batches == one step on the whole batch
model = make_model()
model, opt = shard.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
for x, y in zip(xs.chunk(2), ys.chunk(2)):
    shard.backward(nn.functional.mse_loss(model(x), y)); shard.step()
ref_state, ref_norm = sgd_reference()
accumulated = weight_diff(shard.full_model(), ref_state)

# the global gradient norm over sharded gradients, then clipping to a small norm
model = make_model()
model, opt = shard.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm=0.05)
nn.functional.mse_loss(model(xs), ys).backward()
norm = shard.impl.clip_gradients(model, float("inf"))
norm_diff = abs(norm.item() - ref_norm) / ref_norm
shard.step()
clipped = weight_diff(shard.full_model(), sgd_reference(clip=0.05)[0])
"""


def test_accumulation_and_clipping_match_one_process(pool: Pool, config: Path) -> None:
    use(pool, config, sharding="FULL_SHARD", auto_wrap=["Linear"])
    pool.run(ACCUMULATE_AND_CLIP)
    assert pool.pull("accumulated") <= 1e-6
    assert pool.pull_all("norm_diff") == {0: pytest.approx(0, abs=1e-6), 1: pytest.approx(0, abs=1e-6)}
    assert pool.pull("clipped") <= 1e-6


def test_bad_options_give_one_clear_error(pool: Pool, config: Path) -> None:
    from jupyter_shard.strategies import create_strategy

    with pytest.raises(
        ValueError, match=r"unknown fsdp option\(s\) bogus; allowed: activation_checkpointing"
    ):
        create_strategy("fsdp", bogus=1)
    with pytest.raises(ValueError, match="fsdp sharding 'HALF' is not valid; choose one of: FULL_SHARD"):
        create_strategy("fsdp", sharding="half")
    use(pool, config, sharding="FULL_SHARD", reshard=True)
    with pytest.raises(DistributedError, match="unknown fsdp option"):
        pool.run("shard.prepare(make_model())")


def test_checkpoint_round_trip_and_a_save_that_dies(pool: Pool, config: Path, tmp_path: Path) -> None:
    use(pool, config, sharding="FULL_SHARD", auto_wrap=["Linear"])
    path = tmp_path / "ckpt"
    pool.run(
        f"model, opt, _ = train(3)\nshard.save({str(path)!r})\nsaved_step = shard.global_step\n"
        "saved = global_loss(model)\n"
        "shard.backward(nn.functional.mse_loss(model(xs), ys)); shard.step()\n"
        "after_step = global_loss(model)"
    )
    saved, after_step, saved_step = pool.pull("saved"), pool.pull("after_step"), pool.pull("saved_step")
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "no temporary directories left behind"
    merged = load_full_state_dict(path)  # in the kernel, no process group: DCP's own converter
    assert sorted(merged) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]

    load = (
        "model = make_model()\n"
        "model, opt = shard.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))\n"
        f"shard.load({str(path)!r})\nloaded = global_loss(model)\n"
    )
    restart(pool)
    pool.run(
        load + "step = shard.global_step\nshard.backward(nn.functional.mse_loss(model(xs), ys))\n"
        "shard.step()\nresumed = global_loss(model)"
    )
    assert pool.pull_all("loaded") == {0: saved, 1: saved}
    assert pool.pull("step") == saved_step
    assert pool.pull("resumed") == pytest.approx(after_step, rel=1e-6), "optimizer state restored"

    # the writer fails before the swap: the temporary directory is abandoned, the checkpoint stays
    pool.run(
        "import jupyter_shard.strategies.fsdp as F\n"
        "def boom(*a): raise OSError('disk full (simulated)')\n"
        "real_write, F.atomic_torch_save = F.atomic_torch_save, boom"
    )
    with pytest.raises(DistributedError, match="disk full"):
        pool.run(f"shard.save({str(path)!r})")
    pool.run("F.atomic_torch_save = real_write\n" + load)
    assert pool.pull_all("loaded") == {0: saved, 1: saved}

    # rank 0 is killed between moving the old checkpoint aside and moving the new one in
    pool.run(
        "import os\n"
        "def die(tmp, target):\n"
        "    os.replace(target, target.with_name('.' + target.name + '.prev')); os._exit(1)\n"
        "F._swap = die\nshard.backward(nn.functional.mse_loss(model(xs), ys)); shard.step()"
    )
    with pytest.raises(DistributedError):
        pool.run(f"shard.save({str(path)!r})", timeout=30)
    assert not path.exists()
    restart(pool)
    pool.run(load)
    assert pool.pull_all("loaded") == {0: saved, 1: saved}


def test_bf16_mixed_uses_the_fsdp_policy_without_autocast(pool: Pool, config: Path) -> None:
    use(pool, config, precision="bf16-mixed", sharding="FULL_SHARD", auto_wrap=["Linear"])
    pool.run(
        "model, opt, losses = train()\n"
        "diff = rel(losses, reference())\n"
        "seen = []\n"
        "model.register_forward_hook(lambda m, i, o: seen.append(torch.is_autocast_enabled('cpu')))\n"
        "out_dtype = str(model(xs).dtype)\n"
        "master = {str(p.dtype) for p in model.parameters()}"
    )
    assert pool.pull("diff") <= 2e-2
    assert pool.pull("out_dtype") == "torch.bfloat16", "MixedPrecisionPolicy computes in bf16"
    assert pool.pull("master") == {"torch.float32"}, "sharded master weights stay float32"
    assert pool.pull("seen") == [False], "no autocast on top of the policy"


def test_fp16_loss_scaling_skips_the_step_on_every_rank_when_one_shard_overflows(
    pool: Pool, config: Path
) -> None:
    """Each rank sees only its shard of the gradients: an inf on rank 1 alone must skip the step
    (and halve the scale) on rank 0 too, or the ranks' weights part ways."""
    use(pool, config, precision="16-mixed", sharding="FULL_SHARD")
    pool.run(
        "model, opt, losses = train(steps=3)\n"
        "before = [p.to_local().detach().clone() for p in model.parameters()]\n"
        "scale = shard.impl.scaler.get_scale()\n"
        "shard.backward(nn.functional.mse_loss(model(xs).float(), ys))\n"
        "held = [p.grad.to_local() for p in model.parameters() if p.grad.to_local().numel()]\n"
        "if shard.rank == 1:\n"
        "    held[0][0] = float('inf')\n"
        "shard.step()\n"
        "unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))\n"
        "backed_off = shard.impl.scaler.get_scale() == scale / 2\n"
        "finite = all(l == l for l in losses)"
    )
    assert pool.pull_all("unchanged") == {0: True, 1: True}
    assert pool.pull_all("backed_off") == {0: True, 1: True}
    assert pool.pull("finite")
