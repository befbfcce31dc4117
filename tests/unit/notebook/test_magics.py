"""jupyter_shard.notebook.magics without rank processes: bad options are one UsageError line, no pool.

``Pool`` is replaced by a tripwire for every test here, so a bug that reached pool creation fails the
test instead of starting ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from jupyter_shard import spec as spec_mod
from jupyter_shard.notebook import magics as magics_mod
from jupyter_shard.notebook.magics import DistributedMagics
from jupyter_shard.spec import LaunchSpec


@pytest.fixture(scope="module")
def shell(ipython: InteractiveShell) -> Iterator[InteractiveShell]:
    ipython.run_line_magic("load_ext", "jupyter_shard")
    yield ipython
    ipython.run_line_magic("unload_ext", "jupyter_shard")


class _Tripwire:
    created: ClassVar[list[Any]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _Tripwire.created.append((args, kwargs))
        raise AssertionError(f"a Pool was created: {args} {kwargs}")


class _FakePool:
    """A started pool that records anything done to it."""

    def __init__(self, nproc: int = 2) -> None:
        self.spec = LaunchSpec.create(nproc=nproc, device="cpu", gpu_count=0)
        self.started = True
        self.world_size = nproc
        self.background = None
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append(name)
            raise AssertionError(f"pool.{name} called")

        return record


@pytest.fixture
def magics(shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch) -> Iterator[DistributedMagics]:
    m = shell.magics_manager.registry["DistributedMagics"]
    assert isinstance(m, DistributedMagics)
    monkeypatch.setattr(magics_mod, "Pool", _Tripwire)
    monkeypatch.setattr(spec_mod, "visible_gpus", lambda: 0)
    _Tripwire.created.clear()
    m.pool = None
    yield m
    m.pool = None
    assert _Tripwire.created == [], "no pool may be created by these tests"


def _usage_error(shell: InteractiveShell, magic: str, line: str, cell: str | None = "x = 1") -> str:
    with pytest.raises(UsageError) as info:
        if cell is None:
            shell.run_line_magic(magic, line)
        else:
            shell.run_cell_magic(magic, line, cell)
    msg = str(info.value)
    assert "\n" not in msg, f"one line, got: {msg!r}"
    return msg


def test_extension_registers_the_magics(shell: InteractiveShell, magics: DistributedMagics) -> None:
    cell_magics = shell.magics_manager.magics["cell"]
    line_magics = shell.magics_manager.magics["line"]
    assert {"distributed", "rank"} <= set(cell_magics)
    assert {"dist_push", "dist_pull", "dist_status", "dist_stacks", "dist_interrupt"} <= set(line_magics)
    assert {"dist_restart", "dist_shutdown"} <= set(line_magics)


BAD_DISTRIBUTED = [
    ("--nproc 0", "--nproc 0 is not valid; a pool needs at least 1 rank"),
    ("--strategy bogus", "--strategy 'bogus' is not valid; choose one of: none, ddp, fsdp, deepspeed"),
    ("--gpus 4", "0 CUDA device(s) are visible; run `--nproc 4 --device cpu` for CPU ranks"),
    ("--ranks 7", "rank 7 does not exist: the pool has 2 ranks (0-1)"),
    ("--ranks 3-1", "rank range '3-1' runs backwards; write it as 1-3"),
    ("--ranks x", "rank list 'x' is not valid"),
    ("--bogus", "%%distributed: unknown option '--bogus'; see %%distributed? for the options"),
    ("--nproc 2 --bogus 3", "unknown option '--bogus'"),
    ("--nproc abc", "%%distributed: argument --nproc: invalid int value: 'abc'"),
    ("--nproc", "%%distributed: argument --nproc: expected one argument"),
    ('--config "unterminated', "%%distributed: No closing quotation"),
    ("--config /nonexistent/ds.json", "--config '/nonexistent/ds.json' does not exist"),
    ("--device tpu", "--device 'tpu' is not valid; choose one of: auto, cpu, cuda"),
    ("--device cuda", "no CUDA device is visible"),
    ("--zero-stage 2", "--zero-stage applies only to --strategy deepspeed"),
    ("--strategy deepspeed --zero-stage 5", "--zero-stage 5 is not valid; choose 0, 1, 2 or 3"),
    ("--gpus 2 --device cpu", "--gpus 2 needs CUDA but --device is cpu"),
    ("--nodes 0", "--nodes 0 is not valid"),
]


@pytest.mark.parametrize(("line", "phrase"), BAD_DISTRIBUTED, ids=[b[0] for b in BAD_DISTRIBUTED])
def test_bad_distributed_options_give_one_usage_line_and_no_pool(
    shell: InteractiveShell, magics: DistributedMagics, line: str, phrase: str
) -> None:
    assert phrase in _usage_error(shell, "distributed", line)
    assert magics.pool is None


@pytest.mark.parametrize(("line", "phrase"), BAD_DISTRIBUTED[:6], ids=[b[0] for b in BAD_DISTRIBUTED[:6]])
def test_bad_options_leave_a_running_pool_untouched(
    shell: InteractiveShell, magics: DistributedMagics, line: str, phrase: str
) -> None:
    pool = _FakePool()
    magics.pool = pool  # type: ignore[assignment]
    assert phrase in _usage_error(shell, "distributed", line)
    assert magics.pool is pool
    assert pool.calls == []


def test_ranks_are_checked_against_the_running_pool(
    shell: InteractiveShell, magics: DistributedMagics
) -> None:
    pool = _FakePool(nproc=4)
    magics.pool = pool  # type: ignore[assignment]
    msg = _usage_error(shell, "distributed", "--ranks 4")
    assert msg == "rank 4 does not exist: the pool has 4 ranks (0-3)"
    assert pool.calls == []


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_timeout_is_a_usage_error(shell: InteractiveShell, magics: DistributedMagics, value: str) -> None:
    try:
        msg = _usage_error(shell, "distributed", f"--timeout {value}")
        assert f"--timeout {value} is not valid" in msg
        assert magics.pool is None
    finally:
        _Tripwire.created.clear()


def test_parser_errors_are_prefixed_once(shell: InteractiveShell, magics: DistributedMagics) -> None:
    msg = _usage_error(shell, "distributed", "--n 2")
    assert msg.startswith("%%distributed: ambiguous option: --n could match --nproc, --nodes")


def test_dist_pull_errors_name_the_line_magic(shell: InteractiveShell, magics: DistributedMagics) -> None:
    msg = _usage_error(shell, "dist_pull", "x --bogus", cell=None)
    assert msg.startswith("%dist_pull: unknown option '--bogus'")


def test_rank_magic_checks_ranks_against_the_pool(shell: InteractiveShell, magics: DistributedMagics) -> None:
    pool = _FakePool(nproc=2)
    magics.pool = pool  # type: ignore[assignment]
    assert _usage_error(shell, "rank", "7") == "rank 7 does not exist: the pool has 2 ranks (0-1)"
    assert "runs backwards" in _usage_error(shell, "rank", "1-0")
    assert pool.calls == []


@pytest.mark.parametrize(
    ("kind", "magic", "line"),
    [
        ("cell", "rank", "0"),
        ("line", "dist_stacks", ""),
        ("line", "dist_interrupt", ""),
        ("line", "dist_pull", "x"),
    ],
)
def test_magics_that_need_a_pool_say_how_to_start_one(
    shell: InteractiveShell, magics: DistributedMagics, kind: str, magic: str, line: str
) -> None:
    msg = _usage_error(shell, magic, line, cell="pass" if kind == "cell" else None)
    assert msg == "no pool is running; start one with a %%distributed cell"


def test_dist_restart_without_pool(shell: InteractiveShell, magics: DistributedMagics) -> None:
    assert _usage_error(shell, "dist_restart", "", cell=None) == (
        "no pool to restart; start one with a %%distributed cell"
    )


def test_dist_shutdown_without_pool_says_there_was_nothing_to_do(
    shell: InteractiveShell, magics: DistributedMagics, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_line_magic("dist_shutdown", "")
    assert capsys.readouterr().out == "jupyter_shard: no pool is running; nothing to shut down\n"
    assert magics.pool is None


def test_dist_output_says_and_sets_how_rank_lines_show(
    shell: InteractiveShell, magics: DistributedMagics, capsys: pytest.CaptureFixture[str]
) -> None:
    from jupyter_shard.notebook import display

    shell.run_line_magic("dist_output", "")
    assert capsys.readouterr().out.startswith("jupyter_shard: rank output: auto (the summary from 9 ranks up")
    try:
        shell.run_line_magic("dist_output", "all")
        assert display.output_mode() == "all" and not display.summarises(64)
        assert "rank output: all (every line of every rank" in capsys.readouterr().out
        assert (
            _usage_error(shell, "dist_output", "most", cell=None)
            == "%dist_output most: say summary, all or auto"
        )
        assert display.output_mode() == "all"  # a bad word changes nothing
    finally:
        display.set_output_mode("auto")


def test_dist_push_undefined_name(shell: InteractiveShell, magics: DistributedMagics) -> None:
    shell.user_ns["defined_here"] = 1
    shell.user_ns.pop("surely_undefined", None)
    msg = _usage_error(shell, "dist_push", "defined_here surely_undefined", cell=None)
    assert msg == "%dist_push: 'surely_undefined' is not defined in the notebook"


def test_dist_push_needs_names(shell: InteractiveShell, magics: DistributedMagics) -> None:
    assert "%dist_push needs variable names" in _usage_error(shell, "dist_push", "  ", cell=None)


def test_dist_push_with_defined_names_but_no_pool(shell: InteractiveShell, magics: DistributedMagics) -> None:
    shell.user_ns["lr"] = 0.1
    assert "no pool is running" in _usage_error(shell, "dist_push", "lr", cell=None)


@pytest.mark.parametrize(
    ("line", "phrase"),
    [
        ("", "the following arguments are required: name"),
        ("x --rank 1 --all", "argument --all: not allowed with argument --rank"),
        ("x --rank abc", "argument --rank: invalid int value: 'abc'"),
        ("x --bogus", "unknown option '--bogus'"),
    ],
)
def test_dist_pull_bad_options(
    shell: InteractiveShell, magics: DistributedMagics, line: str, phrase: str
) -> None:
    assert phrase in _usage_error(shell, "dist_pull", line, cell=None)


def test_dist_pull_rank_outside_the_pool(shell: InteractiveShell, magics: DistributedMagics) -> None:
    pool = _FakePool(nproc=2)
    magics.pool = pool  # type: ignore[assignment]
    msg = _usage_error(shell, "dist_pull", "x --rank 5", cell=None)
    assert msg == "%dist_pull: rank 5 does not exist; the pool has ranks 0-1"
    assert pool.calls == []


def test_dist_status_without_pool_prints_the_hint(
    shell: InteractiveShell, magics: DistributedMagics, capsys: pytest.CaptureFixture[str]
) -> None:
    assert shell.run_line_magic("dist_status", "") is None
    assert capsys.readouterr().out == "no pool is running; start one with a %%distributed cell\n"
    assert magics.pool is None


def test_a_restart_names_every_option_that_changed() -> None:
    from jupyter_shard.notebook.magics import _change

    old = LaunchSpec.create(nproc=2, device="cpu", strategy="deepspeed", zero_stage=2, gpu_count=0)
    new = old.with_changes(nproc=4, zero_stage=3)
    assert _change(old, new) == "2 → 4 ranks, zero-stage 2 → 3"
    assert _change(old, old) == "with new options"


def test_collective_timeout_is_a_pool_setting_kept_across_cells(
    shell: InteractiveShell, magics: DistributedMagics
) -> None:
    from jupyter_shard.notebook.magics import _change

    spec = magics.spec_for("--nproc 2 --device cpu --collective-timeout 20")
    assert spec.timeout == 20.0
    pool = _FakePool(nproc=2)
    pool.spec = spec
    magics.pool = pool  # type: ignore[assignment]
    assert magics.spec_for("--strategy ddp").timeout == 20.0
    assert magics.spec_for("--timeout 5").timeout == 20.0  # a cell limit only
    assert _change(spec, spec.with_changes(timeout=30.0)) == "collective-timeout 20.0 → 30.0"
    magics.pool = None
    msg = _usage_error(shell, "distributed", "--collective-timeout 0")
    assert msg == "--collective-timeout 0 is not valid; give seconds above 0"


def test_a_later_cell_keeps_every_option_it_does_not_name(magics: DistributedMagics) -> None:
    first = "--nproc 2 --device cpu --strategy ddp --precision bf16-mixed --accumulate 4 --clip-grad-norm 1.0"
    spec = magics.spec_for(first)
    pool = _FakePool(nproc=2)
    pool.spec = spec
    magics.pool = pool  # type: ignore[assignment]
    try:
        later = magics.spec_for("--nproc 3")
    finally:
        magics.pool = None
    assert later == spec.with_changes(nproc=3)
    assert (later.strategy, later.precision.value, later.accumulate, later.clip_grad_norm) == (
        "ddp",
        "bf16-mixed",
        4,
        1.0,
    )


def test_a_restart_after_a_later_cell_names_only_what_that_cell_changed(magics: DistributedMagics) -> None:
    from jupyter_shard.notebook.magics import _change

    spec = magics.spec_for("--nproc 2 --device cpu --precision bf16-mixed")
    pool = _FakePool(nproc=2)
    pool.spec = spec
    magics.pool = pool  # type: ignore[assignment]
    try:
        later = magics.spec_for("--nproc 3 --accumulate 2")
    finally:
        magics.pool = None
    assert _change(spec, later) == "2 → 3 ranks, accumulate 1 → 2"


def test_a_restart_names_a_changed_launcher_option() -> None:
    from jupyter_shard.launchers import merge_spec, resolve_spec
    from jupyter_shard.notebook.magics import _change

    old = resolve_spec(launcher="torchrun", hosts="a,b", interface="eth0", gpu_count=0)
    assert _change(old, merge_spec(old, {"interface": "eth1"})) == "interface eth0 → eth1"
    assert _change(old, merge_spec(old, {"nproc": 3})) == "2 → 3 ranks per node"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--gpus 0,2", "--gpus 0,2 asked for, but 0 CUDA device(s) are visible"),
        ("--gpus 1,1", "--gpus 1,1 names device 1 twice; give each device once"),
        ("--gpus 0-x", "--gpus '0-x' is not valid; give a count (--gpus 4) or the devices to use"),
        ("--gpus 0,2 --launcher torchrun --nodes 2", "--gpus 0,2 chooses this machine's devices"),
    ],
)
def test_gpus_lists_are_checked_before_any_pool(
    shell: InteractiveShell, magics: DistributedMagics, line: str, message: str
) -> None:
    assert message in _usage_error(shell, "distributed", line)


def test_gpus_list_reaches_the_spec(magics: DistributedMagics, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec_mod, "visible_gpus", lambda: 4)
    spec = magics.spec_for("--gpus 2,0 --strategy ddp")
    assert (spec.nproc, spec.gpus, spec.describe()) == (2, (2, 0), "2 GPU ranks (GPUs 2,0) · ddp")


def test_a_restart_names_the_gpus_that_changed() -> None:
    from jupyter_shard.notebook.magics import _change

    old = LaunchSpec.create(gpus="0,1", gpu_count=4)  # the same spec as --gpus 2
    assert _change(old, LaunchSpec.create(gpus="2,3", gpu_count=4)) == "GPUs 0-1 → 2-3"
    assert LaunchSpec.create(gpus="2", gpu_count=4) == LaunchSpec.create(gpus="0-1", gpu_count=4)
    cpu = LaunchSpec.create(nproc=2, device="cpu", gpu_count=4)
    assert _change(old, cpu) == "device cuda → cpu, GPUs 0-1 → none"


def test_a_repeated_magic_line_is_parsed_once_and_each_cell_gets_its_own_options() -> None:
    from jupyter_shard.notebook.args import distributed_parser, parse_options

    parser = distributed_parser()
    first = parse_options(parser, "--nproc 3 --timeout 5")
    parser.parse_known_args = None  # type: ignore[assignment,method-assign]  # parsing again would fail
    second = parse_options(parser, "--nproc 3 --timeout 5")
    assert vars(second) == vars(first) and second is not first
    second.nproc = 9
    assert parse_options(parser, "--nproc 3 --timeout 5").nproc == 3
    with pytest.raises(TypeError):  # another line is parsed
        parse_options(parser, "--nproc 4")


PICKER_CELL = "layers = [torch.nn.Linear(16, 16) for _ in range(2)]\ntorch.nn.Sequential(*layers)"


def test_dist_picker_is_a_line_and_a_cell_magic_and_the_cell_defines_nothing(
    shell: InteractiveShell, magics: DistributedMagics
) -> None:
    from jupyter_shard.notebook.picker import DryRunPicker, Picker

    assert "dist_picker" in shell.magics_manager.magics["line"]
    assert "dist_picker" in shell.magics_manager.magics["cell"]
    assert isinstance(shell.run_line_magic("dist_picker", "124M"), Picker)
    shell.run_cell("import torch")
    names = set(shell.user_ns)
    line = "--batch 'torch.randn(4, 16)' --world-size 2 --gpu L4"
    shown = shell.run_cell_magic("dist_picker", line, PICKER_CELL)
    assert isinstance(shown, DryRunPicker) and "Dry run of the cell's model" in shown.report
    assert set(shell.user_ns) == names, "the cell's code ran in a scratch namespace"
    message = _usage_error(shell, "dist_picker", line, "layers = [")
    assert message.startswith("%%dist_picker: the model code has a syntax error")
    assert isinstance(shell.run_cell_magic("dist_picker", line, PICKER_CELL), DryRunPicker)
