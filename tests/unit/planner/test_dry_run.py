"""jupyter_shard.planner.dry_run: plans add up, sharding divides what a rank holds, a model too big for
this machine plans without memory, bad input is one line, the batch finder finds the largest fit, and
a real default process group is left alone."""

from __future__ import annotations

import resource
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import jupyter_shard.planner
from jupyter_shard.errors import SpecError
from jupyter_shard.planner.dry_run import STRATEGIES, Plan, dry_run, find_batch

PARTS = ("parameters", "gradients", "optimizer", "activations", "transient")


def mlp(width: int = 256, depth: int = 4) -> nn.Module:
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, 1))


class Locked(nn.Linear):
    """A module holding something that cannot be copied (a lock)."""

    def __init__(self) -> None:
        super().__init__(16, 1)
        self.lock = threading.Lock()


def plans(world_size: int = 4, **kwargs: object) -> dict[str, Plan]:
    return dry_run(lambda: mlp(1024, 2), "torch.randn(8, 1024)", world_size, device="cpu", **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def four() -> dict[str, Plan]:
    return plans(4)


def test_every_strategy_is_planned_and_its_parts_add_up_to_the_peak(four: dict[str, Plan]) -> None:
    assert list(four) == list(STRATEGIES)
    for name, plan in four.items():
        assert plan.strategy == name and plan.world_size == 4 and plan.options == dict(STRATEGIES[name])
        assert sum(getattr(plan, part) for part in PARTS) == plan.peak_bytes > 0
        assert all(getattr(plan, part) >= 0 for part in PARTS)
        assert set(PARTS) | {"peak_bytes", "host_bytes"} <= set(plan.source)
        assert (plan.host_bytes > 0) == name.endswith("+ offload")


def test_offload_keeps_the_sharded_state_on_the_host_and_the_rest_on_the_device(
    four: dict[str, Plan],
) -> None:
    """The same trace, split by role: sharded parameters, their gradients and the optimizer state are
    host bytes; what the device peak loses is what the host gains."""
    for name in ("fsdp FULL_SHARD", "deepspeed ZeRO-3"):
        plan, offloaded = four[name], four[f"{name} + offload"]
        assert offloaded.parameters == offloaded.optimizer == 0  # the MLP has no buffers
        assert offloaded.activations == plan.activations and offloaded.transient == plan.transient
        # the host's own peak: the shards, the optimizer state and the whole gradient shard (float32,
        # a shard's size), which lives there from the reduce-scatter to the step
        shard = plan.parameters  # this MLP's parameter shard, float32 like its gradient shard
        assert offloaded.host_bytes >= 2 * shard + plan.optimizer
        assert offloaded.peak_bytes + offloaded.host_bytes >= plan.peak_bytes * 0.99
        assert offloaded.peak_bytes < plan.peak_bytes - plan.parameters
        assert "host" in offloaded.source["host_bytes"] and offloaded.options["offload"] == "cpu"
    assert "modelled" in four["deepspeed ZeRO-3 + offload"].source["peak_bytes"]


def test_full_sharding_holds_a_quarter_of_the_parameters_at_world_size_4(four: dict[str, Plan]) -> None:
    ddp, full = four["ddp"], four["fsdp FULL_SHARD"]
    whole = sum(p.numel() * 4 for p in mlp(1024, 2).parameters())
    assert ddp.parameters == whole
    assert full.parameters == pytest.approx(whole / 4, rel=0.01)
    assert full.peak_bytes < ddp.peak_bytes / 2
    # SHARD_GRAD_OP keeps gathered parameters from forward to backward: more than FULL_SHARD
    assert four["fsdp SHARD_GRAD_OP"].peak_bytes > full.peak_bytes


def test_what_is_not_traced_says_so(four: dict[str, Plan]) -> None:
    assert "formula" in four["deepspeed ZeRO-3"].source["peak_bytes"]
    assert "DDP's gradient buckets" in four["ddp"].source["transient"]
    assert four["fsdp FULL_SHARD"].source["peak_bytes"].startswith("traced")
    assert four["ddp"].largest_unit is None
    # over 2**20 parameters: one FSDP unit per Linear, as the fsdp strategy wraps it
    name, size = four["fsdp FULL_SHARD"].largest_unit or ("", 0)
    assert name in ("0", "2") and size == 1024 * 1025 * 4
    small = dry_run(lambda: mlp(64, 1), "torch.randn(2, 64)", 2, strategies=["fsdp FULL_SHARD"])
    assert small["fsdp FULL_SHARD"].largest_unit == ("<root>", (64 * 65 + 65) * 4)


def test_zero3_holds_deepspeeds_flat_float32_partition_besides_full_sharding(four: dict[str, Plan]) -> None:
    full, zero3 = four["fsdp FULL_SHARD"], four["deepspeed ZeRO-3"]
    partition = sum(p.numel() * 4 for p in mlp(1024, 2).parameters()) / 4
    assert zero3.parameters == full.parameters
    # Adam's two moments and the flat float32 copy, with partition-sized temporaries at the step
    assert zero3.optimizer >= 3 * partition > full.optimizer
    assert zero3.peak_bytes > full.peak_bytes + partition


def test_bf16_mixed_halves_the_saved_activations_as_each_strategy_applies_it() -> None:
    """Each strategy's bf16-mixed: autocast over float32 weights (ddp), bfloat16 gathered units over
    float32 shards (fsdp), bfloat16 parameters with float32 masters (ZeRO-3). The batch stays float32
    and one bfloat16 copy of it feeds the first layer; every activation saved after that is bfloat16."""
    names = ["ddp", "fsdp FULL_SHARD", "deepspeed ZeRO-3"]
    batch, size = "torch.randn(8192, 256)", 8192 * 256 * 4  # activations dominate the 0.3M parameters

    def run(precision: str) -> dict[str, Plan]:
        return dry_run(lambda: mlp(256, 4), batch, 2, device="cpu", strategies=names, precision=precision)

    full, mixed = run("32"), run("bf16-mixed")
    for name in names:
        saved_full = full[name].activations - size
        saved_mixed = mixed[name].activations - size - size // 2
        assert saved_mixed == pytest.approx(saved_full / 2, rel=0.05), name
        assert mixed[name].peak_bytes < full[name].peak_bytes
        assert (
            mixed[name].precision == "bf16-mixed" and "bf16-mixed as the" in mixed[name].source["precision"]
        )
        assert full[name].precision == "32" and "precision" not in full[name].source
    # float32 weights and shards where the strategy keeps them; ZeRO-3 holds bfloat16 partitions and its
    # float32 masters in the optimizer
    for name in ("ddp", "fsdp FULL_SHARD"):
        assert mixed[name].parameters == full[name].parameters
    zero3 = "deepspeed ZeRO-3"
    assert mixed[zero3].parameters == full[zero3].parameters // 2
    assert mixed[zero3].optimizer == full[zero3].optimizer
    with pytest.raises(SpecError, match="precision '16-mixed' cannot be planned; choose one of: 32, bf16"):
        run("16-mixed")


def test_a_cpu_plan_holds_gloos_reduce_scatter_copy_of_the_largest_gradient() -> None:
    """gloo reduce-scatters through a copy of its input; NCCL does not: the embedding's gradient
    (51.2 MB) is reduce-scattered at the peak."""

    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(100_000, 128), nn.Flatten(), nn.Linear(128 * 4, 8))

    args = (build, "torch.randint(0, 100_000, (16, 4))", 2)
    cpu = dry_run(*args, device="cpu", strategies=["fsdp FULL_SHARD"])["fsdp FULL_SHARD"]  # type: ignore[arg-type]
    cuda = dry_run(*args, device="cuda", strategies=["fsdp FULL_SHARD"])["fsdp FULL_SHARD"]  # type: ignore[arg-type]
    assert cpu.peak_bytes - cuda.peak_bytes == pytest.approx(100_000 * 128 * 4, rel=0.02)


