"""``--strategy deepspeed`` on 2 CPU ranks: ZeRO 0–3 train like one process, shard what they claim
to shard, checkpoint through DeepSpeed's own format, reject conflicting configs and offload to CPU."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from jupyter_shard import DistributedError, Pool
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.spec import LaunchSpec
from jupyter_shard.strategies.base import StrategyContext
from jupyter_shard.strategies.deepspeed_config import ConfigConflict, build_config
from tests.integration.training_cells import LOSS_PARITY, SETUP

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.timeout(300)

# 16·32+32 + 32·32+32 + 32·4+4 parameters, fp32
PSI = 16 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4
# After SETUP: trains a single-process reference on the full batches, then the prepared model on this
# rank's halves; `rel` compares the gathered full weights with the reference's on rank 0.
PARITY = """
ref = copy.deepcopy(net)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
for x, y in batches[:5]:
    nn.functional.mse_loss(ref(x), y).backward(); ref_opt.step(); ref_opt.zero_grad()
model, opt = shard.prepare(net, opt)
for x, y in batches[:5]:
    shard.backward(nn.functional.mse_loss(model(mine(x)), mine(y))); shard.step()
full = shard.full_model()
rel = None
if shard.rank == 0:
    diff = sum((a - b).double().pow(2).sum() for a, b in zip(full.parameters(), ref.parameters()))
    rel = float(diff.sqrt() / sum(b.double().pow(2).sum() for b in ref.parameters()).sqrt())
