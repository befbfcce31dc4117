"""A real kernel for the benchmarks of the notebook path, started as Jupyter starts one: a subprocess
of this interpreter, with a blocking client whose channels are up and which has seen it ready."""

from __future__ import annotations

import os
import sys

from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager


def start_kernel(env: dict[str, str]) -> tuple[KernelManager, BlockingKernelClient]:
    """The kernel, with ``env`` added to this process's environment, and its client."""
    km = KernelManager(kernel_name="python3")
    km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]  # type: ignore[attr-defined]
    km.start_kernel(env={**os.environ, **env})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc
