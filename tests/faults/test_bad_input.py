"""F14: bad magic options give one clear line and leave a running pool untouched."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

BAD = [
    ("--nproc 0", "--nproc 0 is not valid; a pool needs at least 1 rank"),
    ("--strategy bogus", "--strategy 'bogus' is not valid; choose one of: none, ddp, fsdp, deepspeed"),
    ("--gpus 4", "--gpus 4 asked for, but 0 CUDA device(s) are visible; run `--nproc 4 --device cpu`"),
    ("--ranks 7", "rank 7 does not exist: the pool has 2 ranks (0-1)"),
    ("--device tpu", "--device 'tpu' is not valid; choose one of: auto, cpu, cuda"),
    ("--nproc two", "argument --nproc: invalid int value: 'two'"),
    ("--launcher k8s", "--launcher 'k8s' is not installed; available: local"),
]


def test_bad_options_leave_the_running_pool_untouched(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nmarker = 'untouched'").ok
    pids_before = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    for line, message in BAD:
        run = kernel.execute(f"%%distributed {line}\nmarker = 'changed'")
        assert not run.ok, line
        err = run.stream("stderr").strip()
        assert message in err, (line, err)
        assert len(err.splitlines()) == 1, (line, err)
    run = kernel.execute("%%distributed\nmarker")
    assert run.data("execute_result") == [{"text/plain": "'untouched'"}]
    pids_after = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    assert [ln.split()[1] for ln in pids_before.splitlines()[2:]] == [
        ln.split()[1] for ln in pids_after.splitlines()[2:]
    ]