def test_a_larger_batch_needs_more_activations() -> None:
    """Activations saved for backward grow with the batch and, for a large one, set the peak."""
    small = dry_run(lambda: mlp(256, 4), "torch.randn(8, 256)", 2, strategies=["ddp"])["ddp"]
    large = dry_run(lambda: mlp(256, 4), "torch.randn(4096, 256)", 2, strategies=["ddp"])["ddp"]
    batch = 4096 * 256 * 4  # the larger batch itself, counted with the activations
    assert large.activations > 4 * batch > small.activations
    assert large.peak_bytes - small.peak_bytes > 3 * batch


def test_a_model_bigger_than_this_machine_plans_without_allocating_it() -> None:
    """6.4 billion parameters (26 GB of float32, more than this machine's RAM)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def build() -> nn.Module:
        return nn.Sequential(*(nn.Linear(40_000, 40_000) for _ in range(4)))

    plan = dry_run(build, "torch.randn(2, 40000)", 8, strategies=["fsdp FULL_SHARD"])["fsdp FULL_SHARD"]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert plan.parameters == pytest.approx(4 * 40_000 * 40_001 * 4 / 8, rel=0.01)
    assert grown < 500 * 2**20, f"the dry run grew the process by {grown / 2**20:.0f} MiB"


def test_a_module_is_copied_and_never_touched() -> None:
    torch.manual_seed(0)
    model = mlp(64, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    plan = dry_run(model, torch.randn(4, 64), 2, strategies=["ddp", "fsdp"])
    assert set(plan) == {"ddp", "fsdp FULL_SHARD", "fsdp SHARD_GRAD_OP", "fsdp FULL_SHARD + offload"}
    for name, param in model.named_parameters():
        assert param.data_ptr() == pointers[name] and param.grad is None
        assert torch.equal(param, before[name])
    assert not isinstance(model[0].weight, torch.distributed.tensor.DTensor)


def test_tied_parameters_are_counted_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 64)
            self.head = nn.Linear(64, 1000, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(idx))

    plan = dry_run(Tied, "torch.randint(0, 1000, (2, 8))", 2, strategies=["ddp"])["ddp"]
    assert plan.parameters == 1000 * 64 * 4


def test_a_step_function_is_run_instead_of_the_default() -> None:
    calls: list[int] = []

    def step(model: nn.Module, batch: object) -> None:
        calls.append(1)
        model(batch).sum().backward()  # type: ignore[operator]

    plan = dry_run(lambda: mlp(64, 1), "torch.randn(4, 64)", 2, strategies=["ddp"], step=step)["ddp"]
    assert len(calls) == 2 and plan.source["step"] == "the step function passed"
    assert plan.optimizer == 0  # no optimizer in that step


def test_the_package_exports_the_dry_run_callable() -> None:
    result = jupyter_shard.planner.dry_run(nn.Linear(4, 4), torch.randn(2, 4), 2, strategies="ddp")
    assert isinstance(result["ddp"], jupyter_shard.planner.DryRunPlan)
    assert jupyter_shard.planner.find_batch is find_batch


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"model_or_builder": lambda: 1 / 0}, "the model builder raised ZeroDivisionError"),
        ({"model_or_builder": lambda: "not a model"}, "returned str, not an nn.Module"),
        ({"model_or_builder": 42}, "pass an nn.Module or a function"),
        ({"model_or_builder": Locked()}, "cannot be copied to plan it"),
        ({"batch": "torch.randn(8, 3)"}, "pass a batch the model's forward takes"),
        ({"batch": "torch.randn(8,"}, "the batch expression"),
        ({"batch": object()}, "pass a tensor, a tuple or dict of tensors"),
        ({"step": lambda model, batch: 1 / 0}, "the step function raised ZeroDivisionError"),
        ({"step": 3}, "step must be a function"),
        ({"world_size": 0}, "give a whole number of ranks"),
        ({"world_size": 2.0}, "give a whole number of ranks"),
        ({"world_size": 1, "strategies": ["fsdp"]}, "plan them with world_size of 2 or more"),
        ({"strategies": ["zero9"]}, "cannot be planned; choose from"),
        ({"strategies": []}, "no strategy to plan"),
        ({"device": "tpu"}, "device 'tpu' is not valid"),
    ],
)
def test_bad_input_is_one_line_saying_what_to_pass(kwargs: dict[str, object], says: str) -> None:
    args: dict[str, object] = {
        "model_or_builder": lambda: mlp(16, 1),
        "batch": "torch.randn(4, 16)",
        "world_size": 2,
        "strategies": ["ddp", "fsdp FULL_SHARD"],
    }
    with pytest.raises(SpecError) as caught:
        dry_run(**{**args, **kwargs})  # type: ignore[arg-type]
    message = str(caught.value)
    assert says in message and "\n" not in message
    assert not dist.is_initialized(), "the fake process group is destroyed after a failure too"


def test_a_batch_the_model_cannot_take_is_one_line_and_torch_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(SpecError, match="pass a batch the model's forward takes") as caught:
        dry_run(lambda: mlp(16, 1), "torch.randn(4, 32)", 2, strategies=["ddp", "fsdp FULL_SHARD"])
    assert "\n" not in str(caught.value)
    # torch logs the failed fake op with its traceback (to stderr, in a notebook) unless told not to
    assert [r.getMessage() for r in caplog.records if r.name.startswith("torch")] == []


def test_world_size_1_plans_ddp_only() -> None:
    assert list(dry_run(lambda: mlp(16, 1), "torch.randn(4, 16)", 1)) == ["ddp"]


def test_the_callers_excepthook_and_process_group_state_are_restored() -> None:
    hook = sys.excepthook
    plans(2, strategies=["ddp"])
    assert sys.excepthook is hook and not dist.is_initialized()


@pytest.fixture
def real_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dist.ProcessGroup]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


def test_beside_a_real_default_group_the_dry_run_leaves_it_alone(real_group: dist.ProcessGroup) -> None:
    plan = plans(4, strategies=["fsdp FULL_SHARD"])["fsdp FULL_SHARD"]
    assert plan.world_size == 4 and plan.peak_bytes > 0
    assert dist.group.WORLD is real_group and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    with pytest.raises(SpecError, match="the model builder raised ZeroDivisionError"):
        dry_run(lambda: 1 / 0, "torch.randn(2)", 2)  # type: ignore[arg-type, return-value]


def test_beside_a_real_default_group_a_module_and_batch_plan_as_they_do_alone(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Beside a real group the model and batch reach the dry run's child as shapes, not values."""
    model, batch = mlp(64, 2), torch.randn(8, 64)
    alone = dry_run(model, batch, 2, device="cpu", strategies=["ddp", "fsdp FULL_SHARD"])
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        beside = dry_run(model, batch, 2, device="cpu", strategies=["ddp", "fsdp FULL_SHARD"])
    finally:
        dist.destroy_process_group()
    assert beside == alone


