"""Lightning's CUDA strategies on a pool of GPU ranks: DDP with sync_batchnorm, FSDP and its options,
DeepSpeed ZeRO 1–3 and the offload variants, as in the strategy guides users come from. Skipped where
no CUDA device is visible."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator

import pytest

from jupyter_shard.spec import visible_gpus
from tests.gpu.marks import gpu_module

pytestmark = gpu_module(timeout=900)

SETUP = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1))
        self.step_losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch  # bf16 under DeepSpeed: its precision plugin casts the batch, the target included
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.log("gpu_loss", loss)
        self.step_losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

g = torch.Generator().manual_seed(0)
xs = torch.randn(512, 64, generator=g)
data = TensorDataset(xs, xs.sum(1, keepdim=True))

# Lightning's "deepspeed_stage_{2,3}_offload", with the optimizer made by DeepSpeed from its config:
# under ZeRO-Offload DeepSpeed refuses a torch optimizer from configure_optimizers. torch's AdamW
# ("torch_adam"), not DeepSpeedCPUAdam, which DeepSpeed compiles on first use (CUDA toolkit, compiler).
def zero_offload(stage):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    return L.pytorch.strategies.DeepSpeedStrategy(config={"zero_optimization": zero, "optimizer": optimizer})
"""

FIT = """
model = Net()
trainer = L.Trainer(accelerator="cuda", devices="auto", strategy={strategy}, precision="bf16-mixed",
                    max_epochs=2, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                    logger=False, enable_checkpointing=False{extra})
trainer.fit(model, DataLoader(data, batch_size=16))
losses = [float(v) for v in model.step_losses]
peak = torch.cuda.max_memory_allocated()
report = (trainer.world_size, trainer.global_step, type(trainer.strategy).__name__, peak)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    pytest.importorskip("lightning")
    from jupyter_shard import LaunchSpec, Pool
    from jupyter_shard.pool.output import ConsoleSink

    spec = LaunchSpec.create(nproc=visible_gpus(), device="cuda")
    log_dir = tmp_path_factory.mktemp("logs")
    with Pool(spec=spec, log_dir=log_dir, sink=ConsoleSink(io.StringIO(), io.StringIO())) as p:
        p.run(SETUP)
        yield p


@pytest.mark.parametrize(
    ("strategy", "extra", "kind"),
    [
        ('"ddp"', ", sync_batchnorm=True", "DDPStrategy"),
        ('"fsdp"', "", "FSDPStrategy"),
        (
            "L.pytorch.strategies.FSDPStrategy(sharding_strategy='SHARD_GRAD_OP', cpu_offload=True,"
            " activation_checkpointing_policy={torch.nn.Linear})",
            "",
            "FSDPStrategy",
        ),
        ('"deepspeed_stage_1"', "", "DeepSpeedStrategy"),
        ('"deepspeed_stage_2"', "", "DeepSpeedStrategy"),
        ("zero_offload(2)", "", "DeepSpeedStrategy"),
        ('"deepspeed_stage_3"', "", "DeepSpeedStrategy"),
        ("zero_offload(3)", "", "DeepSpeedStrategy"),
    ],
    ids=["ddp-syncbn", "fsdp", "fsdp-options", "zero1", "zero2", "zero2-offload", "zero3", "zero3-offload"],
)
def test_lightning_strategy_on_gpus(pool: object, strategy: str, extra: str, kind: str) -> None:
    if "deepspeed" in strategy:
        pytest.importorskip("deepspeed")
    pool.run(FIT.format(strategy=strategy, extra=extra))  # type: ignore[attr-defined]
    world, steps, name, peak = pool.pull("report")  # type: ignore[attr-defined]
    n = visible_gpus()
    assert (world, name) == (n, kind)
    assert steps == 2 * -(-512 // (16 * n))  # two epochs of the rank's share of the batches
    assert peak > 0
    losses = pool.pull("losses")  # type: ignore[attr-defined]
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses)
    # The second epoch runs the first one's batches again, in the same order. Its mean loss is 25 %
    # (one GPU) to 6 % (8 GPUs: 4 steps an epoch) below the first's in float32; bf16 moves both
    # means by under 0.1 %, so a 3 % margin is one bf16 cannot eat into.
    first, second = losses[: steps // 2], losses[steps // 2 :]
    assert sum(second) / len(second) < 0.97 * sum(first) / len(first)


def test_history_has_the_gpu_runs(pool: object) -> None:
    import jupyter_shard

    n = visible_gpus()
    history = jupyter_shard.history()  # the most recently started pool's: this module's
    before = {rank: history.count(rank, "gpu_loss") for rank in history.ranks}
    pool.run(FIT.format(strategy='"ddp"', extra=""))  # type: ignore[attr-defined]
    pool.run("shard.barrier()")  # type: ignore[attr-defined]  # the I/O thread has sent the fit's records
    steps = 2 * -(-512 // (16 * n))
    logged = {rank: history.count(rank, "gpu_loss") - before.get(rank, 0) for rank in history.ranks}
    assert logged == dict.fromkeys(range(n), steps)  # self.log at every step reached it, from every rank
