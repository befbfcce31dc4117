"""The marks every GPU test shares: ``gpu``, a timeout, and a skip that names how many CUDA devices a
test needs and how many this machine shows, so a run on one GPU says which tests need more.

Devices are counted as the kernel counts them (:func:`jupyter_shard.spec.visible_gpus`: the
environment, ``/dev`` and ``nvidia-smi``), without importing torch or creating a CUDA context here.
"""

from __future__ import annotations

import pytest

from jupyter_shard.spec import visible_gpus

__all__ = ["gpu_module", "requires_gpus"]

_WHERE = "the GPU tests run on a GPU machine with `make gpu-check` (docs/development.md)"


def requires_gpus(count: int) -> pytest.MarkDecorator:
    """Skip unless at least ``count`` CUDA devices are visible."""
    seen = visible_gpus()
    devices = "CUDA device" if count == 1 else "CUDA devices"
    hint = f"; {_WHERE}" if seen == 0 else ""
    return pytest.mark.skipif(seen < count, reason=f"needs {count} {devices}, {seen} visible{hint}")


def gpu_module(timeout: int) -> list[pytest.MarkDecorator]:
    """A GPU test module's ``pytestmark``: the ``gpu`` marker, ``timeout`` seconds a test, one device."""
    return [pytest.mark.gpu, pytest.mark.timeout(timeout), requires_gpus(1)]