# -- find_batch -----------------------------------------------------------------------------------


def peak(size: int) -> int:
    return dry_run(lambda: mlp(256, 2), f"torch.randn({size}, 256)", 2, strategies=["ddp"])["ddp"].peak_bytes


def test_find_batch_returns_the_largest_batch_that_fits() -> None:
    budget = peak(37)
    found = find_batch(lambda: mlp(256, 2), lambda b: f"torch.randn({b}, 256)", 2, budget, "ddp")
    assert found >= 37
    assert peak(found) <= budget < peak(found + 1)


def test_find_batch_is_zero_when_nothing_fits_and_rejects_bad_input() -> None:
    assert find_batch(lambda: mlp(256, 2), lambda b: f"torch.randn({b}, 256)", 2, 1000, "ddp") == 0
    with pytest.raises(SpecError, match="find_batch needs one strategy"):
        find_batch(lambda: mlp(16, 1), lambda b: f"torch.randn({b}, 16)", 2, 10**9, "fsdp")
    with pytest.raises(SpecError, match=r"make_batch\(1\) raised"):
        find_batch(lambda: mlp(16, 1), lambda b: 1 / 0, 2, 10**9, "ddp")
    with pytest.raises(SpecError, match="device_bytes"):
        find_batch(lambda: mlp(16, 1), lambda b: f"torch.randn({b}, 16)", 2, 0, "ddp")


