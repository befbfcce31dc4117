"""jupyter_shard.launchers.base: the launcher contract the pool relies on, answered by every launcher."""

from __future__ import annotations

import signal

import pytest

from jupyter_shard.errors import SpecError
from jupyter_shard.launchers.slurm import SlurmLauncher
from jupyter_shard.launchers.torchrun import TorchrunLauncher


def test_the_launcher_contract_answers_what_the_pool_asks_without_names() -> None:
    from jupyter_shard.launchers import get_launcher
    from jupyter_shard.launchers.local import LocalLauncher

    local, torchrun, slurm = LocalLauncher(), TorchrunLauncher(), SlurmLauncher()
    assert (local.meets_on_agent_store, torchrun.meets_on_agent_store, slurm.meets_on_agent_store) == (
        False,
        True,
        True,
    )
    assert local.restart_hint == torchrun.restart_hint == "on the same hosts"
    assert slurm.restart_hint == "in a new SLURM allocation"
    assert isinstance(get_launcher("slurm"), SlurmLauncher)
    sent: list[tuple[int, int]] = []
    for launcher in (local, torchrun, slurm):
        launcher.set_signal_sender(lambda rank, sig: sent.append((rank, sig)))
    torchrun.signal_rank(3, signal.SIGINT)
    slurm.signal_rank(4, signal.SIGTERM)
    assert sent == [(3, signal.SIGINT), (4, signal.SIGTERM)]


def test_an_unknown_launcher_is_one_spec_error_naming_the_installed_ones() -> None:
    from jupyter_shard.launchers import get_launcher
    from jupyter_shard.spec import LaunchSpec, launcher_names

    with pytest.raises(SpecError) as asked:
        get_launcher("k8s")
    assert str(asked.value) == f"--launcher 'k8s' is not installed; available: {', '.join(launcher_names())}"
    assert {"local", "torchrun", "slurm"} <= set(launcher_names())
    with pytest.raises(SpecError) as checked:
        LaunchSpec.create(launcher="k8s", gpu_count=0)
    assert str(checked.value) == str(asked.value)  # the spec and the registry say the same
