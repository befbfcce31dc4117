"""Builds DeepSpeed's CPU ops into the pools' build cache before the suites ask for them.

    .venv/bin/python .ci/build_ops.py

A fresh clone's venv has a new path, so torch's extension builder writes new include paths into each
op's build.ninja and compiles it again: 10 min 51 s of wall time on this project's 2-core machine, with
ninja running 2 to 3 compilers at once (deepspeed_shm_comm about 1 min, cpu_adam 103 s, pin_memory 47 s,
async_io 430 s). The suites would wait on that inside a test's time limit. ``make test`` runs this at
nice 19 from its start, in the CPU time the tests leave; the test that needs async_io runs last.
Each op is loaded the way a CPU rank loads it (``jupyter_shard.strategies.deepspeed.import_deepspeed``:
the same accelerator, build cache and guarded lock), so a rank finds it built. An op whose build.ninja
is unchanged only loads. The cache is shared by every checkout on the machine (one directory per op),
so two checkouts taking turns rebuild each time.

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
    except ImportError as exc:  # torch, this package or DeepSpeed
        print(f"build_ops: nothing to build: {exc}")
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
            outcome = "ready in"
        except Exception as exc:  # the test that needs it reports the failure with the compiler's output
            outcome = f"failed ({exc}) after"
            failed.append(builder.NAME)
        print(f"build_ops: {builder.NAME} {outcome} {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
