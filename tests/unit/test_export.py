"""``%dist_export`` rendering: a transcript becomes a torchrun script (and an sbatch file). No processes."""

from __future__ import annotations

import ast
import json
import math
import pickle
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cloudpickle
import pytest
import torch

from jupyter_shard.export import render as export_module
from jupyter_shard.export.files import export
from jupyter_shard.export.render import render_sbatch, render_script
from jupyter_shard.kernel.transcript import CellEntry, PushEntry, Transcript
from jupyter_shard.launchers.slurm import SlurmOptions
from jupyter_shard.notebook.args import export_magic
from jupyter_shard.rank import script as script_module
from jupyter_shard.spec import Device, LaunchSpec, SpecError

WHEN = datetime(2025, 1, 2, 3, 4)


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


def _cell(code: str, n: int, ranks: tuple[int, ...] | None = None, status: str = "ok") -> CellEntry:
    return CellEntry(f"# %%distributed\n{code}", ranks, status, n)


def _push(ranks: tuple[int, ...] | None = None, **values: Any) -> PushEntry:
    return PushEntry(tuple((k, cloudpickle.dumps(v)) for k, v in values.items()), ranks)


def _transcript(*entries: CellEntry | PushEntry) -> Transcript:
    t = Transcript()
    for e in entries:
        t.add(e)
    return t


def _render(*entries: CellEntry | PushEntry, spec: LaunchSpec | None = None) -> str:
    rendered = render_script(_transcript(*entries), spec or LaunchSpec(), "train.py", source="nb", when=WHEN)
    compile(rendered.text, "train.py", "exec")  # every rendering is a valid script
    return rendered.text


class _FakeShard:
    def __init__(self, rank: int) -> None:
        self.rank = rank


