"""jupyter_shard.planner.isolation: a function run beside a real default process group sees none,
hands back its result or its one-line error, leaves the caller's group as it was, never forks the
caller (whose autograd threads would break a backward in the child) and sends tensors as shapes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from jupyter_shard.errors import SpecError
from jupyter_shard.planner.isolation import forked


@pytest.fixture
def real_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_child_sees_no_group_and_the_caller_keeps_its_own(real_group: None) -> None:
    world = dist.group.WORLD
    seen = forked(lambda: (dist.is_initialized(), os.getpid()))
    assert seen[0] is False and seen[1] != os.getpid()
    assert dist.group.WORLD is world and dist.get_world_size() == 1


def test_the_child_is_not_forked_from_the_caller() -> None:
    assert forked(os.getppid) != os.getpid()


def test_errors_come_back_as_one_line() -> None:
    def fails() -> None:
        raise SpecError("pass a model")

    with pytest.raises(SpecError, match=r"^pass a model$"):
        forked(fails)
    with pytest.raises(SpecError, match="failed in its child process: ZeroDivisionError"):
        forked(lambda: 1 / 0)


def test_a_child_that_dies_is_one_line() -> None:
    with pytest.raises(SpecError, match="child process died"):
        forked(lambda: os._exit(3))


def test_an_interrupted_call_does_not_wait_for_its_child() -> None:
    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    forked(os.getpid)  # the fork server is up: the interrupt comes while the child runs
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    started = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            forked(lambda: time.sleep(60))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 30


def test_what_cannot_be_sent_is_one_line_saying_what_to_pass() -> None:
    lock = threading.Lock()
    with pytest.raises(SpecError) as caught:
        forked(lambda: lock)
    message = str(caught.value)
    assert "cannot send it the model, batch or step (TypeError: cannot pickle" in message
    assert message.endswith("pass a function that builds the model instead") and "\n" not in message


def test_tensors_travel_as_their_shape_and_tied_parameters_stay_tied() -> None:
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    model.register_buffer("scale", torch.ones(3))
    batch = torch.randn(4, 8).t()  # strided, not contiguous

    def look() -> tuple[object, ...]:
        weight, scale = model[0].weight, model.get_buffer("scale")
        return (
            (weight.device.type, type(weight), weight.shape, weight.requires_grad),
            model[0].weight is model[1].weight,
            (scale.device.type, scale.shape),
            (batch.device.type, batch.shape, batch.stride(), batch.dtype),
        )

    assert forked(look) == (
        ("meta", nn.Parameter, (10, 4), True),
        True,
        ("cpu", (3,)),
        ("cpu", (8, 4), (1, 8), torch.float32),
    )


# A script of its own (a device guard, once registered, stays for the life of the process), planning
# at its top level with no `if __name__ == "__main__"` guard, as a script under torchrun may.
AFTER_AUTOGRAD_THREADS = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    from jupyter_shard.planner.dry_run import dry_run
    from jupyter_shard.planner.isolation import forked

    def backward():
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        return x.grad.tolist()

    # a device guard besides the CPU's, as a CUDA build of torch has (FakeTensorMode installs one for
    # CUDA there): the next backward starts autograd's device threads
    _setup_privateuseone_for_python_backend()
    backward()
    pid = os.fork()
    if pid == 0:
        try:
            backward()
        except RuntimeError as exc:
            os._exit(7 if "fork-based multiprocessing" in str(exc) else 1)
        os._exit(0)
    print("plain fork:", "breaks" if os.waitpid(pid, 0)[1] >> 8 == 7 else "works")
    store = dist.FileStore(os.path.join(sys.argv[1], "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    print("child:", forked(backward))
    plan = dry_run(lambda: nn.Linear(8, 1), "torch.randn(4, 8)", 2, "cpu", ["fsdp FULL_SHARD"])
    print("dry run:", plan["fsdp FULL_SHARD"].peak_bytes > 0, dist.get_backend())
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(240)
def test_a_backward_in_the_child_works_after_the_caller_started_autograds_device_threads(
    tmp_path: Path,
) -> None:
    from torch.utils import backend_registration

    if not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"):
        pytest.skip("this torch cannot register a device guard from Python, which the test needs")
    script = tmp_path / "plan.py"
    script.write_text(AFTER_AUTOGRAD_THREADS)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    if "plain fork: works" in lines:
        pytest.skip("this torch no longer breaks a backward in a child forked after autograd's threads")
    assert lines == ["plain fork: breaks", "child: [2.0, 2.0]", "dry run: True gloo"]