def test_plans_that_fail_are_listed_and_the_rest_are_planned() -> None:
    from torch.distributed.fsdp import FSDPModule

    def step(model: nn.Module, batch: torch.Tensor) -> None:
        if isinstance(model, FSDPModule):
            raise ValueError("no FSDP here")
        model(batch).mean().backward()

    plans = dry_run(mlp(64, 2), "torch.randn(4, 64)", 2, strategies=["ddp", "fsdp"], step=step)
    assert list(plans) == ["ddp"]
    failed = plans.failed  # type: ignore[attr-defined]
    assert set(failed) == {"fsdp FULL_SHARD", "fsdp SHARD_GRAD_OP", "fsdp FULL_SHARD + offload"}
    assert all("no FSDP here" in why and "\n" not in why for why in failed.values())
    with pytest.raises(SpecError, match=r"fsdp FULL_SHARD was not planned: .*no FSDP here"):
        plans["fsdp FULL_SHARD"]


def test_several_plans_show_one_live_line_and_ctrl_c_stops_cleanly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from jupyter_shard.planner import dry_run as module

    monkeypatch.setattr(module, "QUIET_FOR", 0.0)
    dry_run(mlp(64, 2), "torch.randn(4, 64)", 2, strategies=["ddp", "fsdp FULL_SHARD"])
    err = capsys.readouterr().err
    assert "\rdry run: tracing ddp, 1 of 2" in err and "\rdry run: tracing fsdp FULL_SHARD, 2 of 2" in err
    assert err.endswith("\r") and "\n" not in err  # one live line, cleared at the end
    monkeypatch.setenv("JUPYTER_SHARD_PROGRESS", "0")  # a notebook run whose outputs are kept
    dry_run(mlp(64, 2), "torch.randn(4, 64)", 2, strategies=["ddp", "fsdp FULL_SHARD"])
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("JUPYTER_SHARD_PROGRESS")

    calls = []

    def interrupted(model: nn.Module, batch: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) > 2:  # the second plan's first step
            raise KeyboardInterrupt
        model(batch).mean().backward()

    autocast, to = torch.autocast, nn.Module.to
    with pytest.raises(KeyboardInterrupt):
        dry_run(mlp(64, 2), "torch.randn(4, 64)", 2, strategies=["ddp", "fsdp FULL_SHARD"], step=interrupted)
    assert "dry run stopped by Ctrl-C while tracing plan 2 of 2\n" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()
    assert torch.autocast is autocast and nn.Module.to is to
    assert dry_run(mlp(64, 2), "torch.randn(4, 64)", 2, strategies=["ddp"])["ddp"].peak_bytes > 0