def _run_script(text: str, rank: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Execute a rendered script in-process with ``start`` giving a stand-in ``shard`` of ``rank``."""
    started: list[dict[str, Any]] = []

    def start(**kwargs: Any) -> _FakeShard:
        started.append(kwargs)
        return _FakeShard(rank)

    monkeypatch.setattr(script_module, "start", start)
    monkeypatch.setattr(script_module, "finish", lambda: None)
    path = tmp_path / "train.py"
    namespace: dict[str, Any] = {"__name__": "exported", "__file__": str(path)}
    exec(compile(text, str(path), "exec"), namespace)
    namespace["_started"] = started
    return namespace


def test_cells_and_pushes_come_in_the_order_they_ran_under_their_execution_counts() -> None:
    text = _render(
        _cell("a = 1", 3),
        _push(lr=0.5),
        _cell("b = a + lr", 4),
        _cell("c = b * 2", 7),
    )
    marks = [line for line in text.splitlines() if line.startswith("# --- ")]
    assert marks == [
        "# --- cell [3] ---",
        "# --- %dist_push lr ---",
        "# --- cell [4] ---",
        "# --- cell [7] ---",
    ]
    assert text.index("a = 1") < text.index("lr = 0.5") < text.index("b = a + lr") < text.index("c = b * 2")
    assert text.index("shard = start(") < text.index("a = 1") and text.rstrip().endswith("finish()")


def test_the_script_starts_the_pools_strategy_with_its_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = LaunchSpec(strategy="ddp", accumulate=4, clip_grad_norm=1.5, timeout=90.0)
    text = _render(_cell("x = shard.rank", 1), spec=spec)
    ns = _run_script(text, 0, monkeypatch, tmp_path)
    assert ns["_started"] == [
        {"strategy": "ddp", "device": "cpu", "timeout": 90.0, "options": spec.rank_options()}
    ]
    assert "jupyter_shard: a session" not in text and "Source: nb" in text
    assert "    torchrun --nproc-per-node 2 train.py" in text


def test_failed_cells_are_left_out_with_a_comment() -> None:
    text = _render(_cell("good = 1", 1), _cell("broken_call()", 2, status="error"), _cell("also = 2", 3))
    assert "broken_call" not in text
    assert "# --- cell [2] failed in the notebook: left out ---" in text
    assert "good = 1" in text and "also = 2" in text


def test_plain_cells_stay_verbatim_and_need_no_ipython_shell() -> None:
    code = 'msg = "100% done"  # not a magic\nfor i in range(2):\n    print(f"{i}%")\n'
    text = _render(_cell(code, 1))
    assert f"# --- cell [1] ---\n# %%distributed\n{code}" in text
    assert "get_ipython" not in text and "ipython" not in text.split("shard = start")[0].split("import")[-1]


def test_cells_on_some_ranks_run_only_there_and_multiline_strings_keep_their_text(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code = 'seen = "first"\ntext = """line one\n  line two\n"""\nif True:\n    nested = 1\n'
    entries = (
        _cell("seen = None\ntext = None", 1),
        CellEntry(f"# %%rank 1\n{code}", (1,), "ok", 2),
        _cell("others = shard.rank", 3, ranks=(0, 2)),
    )
    text = _render(*entries)
    assert "# --- cell [2] on rank 1 ---\nif shard.rank == 1:\n    # %%rank 1\n" in text
    assert "# --- cell [3] on rank 0,2 ---\nif shard.rank in (0, 2):\n" in text
    on_1 = _run_script(text, 1, monkeypatch, tmp_path)
    assert on_1["seen"] == "first" and on_1["text"] == "line one\n  line two\n" and on_1["nested"] == 1
    assert "others" not in on_1
    on_0 = _run_script(text, 0, monkeypatch, tmp_path)
    assert on_0["seen"] is None and on_0["others"] == 0


def test_a_comment_only_cell_on_some_ranks_still_parses() -> None:
    text = _render(_cell("# just a note", 1, ranks=(1,)))
    assert "if shard.rank == 1:\n    # %%distributed\n    # just a note\n    pass\n" in text


def test_pushed_values_are_literals_when_they_read_back_equal_else_pickled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values: dict[str, Any] = {
        "lr": 0.05,
        "cfg": {"layers": [1, 2], "name": "mlp", "flags": (True, None)},
        "weights": torch.arange(4.0),
        "pt": Point(3),
        "missing": math.nan,
    }
    text = _render(_push(**values), _cell("x = 1", 1))
    assert "\nlr = 0.05\n" in text
    assert "\ncfg = {'layers': [1, 2], 'name': 'mlp', 'flags': (True, None)}\n" in text
    assert "weights = unpickle(" in text and "# torch.Tensor, cloudpickle" in text
    assert "pt = unpickle(" in text and f"# {__name__}.Point, cloudpickle" in text
    assert "missing = unpickle(" in text  # nan != nan: not a literal
    monkeypatch.setattr(script_module, "unpickle", script_module.unpickle)
    ns = _run_script(text, 0, monkeypatch, tmp_path)
    assert ns["lr"] == 0.05 and ns["cfg"] == values["cfg"]
    assert torch.equal(ns["weights"], values["weights"]) and ns["pt"].x == 3
    assert math.isnan(ns["missing"])


def test_pushes_to_some_ranks_are_assigned_only_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    text = _render(_push(ranks=(1,), only=7), _cell("x = globals().get('only')", 1))
    assert "# --- %dist_push only to rank 1 ---\nif shard.rank == 1:\n    only = 7\n" in text
    assert _run_script(text, 1, monkeypatch, tmp_path)["x"] == 7
    assert _run_script(text, 0, monkeypatch, tmp_path)["x"] is None


def test_a_value_over_the_limit_goes_to_a_file_beside_the_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    big = b"\x01" * (export_module.SIDECAR_OVER + 10)
    script = tmp_path / "train.py"
    message = export(
        _transcript(_push(big=big), _push(big=b"x" * 2**21), _cell("n = len(big)", 1)), LaunchSpec(), script
    )
    data = tmp_path / "train.py.data"
    assert sorted(p.name for p in data.iterdir()) == ["big-2.pkl", "big.pkl"]
    assert pickle.loads((data / "big.pkl").read_bytes()) == big
    text = script.read_text()
    assert 'big = unpickle_file(__file__, "train.py.data/big.pkl")  # bytes, 1.0 MiB' in text
    assert len(text) < 10_000 and "2 large values in" in message
    ns = _run_script(text, 0, monkeypatch, tmp_path)
    assert ns["n"] == 2**21


def test_ipython_syntax_is_transformed_and_the_script_gets_a_shell() -> None:
    text = _render(
        _cell("%time y = 2\n!echo hi\nx = 1", 1),
        CellEntry("%%time\nz = 3\n", None, "ok", 2),
    )
    assert "get_ipython().run_line_magic('time', 'y = 2')" in text
    assert "get_ipython().system('echo hi')" in text
    assert "get_ipython().run_cell_magic('time', '', 'z = 3\\n')" in text
    assert "from jupyter_shard.rank.script import finish, ipython, start" in text
    assert (
        text.index("shard = start(")
        < text.index("get_ipython = ipython(globals())")
        < text.index("run_line_magic")
    )


def test_display_without_an_import_gets_the_shell_and_with_one_does_not() -> None:
    assert "get_ipython = ipython(globals())" in _render(_cell("display(1)", 1))
    imported = _render(_cell("from IPython.display import display\ndisplay(1)", 1))
    assert "get_ipython = ipython(globals())" not in imported


def test_a_strategy_registered_in_the_notebook_is_registered_in_the_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from jupyter_shard import strategies
    from jupyter_shard.strategies.base import NoStrategy

    monkeypatch.setattr(strategies, "_registered", {"mine": (NoStrategy, {"bucket": 3})})
    text = _render(_cell("x = 1", 1), spec=LaunchSpec(strategy="mine"))
    monkeypatch.setattr(strategies, "_registered", {})
    ns = _run_script(text, 0, monkeypatch, tmp_path)
    assert strategies.registered("mine") == (NoStrategy, {"bucket": 3})
    assert ns["_started"][0]["strategy"] == "mine"
    assert text.index('register_strategy("mine"') < text.index("shard = start(")


def test_export_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    script, job = tmp_path / "train.py", tmp_path / "job.sbatch"
    script.write_text("mine\n")
    t = _transcript(_cell("x = 1", 1))
    with pytest.raises(SpecError, match=r"train\.py exists; add --force to overwrite it"):
        export(t, LaunchSpec(), script, sbatch=job)
    assert script.read_text() == "mine\n" and not job.exists()  # nothing written on a refusal
    job.write_text("job\n")
    with pytest.raises(SpecError, match=r"job\.sbatch exists"):
        export(t, LaunchSpec(), tmp_path / "other.py", sbatch=job)
    assert not (tmp_path / "other.py").exists()
    export(t, LaunchSpec(), script, sbatch=job, force=True)
    assert "x = 1" in script.read_text() and "#SBATCH" in job.read_text()
    assert script.stat().st_mode & 0o777 != 0o600  # as open() would make it, not the temp file's mode


def test_force_removes_data_files_the_new_export_no_longer_uses(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    big = b"\x02" * (export_module.SIDECAR_OVER + 1)
    export(_transcript(_push(big=big), _cell("x = 1", 1)), LaunchSpec(), script)
    assert (tmp_path / "train.py.data" / "big.pkl").exists()
    export(_transcript(_cell("x = 1", 1)), LaunchSpec(), script, force=True)
    assert not (tmp_path / "train.py.data").exists()


def test_nothing_to_export_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no %%distributed cell has run since the pool started"):
        export(_transcript(_push(lr=1)), LaunchSpec(), tmp_path / "train.py")
    with pytest.raises(SpecError, match="all 1 cell since"):
        export(_transcript(_cell("boom()", 1, status="error")), LaunchSpec(), tmp_path / "train.py")
    assert not (tmp_path / "train.py").exists()


def test_the_magic_line_is_parsed_into_one_clear_error(tmp_path: Path) -> None:
    pool = SimpleNamespace(transcript=_transcript(_cell("x = 1", 1)), spec=LaunchSpec())
    with pytest.raises(SpecError, match=r"usage: %dist_export train\.py"):
        export_magic("", pool)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="unknown option '--nope'"):
        export_magic(f"{tmp_path / 't.py'} --nope", pool)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"directory .* does not exist"):
        export_magic(f"{tmp_path / 'no' / 't.py'}", pool)  # type: ignore[arg-type]
    message = export_magic(f"{tmp_path / 't.py'} --sbatch {tmp_path / 'j.sbatch'}", pool)  # type: ignore[arg-type]
    assert message.startswith(f"jupyter_shard: wrote {tmp_path / 't.py'} (1 cell, in the order they ran)")
    assert "`torchrun --nproc-per-node 2 t.py`" in message and "`sbatch j.sbatch`" in message


def test_sbatch_asks_slurm_for_the_pools_shape_and_starts_torchrun_per_node() -> None:
    spec = LaunchSpec(
        nproc=4,
        device=Device.CUDA,
        nodes=2,
        launcher="slurm",
        strategy="fsdp",
        launcher_options=SlurmOptions(partition="gpu", time_limit="01:30:00", account="proj"),
    )
    text = render_sbatch(spec, "train.py", when=WHEN, name="job.sbatch")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=train",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=01:30:00",
        "#SBATCH --account=proj",
        "#SBATCH --output=train-%j.out",
    ]
    assert text.startswith("#!/bin/bash\n")
    assert 'mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")\nhead="${hosts[0]}"' in text
    srun = text[text.index("srun ") :].replace("\\\n", " ").split()
    assert srun == [
        "srun", '"$TORCHRUN"', "--nnodes", '"$SLURM_JOB_NUM_NODES"', "--nproc-per-node", "4",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", '"$head:$port"', "--rdzv-id", '"$SLURM_JOB_ID"',
        "--tee", "3", "train.py",
    ]  # fmt: skip
    assert f'TORCHRUN="${{TORCHRUN:-{Path(sys.executable).with_name("torchrun")}}}"' in text


def test_sbatch_on_cpu_asks_for_no_gpus_and_leaves_out_options_the_spec_lacks() -> None:
    text = render_sbatch(LaunchSpec(nproc=2), "sub dir/train.py", when=WHEN)
    assert "--gpus-per-node" not in text and "--partition" not in text and "--time" not in text
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --cpus-per-task=2\n" in text
    assert text.rstrip().endswith("--tee 3 'sub dir/train.py'")


def test_the_header_says_how_to_run_on_several_nodes() -> None:
    text = _render(_cell("x = 1", 1), spec=LaunchSpec(nproc=4, nodes=2, launcher="torchrun"))
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert "1 cell run on 2 nodes × 4 CPU ranks (none)" in doc
    assert "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\\n" in doc


def test_script_metrics_are_json_lines_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(script_module.METRICS_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run1")
    metrics = script_module._MetricsFile(script_module._metrics_path(1))
    helper = script_module._ScriptShard(1, 1, 2, torch.device("cpu"), "none", metrics, {})
    helper.log(loss=torch.tensor(0.5))  # the first record is written at once
    helper.log(loss=0.25, step=10)
    helper.log(acc=1)
    helper.flush_metrics()  # what finish() and exit do
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / "run1" / "rank-1.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in lines] == [
        {"rank": 1, "step": 1, "loss": 0.5},
        {"rank": 1, "step": 10, "loss": 0.25},
        {"rank": 1, "step": 3, "acc": 1.0},
    ]
    assert all(isinstance(r["time"], float) for r in lines)


def test_script_metrics_that_cannot_be_written_go_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    metrics = script_module._MetricsFile(blocker / "rank-0.jsonl")  # a directory that cannot exist
    helper = script_module._ScriptShard(0, 0, 1, torch.device("cpu"), "none", metrics, {})
    helper.log(loss=2.0)
    err = capsys.readouterr().err
    assert "shard.log records not written" in err and '"loss": 2.0' in err