mem = shard.memory()
"""


def _pool(tmp: Path, **options: object) -> Pool:
    spec = LaunchSpec.create(nproc=2, device="cpu", strategy="deepspeed", **options)  # type: ignore[arg-type]
    return Pool(spec=spec, log_dir=tmp, sink=ConsoleSink(io.StringIO(), io.StringIO()))


@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=lambda s: f"zero{s}")
def trained(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Pool, int]]:
    """A pool per ZeRO stage (options are per pool) that ran the parity cell."""
    with _pool(tmp_path_factory.mktemp("logs"), zero_stage=request.param) as pool:
        pool.run(SETUP + PARITY)
        yield pool, request.param


def test_matches_a_single_process_reference(trained: tuple[Pool, int]) -> None:
    pool, stage = trained
    rel = pool.pull("rel")
    assert rel <= 1e-5, f"ZeRO-{stage}: relative weight difference {rel:.3g}"


def test_memory_is_sharded(trained: tuple[Pool, int]) -> None:
    pool, stage = trained
    mem = pool.pull_all("mem")
    full, half = 4 * PSI, 4 * PSI // 2
    for m in mem.values():
        # fp32 on CPU: ZeRO keeps an fp32 master partition beside the (fp32) model weights, so
        # "optimizer" is master + exp_avg + exp_avg_sq of this rank's partition: 12Ψ/N bytes
        if stage == 0:
            assert (m["parameters"], m["optimizer"]) == (full, 2 * full)
        else:
            assert m["optimizer"] == 3 * half
            assert m["parameters"] == (half if stage == 3 else full)


def test_checkpoint_round_trip_through_a_restart(trained: tuple[Pool, int], tmp_path: Path) -> None:
    pool, _ = trained
    ckpt = tmp_path / "ckpt"
    pool.run(
        f"shard.save({str(ckpt)!r}); before = fixed_loss()\n"
        "x, y = batches[5]; shard.backward(nn.functional.mse_loss(model(mine(x)), mine(y))); shard.step()\n"
        "after_step = fixed_loss()"
    )
    before, after_step = pool.pull("before"), pool.pull("after_step")
    assert (ckpt / "latest").read_text() == "step5"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")], "temporary tags are renamed"
    pool.restart()
    pool.run(
        SETUP + f"model, opt = shard.prepare(net, opt); shard.load({str(ckpt)!r}); loaded = fixed_loss()\n"
        "steps = shard.global_step\n"
        "x, y = batches[5]; shard.backward(nn.functional.mse_loss(model(mine(x)), mine(y))); shard.step()\n"
        "again = fixed_loss()"
    )
    assert pool.pull_all("loaded") == {0: before, 1: before}
    assert pool.pull("steps") == 5
    assert pool.pull("again") == after_step, "optimizer state came back too"


def test_gathered_model_and_consolidated_checkpoint_are_plain_and_equal(
    trained: tuple[Pool, int], tmp_path: Path
) -> None:
    import torch

    from jupyter_shard import consolidate

    pool, stage = trained
    ckpt = tmp_path / "ckpt"
    pool.run(f"shard.save({str(ckpt)!r})\nprobe = model(fixed_x).detach()")
    gathered = pool.pull("model", gather=True)
    assert type(gathered).__name__ == "Sequential"
    assert not any(hasattr(p, "ds_id") for p in gathered.parameters()), "plain parameters, not ZeRO ones"
    probe = pool.pull("probe")
    assert torch.allclose(gathered(torch.as_tensor(pool.pull("fixed_x"))), probe, rtol=1e-5, atol=1e-6)
    out = consolidate(ckpt, tmp_path / "full.pt")
    state = torch.load(out)
    assert set(state) == set(gathered.state_dict())
    for key, value in gathered.state_dict().items():
        assert torch.allclose(state[key], value, rtol=1e-6, atol=1e-7), (stage, key)


def test_a_config_that_disagrees_with_the_options_is_one_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    with _pool(tmp_path, zero_stage=3, config=config) as pool, pytest.raises(DistributedError) as caught:
        pool.run("import torch\nshard.prepare(torch.nn.Linear(2, 2))")
    assert f"--zero-stage 3 conflicts with --config {config}, which sets zero_optimization.stage = 1" in str(
        caught.value
    )


def _ctx(**kw: object) -> StrategyContext:
    return StrategyContext(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), **kw)  # type: ignore[arg-type]


def test_config_merges_the_json_under_the_options(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    user = {"zero_optimization": {"reduce_bucket_size": 1000}, "fp16": {"enabled": True}}
    path.write_text(json.dumps(user))
    config = build_config(_ctx(accumulate=4), zero_stage=2, offload="cpu", config_path=path, options={})
    zero = config["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"]) == (2, 1000)
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert config["fp16"]["enabled"] and "bf16" not in config
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (4, 8)
    assert config["gradient_clipping"] == 0.0, "DeepSpeed's default of 1.0 is not applied silently"
    bf16 = _ctx(precision="bf16-mixed")
    plain = build_config(bf16, zero_stage=None, offload="none", config_path=None, options={})
    assert plain["zero_optimization"]["stage"] == 0 and plain["bf16"] == {"enabled": True}
    with pytest.raises(
        ConfigConflict, match=r"--precision bf16-mixed conflicts with --config .*fp16.enabled"
    ):
        build_config(bf16, zero_stage=None, offload="none", config_path=path, options={})
    with pytest.raises(ValueError, match='--offload nvme needs a directory for the swap files: set "nvme_'):
        build_config(_ctx(), zero_stage=3, offload="nvme", config_path=None, options={})


@pytest.mark.timeout(900)  # the first run compiles DeepSpeed's CPU Adam (cached afterwards)
def test_cpu_offload_of_optimizer_and_parameters(tmp_path: Path) -> None:
    with _pool(tmp_path, zero_stage=3, offload="cpu") as pool:
        pool.run(SETUP + PARITY + "kind = type(opt.optimizer).__name__", timeout=840)
        assert pool.pull("kind") == "DeepSpeedCPUAdam"
        rel = pool.pull("rel")
        assert rel <= 1e-5, f"ZeRO-3 + CPU offload: relative weight difference {rel:.3g}"


@pytest.mark.late  # make test's background build compiles async_io last (tests/conftest.py: late_last)
@pytest.mark.timeout(900)  # the first run compiles DeepSpeed's async_io extension (cached afterwards)
def test_nvme_offload_swaps_to_the_given_directory(tmp_path: Path) -> None:
    """ZeRO-Infinity: parameters and optimizer state swapped to files (needs libaio; .ci/run installs it)."""
    import ctypes.util
    import json

    if ctypes.util.find_library("aio") is None:
        pytest.skip("libaio is not installed (Debian: apt-get install libaio-dev); .ci/run installs it")
    swap = tmp_path / "nvme"
    swap.mkdir()
    config = tmp_path / "ds.json"
    # max_in_cpu 0: swap every parameter partition rather than keep up to 1e9 elements in memory
    nvme = {
        "nvme_path": str(swap),
        "zero_optimization": {"offload_param": {"max_in_cpu": 0, "buffer_size": 2**21}},
    }
    config.write_text(json.dumps(nvme))
    with _pool(tmp_path, zero_stage=3, offload="nvme", config=config) as pool:
        pool.run(SETUP + PARITY, timeout=840)
        rel = pool.pull("rel")
        assert rel <= 1e-5, f"ZeRO-3 + NVMe offload: relative weight difference {rel:.3g}"
    # DeepSpeed swaps through files only for partitions above its I/O alignment: a 1M-parameter
    # layer shows the optimizer state (fp32 master, exp_avg, exp_avg_sq) on disk mid-training.
    # A fresh pool: one ZeRO-3 engine per process, as a notebook would have after %dist_restart.
    with _pool(tmp_path, zero_stage=3, offload="nvme", config=config) as pool:
        pool.run(
            "import os, torch\nfrom torch import nn\n"
            "big = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1))\n"
            "big_opt = torch.optim.Adam(big.parameters(), lr=1e-3)\n"
            "big, big_opt = shard.prepare(big, big_opt)\n"
            "shard.backward(big(torch.ones(4, 1024)).pow(2).mean()); shard.step()\n"
            f"swapped = {{f: os.path.getsize(os.path.join(d, f))\n"
            f"           for d, _, fs in os.walk({str(swap)!r}) for f in fs}}"
        )
        swapped = pool.pull("swapped", rank=1)
        names = " ".join(swapped)
        assert "exp_avg" in names and "exp_avg_sq" in names, swapped
        assert sum(swapped.values()) >= 3 * 4 * (1024 * 1024 + 1024 + 1025) // 2


def test_a_save_that_dies_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with _pool(tmp_path, zero_stage=2) as pool:
        pool.run(
            SETUP
            + "model, opt = shard.prepare(net, opt)\n"
            + f"shard.save({str(ckpt)!r}); before = fixed_loss()"
        )
        before = pool.pull("before")
        with pytest.raises(Exception, match="exited with code 9"):
            pool.run(
                "import os\nx, y = batches[0]\n"
                "shard.backward(nn.functional.mse_loss(model(mine(x)), mine(y)))\n"
                "shard.step()\n"
                "real_save = torch.save\n"
                "def dying_save(obj, f, *a, **k):\n    real_save(obj, f, *a, **k); os._exit(9)\n"
                "torch.save = dying_save\n"
                f"shard.save({str(ckpt)!r})"
            )
        pool.restart()
        pool.run(
            SETUP + f"model, opt = shard.prepare(net, opt); shard.load({str(ckpt)!r}); loaded = fixed_loss()"
        )
        assert pool.pull_all("loaded") == {0: before, 1: before}


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_losses_match_a_single_process_autocast_reference(tmp_path: Path, stage: int) -> None:
    with _pool(tmp_path, zero_stage=stage, precision="bf16-mixed") as pool:
        pool.run(SETUP + LOSS_PARITY)
        rel = pool.pull("rel")
        assert rel <= 2e-2, f"ZeRO-{stage} bf16: relative loss difference {rel:.3g}"


def test_activation_checkpointing_recomputes_and_keeps_parity(tmp_path: Path) -> None:
    import json

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"checkpoint_modules": ["Linear"]}))
    with _pool(tmp_path, zero_stage=2, config=config) as pool:
        pool.run(SETUP + PARITY + "wrapped = sorted({type(m).__name__ for m in model.module.modules()})")
        assert "CheckpointWrapper" in pool.pull("wrapped")
        rel = pool.pull("rel")
        assert rel <= 1e-5, f"ZeRO-2 + activation checkpointing: relative weight difference {rel:.3g}"
    config.write_text(json.dumps({"checkpoint_modules": ["Conv2d"]}))
    with (
        _pool(tmp_path, zero_stage=2, config=config) as pool,
        pytest.raises(Exception, match="no module of class Conv2d in the model"),
    ):
        pool.run(SETUP + PARITY)


# DeepSpeed asks `torch.is_autocast_enabled()` with no device type, which sees CUDA's autocast only,
# and turns a caller's autocast off inside the engine when it sees one. Answering that question for
# the rank's device makes a CPU rank do what a CUDA rank does: nothing may rely on autocast.
AS_ON_CUDA = """
import contextlib, torch
from torch import nn
_autocast_enabled = torch.is_autocast_enabled
def _as_on_cuda(*device_type):
    return _autocast_enabled(*device_type) if device_type else _autocast_enabled(shard.device.type)
