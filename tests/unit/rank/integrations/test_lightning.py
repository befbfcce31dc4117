"""jupyter_shard.rank.integrations.lightning: what a rank changes in Lightning, on the real classes."""

from __future__ import annotations

import importlib

import pytest

from jupyter_shard.rank.integrations import lightning as integration


def test_devices_auto_is_the_pools_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = importlib.import_module("lightning.fabric.accelerators.cpu")
    trainer_cpu = importlib.import_module("lightning.pytorch.accelerators.cpu")
    for module in (cpu, trainer_cpu):
        monkeypatch.setattr(
            module.CPUAccelerator, "auto_device_count", module.CPUAccelerator.auto_device_count
        )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    adjust = integration.adjustments("cpu")
    adjust["lightning.fabric.accelerators.cpu"](cpu)
    adjust["lightning.pytorch.accelerators.cpu"](trainer_cpu)
    assert cpu.CPUAccelerator.auto_device_count() == 3 == trainer_cpu.CPUAccelerator.auto_device_count()


def test_a_cuda_pool_leaves_the_cpu_count_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = importlib.import_module("lightning.fabric.accelerators.cpu")
    monkeypatch.setattr(cpu.CPUAccelerator, "auto_device_count", cpu.CPUAccelerator.auto_device_count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    integration.adjustments("cuda")["lightning.fabric.accelerators.cpu"](cpu)
    assert cpu.CPUAccelerator.auto_device_count() == 1


def test_asking_for_another_world_size_is_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("lightning.fabric.plugins.environments.torchelastic")
    cls = module.TorchElasticEnvironment
    monkeypatch.setattr(cls, "set_world_size", cls.set_world_size)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    integration.adjustments("cpu")["lightning.fabric.plugins.environments.torchelastic"](module)
    environment = cls()
    environment.set_world_size(8)  # devices=4, num_nodes=2: the pool's
    with pytest.raises(ValueError) as caught:
        environment.set_world_size(4)
    assert str(caught.value) == (
        "Lightning was asked for 4 processes (devices × num_nodes), but this pool has 8 ranks (4 on each of "
        '2 nodes): pass devices=4, num_nodes=2 or devices="auto", or start a pool of 4 ranks with '
        "%%distributed --nproc 4"
    )


def test_slurm_is_not_detected_in_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("lightning.fabric.plugins.environments.slurm")
    monkeypatch.setattr(module.SLURMEnvironment, "detect", module.SLURMEnvironment.detect)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "job")
    integration.adjustments("cpu")["lightning.fabric.plugins.environments.slurm"](module)
    assert module.SLURMEnvironment.detect() is False


def test_outside_a_rank_the_entry_point_adds_no_callback() -> None:
    assert integration.callbacks() == []


def test_the_dashboard_logger_keeps_lightnings_paths() -> None:
    _, logger_class = integration.dashboard_classes("lightning.pytorch")
    logger = logger_class("/runs/here")
    assert (logger.name, logger.version, logger.save_dir) == ("", "", "/runs/here")
    logger.log_metrics({"loss": 1.0}, step=3)  # outside a rank: nothing to send, no error


def test_lightning_does_not_announce_this_callback(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    module = importlib.import_module("lightning.fabric.utilities.registry")
    logger = logging.getLogger(module.__name__)
    filters = list(logger.filters)
    integration.adjustments("cpu")["lightning.fabric.utilities.registry"](module)
    try:
        with caplog.at_level(logging.INFO, logger=module.__name__):
            logger.info("Adding 1 callbacks from entry point 'jupyter_shard': DashboardCallback")
            logger.info("Adding 1 callbacks from entry point 'theirs': TheirCallback")
        assert [r.getMessage() for r in caplog.records] == [
            "Adding 1 callbacks from entry point 'theirs': TheirCallback"
        ]
    finally:
        logger.filters[:] = filters
