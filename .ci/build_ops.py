"""Builds DeepSpeed's CPU ops into the pools' build cache before the suites ask for them.

    python .ci/build_ops.py

A fresh clone's venv has a new path, so torch's extension builder sees new include paths and compiles
each op again (about 10 minutes of one core here: async_io alone 6). The suites would wait on that inside
a test. ``make test`` runs this at low priority while lint and the unit tests keep one core busy, and
waits for it before the suites start. Each op is loaded the way a CPU rank loads it
(``jupyter_shard.strategies.deepspeed.import_deepspeed``: the same accelerator, build cache and
guarded lock), so a rank finds it built. A cached op only loads, in a second or two.

Exits 0 when every op the machine can build was built (an op this machine lacks a library for, such as
libaio, is named and left to its test); 1 when a build failed.
"""

from __future__ import annotations

import sys
import time

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")


def main() -> int:
    try:
        import torch

        from jupyter_shard.strategies.deepspeed import import_deepspeed

        import_deepspeed(torch.device("cpu"))
        from deepspeed.accelerator import get_accelerator
    except ImportError as exc:
        print(f"build_ops: DeepSpeed is not importable ({exc}); nothing to build")
        return 0
    failed = []
    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"build_ops: {name} cannot be built on this machine; its test says why", flush=True)
            continue
        start = time.monotonic()
        try:
            builder.load(verbose=False)
        except Exception as exc:  # the test that needs it reports the failure with the compiler's output
            took = time.monotonic() - start
            print(f"build_ops: {builder.NAME} failed after {took:.0f} s: {exc}", flush=True)
            failed.append(builder.NAME)
            continue
        print(f"build_ops: {builder.NAME} ready in {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