torch.is_autocast_enabled = _as_on_cuda
"""

# A tagger fed token ids (int64) and fp32 features in a dict; `seen` records what its forward got.
MIXED = """
class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.out = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 2)
    def forward(self, ids, batch):
        seen.append((str(ids.dtype), str(batch["x"].dtype), torch.is_autocast_enabled("cpu")))
        return self.out(self.emb(ids) + self.lin(batch["x"]))
seen = []
torch.manual_seed(0)
with shard.init_module() if under_init else contextlib.nullcontext():
    net = Tagger()
model, opt = shard.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
params = list(model.module.parameters())
dtypes = sorted({str(p.dtype) for p in params} | {str(getattr(p, "ds_tensor", p).dtype) for p in params})
out = model(torch.randint(0, 10, (4,)), {"x": torch.randn(4, 8)})
shard.backward(out.float().pow(2).mean()); shard.step()
out_dtype = str(out.dtype)
"""


@pytest.mark.parametrize(
    ("stage", "under_init"),
    [(0, False), (2, False), (3, False), (3, True)],
    ids=["zero0", "zero2", "zero3", "zero3-init_module"],
)
def test_bf16_mixed_holds_bf16_parameters_and_casts_float_inputs_without_autocast(
    tmp_path: Path, stage: int, under_init: bool
) -> None:
    """Lightning's meaning on CPU and CUDA alike: parameters bf16 at every stage (ZeRO-3 included, built
    normally or under zero.Init), fp32 inputs cast to bf16, token ids left int64, no autocast."""
    with _pool(tmp_path, zero_stage=stage, precision="bf16-mixed") as pool:
        pool.run(AS_ON_CUDA + f"under_init = {under_init}\n" + MIXED)
        assert pool.pull_all("dtypes") == {0: ["torch.bfloat16"], 1: ["torch.bfloat16"]}
        assert pool.pull("seen") == [("torch.int64", "torch.bfloat16", False)]
        assert pool.pull("out_dtype") == "torch.bfloat16"


# After SETUP, at ZeRO-3 with no parameter kept whole between steps, trained with the first layer frozen
# (no fp32 master: its parameters are gathered from the partitions), or prepared with no optimizer
# (every parameter gathered); `at_once` is how many elements were gathered whenever GatheredParameters
# entered, `everything` the state gathered all at once.
GATHER = """
import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
if with_optimizer:
    net[0].requires_grad_(False)
    model, opt = shard.prepare(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad]))
    for x, y in batches[:2]:
        shard.backward(nn.functional.mse_loss(model(mine(x)), mine(y))); shard.step()
else:
    model = shard.prepare(net)
params = list(model.module.parameters())
at_once = []
Gathered = deepspeed.zero.GatheredParameters
class Counting(Gathered):
    def __enter__(self):
        super().__enter__()
        at_once.append(sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE))
deepspeed.zero.GatheredParameters = Counting
try:
    full = shard.full_model()
finally:
    deepspeed.zero.GatheredParameters = Gathered
with Gathered(params):
    everything = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
same = full is None or all(torch.equal(full.state_dict()[k], v) for k, v in everything.items())
"""


@pytest.mark.parametrize("with_optimizer", [True, False], ids=["frozen-layer", "no-optimizer"])
def test_zero3_full_state_gathers_one_parameter_at_a_time(tmp_path: Path, with_optimizer: bool) -> None:
    """`%dist_pull model --gather` and `shard.full_model()` never hold two whole parameters at once."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    with _pool(tmp_path, zero_stage=3, config=config) as pool:
        pool.run(SETUP + f"with_optimizer = {with_optimizer}\n" + GATHER)
        # trained: the frozen layer's weight (16x32) and bias (32), each alone; else every parameter
        gathered = {16 * 32, 32} if with_optimizer else {16 * 32, 32, 32 * 32, 32 * 4, 4}
        for rank, at_once in pool.pull_all("at_once").items():
            assert set(at_once) == gathered, (rank, at_once)
        assert pool.pull("same") is True
