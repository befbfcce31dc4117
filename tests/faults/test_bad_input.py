"""F14 at 2, 3 and 4 ranks: bad magic options give one clear line and leave a running pool untouched,
the next cell working at once."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(120)
VISIBLE = torch.cuda.device_count()  # the kernel's ranks see the same devices (0 here, some on a GPU machine)
MORE = VISIBLE + 4

BAD = [
    ("--nproc 0", "--nproc 0 is not valid; a pool needs at least 1 rank"),
    ("--strategy bogus", "--strategy 'bogus' is not valid; choose one of: none, ddp, fsdp, deepspeed"),
    (
        f"--gpus {MORE}",
        f"--gpus {MORE} asked for, but {VISIBLE} CUDA device(s) are visible; "
        f"run `--nproc {MORE} --device cpu`",
    ),
    ("--device tpu", "--device 'tpu' is not valid; choose one of: auto, cpu, cuda"),
    ("--nproc two", "argument --nproc: invalid int value: 'two'"),
    ("--launcher k8s", "--launcher 'k8s' is not installed; available: local"),
    ("--launcher slurm", "SLURM may place the ranks on other machines, so they dial back to this kernel"),
]


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_bad_options_leave_the_running_pool_untouched(kernel: Any, nproc: int) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(f"%%distributed --nproc {nproc} --device cpu\nmarker = 'untouched'").ok
    pids_before = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    ranks = ("--ranks 7", f"rank 7 does not exist: the pool has {nproc} ranks (0-{nproc - 1})")
    for line, message in [*BAD, ranks]:
        run = kernel.execute(f"%%distributed {line}\nmarker = 'changed'")
        assert not run.ok, line
        err = run.stream("stderr").strip()
        assert message in err, (line, err)
        assert len(err.splitlines()) == 1, (line, err)
        failed_at = time.monotonic()
        run = kernel.execute("%%distributed\nmarker")
        back = time.monotonic() - failed_at
        assert run.data("execute_result") == [{"text/plain": "'untouched'"}]
        assert back < 5.0, f"back to a working cell {back:.1f} s after {line} failed"
    pids_after = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    assert [ln.split()[1] for ln in pids_before.splitlines()[2:]] == [
        ln.split()[1] for ln in pids_after.splitlines()[2:]
    ]