def test_a_step_with_an_optimizer_over_the_users_own_model_is_refused_in_one_line() -> None:
    """Its state would count 0 bytes, and stepping it would change the user's real parameters."""
    model = mlp(64, 2)
    model(torch.randn(4, 64)).mean().backward()  # the user's model holds gradients from training
    opt = torch.optim.AdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]

    def step(m: nn.Module, batch: torch.Tensor) -> None:
        m(batch).mean().backward()
        opt.step()

    with pytest.raises(SpecError, match="the step uses the optimizer 'opt', made outside it") as caught:
        dry_run(model, "torch.randn(4, 64)", 2, strategies=["ddp"], step=step)
    assert "\n" not in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state, "the user's optimizer took no step"

    def own(m: nn.Module, batch: torch.Tensor) -> None:  # the way that works: made inside the step
        optimizer = steps.setdefault(id(m), torch.optim.AdamW(m.parameters()))
        m(batch).mean().backward()
        optimizer.step()

    steps: dict[int, torch.optim.Optimizer] = {}
    assert dry_run(model, "torch.randn(4, 64)", 2, strategies=["ddp"], step=own)["ddp"].optimizer > 0

    class Config:
        optimizer = "adamw"

    cfg = Config()

    def named_like_it(m: nn.Module, batch: torch.Tensor) -> None:  # reads cfg.optimizer: no optimizer
        assert cfg.optimizer == "adamw"
        own(m, batch)

    assert (
        dry_run(model, "torch.randn(4, 64)", 2, strategies=["ddp"], step=named_like_it)["ddp"].optimizer > 0
    )
    import functools

    def train(m: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        m(batch).mean().backward()
        optimizer.step()

    with pytest.raises(SpecError, match="made outside it"):
        dry_run(
            model, "torch.randn(4, 64)", 2, strategies=["ddp"], step=functools.partial(train, optimizer=opt)
        )
