"""Lightning's CUDA strategies on a pool of GPU ranks: DDP with sync_batchnorm, FSDP and its options,
DeepSpeed ZeRO 1–3 and the offload variants, as in the strategy guides users come from. Skipped where
no CUDA device is visible."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from jupyter_shard.spec import visible_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(visible_gpus() < 1, reason="no CUDA device visible"),
]

SETUP = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("gpu_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

g = torch.Generator().manual_seed(0)
xs = torch.randn(512, 64, generator=g)
data = TensorDataset(xs, xs.sum(1, keepdim=True))
"""

FIT = """
model = Net()
trainer = L.Trainer(accelerator="cuda", devices="auto", strategy={strategy}, precision="bf16-mixed",
                    max_epochs=2, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                    logger=False, enable_checkpointing=False{extra})
trainer.fit(model, DataLoader(data, batch_size=16))
losses = [float(v) for v in trainer.callback_metrics.values()]
peak = torch.cuda.max_memory_allocated()
report = (trainer.world_size, trainer.global_step, type(trainer.strategy).__name__, peak)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    pytest.importorskip("lightning")
    from jupyter_shard import LaunchSpec, Pool
    from jupyter_shard.kernel.output import ConsoleSink

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
        ('"deepspeed_stage_2_offload"', "", "DeepSpeedStrategy"),
        ('"deepspeed_stage_3"', "", "DeepSpeedStrategy"),
        ('"deepspeed_stage_3_offload"', "", "DeepSpeedStrategy"),
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
    assert losses and all(loss == loss for loss in losses)  # finite, not NaN


def test_history_has_the_gpu_runs(pool: object) -> None:
    import jupyter_shard

    records = [r for r in jupyter_shard.history() if "gpu_loss" in r]
    assert {r["rank"] for r in records} == set(range(visible_gpus()))
