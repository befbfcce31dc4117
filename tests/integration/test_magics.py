"""``%%distributed`` and friends through a real kernel (jupyter_client) with 2 CPU ranks on gloo.

One kernel and one pool serve the whole module, in order: each test adds to the rank state the
next one may rely on, as a notebook would.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def nb(shared_kernel: Any) -> Any:
    run = shared_kernel.execute("%%distributed --nproc 2 --device cpu\nimport os, sys\nstate = 'kept'")
    assert run.ok, run.outputs
    return shared_kernel


def test_hello_all_reduce_labels_each_rank(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (shard.rank + 1)\n"
        "dist.all_reduce(t)\n"
        "print('rank', shard.rank, 'of', shard.world_size, 'sum', t.item())\n"
    )
    assert run.ok, run.outputs
    lines = sorted(run.stream("stdout").splitlines())
    assert lines == ["[rank 0] rank 0 of 2 sum 3.0", "[rank 1] rank 1 of 2 sum 3.0"]


def test_state_lives_between_cells_and_values_that_differ_are_all_shown(nb: Any) -> None:
    nb.execute("%%distributed\nvalue = 10 * (shard.rank + 1)")
    run = nb.execute("%%distributed\n(state, value)")
    assert run.ok, run.outputs
    assert run.data("execute_result") == [{"text/plain": "[rank 0] ('kept', 10)\n[rank 1] ('kept', 20)"}]
    # Out[n] and _ are rank 0's object itself, not a display
    assert nb.execute("_[1] + 1").data("execute_result") == [{"text/plain": "11"}]


def test_a_cell_value_is_a_real_object_in_out_and_underscore(nb: Any) -> None:
    run = nb.execute("%%distributed\n40 + 1")
    assert run.data("execute_result") == [{"text/plain": "41"}], "ranks agree: shown once, unlabelled"
    count = run.reply["content"]["execution_count"]
    after = nb.execute(f"(_ + 1, Out[{count}] * 2, type(_).__name__)")
    assert after.data("execute_result") == [{"text/plain": "(42, 82, 'int')"}]
    tensor = nb.execute("%%distributed\nimport torch\ntorch.arange(3.0) * (shard.rank + 1)")
    assert tensor.data("execute_result") == [
        {"text/plain": "[rank 0] tensor([0., 1., 2.])\n[rank 1] tensor([0., 2., 4.])"}
    ]
    assert nb.execute("(_ + 1).tolist()").data("execute_result") == [{"text/plain": "[1.0, 2.0, 3.0]"}]
    every = nb.execute(
        "import jupyter_shard\n{k: v.tolist() for k, v in jupyter_shard.last_values().items()}"
    )
    assert every.data("execute_result") == [{"text/plain": "{0: [0.0, 1.0, 2.0], 1: [0.0, 2.0, 4.0]}"}]


def test_a_value_only_some_ranks_give_is_shown_labelled(nb: Any) -> None:
    run = nb.execute("%%distributed\nNone if shard.rank == 0 else 'only rank 1'")
    assert run.ok, run.outputs
    assert run.data("display_data") == [{"text/plain": "[rank 1] 'only rank 1'"}]
    assert run.data("execute_result") == [], "rank 0's value is None: Out[n] stays unset"
    every = nb.execute("import jupyter_shard\njupyter_shard.last_values()")
    assert every.data("execute_result") == [{"text/plain": "{1: 'only rank 1'}"}]


def test_a_value_that_is_not_copied_says_why(nb: Any) -> None:
    big = nb.execute("%%distributed\nimport torch\ntorch.zeros(5_000_000)")
    assert big.data("execute_result") == [{"text/plain": "tensor([0., 0., 0.,  ..., 0., 0., 0.])"}]
    said = nb.execute("_").data("execute_result")[0]["text/plain"]
    assert said.startswith(
        "<rank 0's value, shown but not copied to the kernel: rank 0's last value holds 19 MiB of tensors"
    )  # refused from its tensors' size, before anything is pickled
    assert "over the 16 MiB limit of this copy (last_values() copies it)" in said
    lock = nb.execute("%%distributed\nimport threading\nthreading.Lock()")
    assert lock.ok and "lock object" in lock.data("execute_result")[0]["text/plain"]
    said = nb.execute("_").data("execute_result")[0]["text/plain"]
    assert "could not be pickled: TypeError: cannot pickle '_thread.lock' object>" in said


def test_torch_launcher_environment_is_set(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "import torch.distributed as dist\n"
        "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT']\n"
        "print({k: os.environ[k] for k in keys[:5]}, os.environ['MASTER_PORT'].isdigit(), "
        "dist.is_initialized(), dist.get_backend(), 'JUPYTER_SHARD_KEY' in os.environ)\n"
    )
    out = run.stream()
    for k in (0, 1):
        assert (
            f"[rank {k}] {{'RANK': '{k}', 'LOCAL_RANK': '{k}', 'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '2', "
            f"'MASTER_ADDR': '127.0.0.1'}} True True gloo False"
        ) in out


def test_rank_magic_and_ranks_option_select_ranks(nb: Any) -> None:
    run = nb.execute("%%rank 1\nprint('here', shard.rank)")
    assert run.stream() == "[rank 1] here 1\n"
    run = nb.execute("%%distributed --ranks 0\nprint('here', shard.rank)")
    assert run.stream() == "[rank 0] here 0\n"
    run = nb.execute("%%rank 1\nshard.rank")
    assert run.data("execute_result") == [{"text/plain": "1"}]


def test_a_bare_rank_magic_and_an_idle_interrupt_say_so(nb: Any) -> None:
    bare = nb.execute("%%rank\nprint('where?')")
    assert not bare.ok and "[rank" not in bare.stream()
    assert bare.stream("stderr") == (
        "UsageError: %%rank needs the ranks to run on: %%rank 0, %%rank 0,2 or %%rank 1-3\n"
    )
    idle = nb.execute("%dist_interrupt")
    assert idle.ok and idle.stream() == "jupyter_shard: no rank is running a cell; nothing to interrupt\n"


def test_push_and_pull_values(nb: Any) -> None:
    run = nb.execute(
        "import torch\n"
        "class Point:\n"
        "    def __init__(self, x): self.x = x\n"
        "pt = Point(3); weights = torch.arange(4.0); cfg = {'lr': 0.1, 'layers': [1, 2]}\n"
        "%dist_push pt weights cfg"
    )
    assert run.ok, run.outputs
    assert run.stream().startswith("jupyter_shard: pushed pt, weights, cfg to rank 0-1 (")
    run = nb.execute("%%distributed\nmine = (pt.x + shard.rank, float(weights.sum()), cfg['layers'])")
    assert run.ok, run.outputs
    run = nb.execute("%dist_pull mine --all\nmine")
    assert run.data("execute_result") == [{"text/plain": "{0: (3, 6.0, [1, 2]), 1: (4, 6.0, [1, 2])}"}]
    run = nb.execute("%dist_pull mine --rank 1\nmine")
    assert run.data("execute_result") == [{"text/plain": "(4, 6.0, [1, 2])"}]
    run = nb.execute("%%distributed\nimport torch\nt = torch.full((2,), float(shard.rank))")
    assert run.ok, run.outputs
    run = nb.execute("%dist_pull t --rank 1\nt")
    assert run.data("execute_result") == [{"text/plain": "tensor([1., 1.])"}], run.outputs
    run = nb.execute("%dist_pull t --all --device\nt")  # as they are on the ranks' device (the CPU here)
    assert run.data("execute_result") == [{"text/plain": "{0: tensor([0., 0.]), 1: tensor([1., 1.])}"}]


def test_push_of_what_cannot_be_sent_names_the_variable_and_what_to_do(nb: Any) -> None:
    assert nb.execute("import threading\nlk = threading.Lock()\nfh = open(__import__('os').devnull)").ok
    run = nb.execute("%dist_push lk")
    assert not run.ok
    assert run.error_text() == (
        "PoolError: 'lk' could not be pickled (TypeError: cannot pickle '_thread.lock' object): create it "
        "on the ranks in a %%distributed cell, or push what it is made from"
    )
    run = nb.execute("%dist_push fh")
    assert run.error_text() == (
        "PoolError: 'fh' is an open file, which cannot be sent to the ranks: push its path and open it in "
        "a %%distributed cell"
    )
    assert nb.execute("%%distributed\n'fh' in dir()").data("execute_result") == [{"text/plain": "False"}]


def test_pull_gather_brings_a_plain_model(kernel: Any) -> None:
    """Under fsdp each rank holds a shard of a wrapped module (``FSDPLinear``, DTensor parameters):
    ``--gather`` brings the kernel a plain ``Linear`` with whole tensors, the ones the ranks built."""
    assert kernel.execute("%load_ext jupyter_shard").ok
    run = kernel.execute(
        "%%distributed --nproc 2 --device cpu --strategy fsdp\nimport torch\ntorch.manual_seed(0)\n"
        "net = torch.nn.Linear(4, 6)\nwhole = {k: v.clone() for k, v in net.state_dict().items()}\n"
        "prepared = shard.prepare(net)\nprint(type(prepared).__name__, type(prepared.weight).__name__)"
    )
    assert run.ok, run.outputs
    assert "[rank 0] FSDPLinear DTensor" in run.stream(), run.stream()
    run = kernel.execute(
        "%dist_pull prepared --gather\n%dist_pull whole\nimport torch\n"
        "(type(prepared).__name__, type(prepared.weight).__name__, tuple(prepared.weight.shape), "
        "all(torch.equal(prepared.state_dict()[k], v) for k, v in whole.items()))"
    )
    assert run.data("execute_result") == [{"text/plain": "('Linear', 'Parameter', (6, 4), True)"}], (
        run.outputs
    )
    said = run.stream()
    assert re.search(
        r"gathered prepared on the ranks in \d+\.\d\d s, then .+ to the kernel in \d+\.\d\d s", said
    ), said


def test_pull_of_missing_name_is_one_clear_error(nb: Any) -> None:
    run = nb.execute("%dist_pull nothing_here")
    assert not run.ok
    assert "name 'nothing_here' is not defined on rank 0" in run.error_text()


def test_stderr_warnings_logging_kept_apart_from_stdout(nb: Any) -> None:
    run = nb.execute(
        "%%distributed\n"
        "import logging, warnings\n"
        "print('to out')\n"
        "print('to err', file=sys.stderr)\n"
        "warnings.warn('careful now')\n"
        "logging.getLogger('demo').warning('logged line')\n"
    )
    out, err = run.stream("stdout"), run.stream("stderr")
    for k in (0, 1):
        assert f"[rank {k}] to out\n" in out
        assert f"[rank {k}] to err\n" in err
        assert re.search(rf"\[rank {k}\] .*UserWarning: careful now", err)
        assert f"[rank {k}] logged line\n" in err
    assert "to err" not in out and "to out" not in err


def test_ipython_magics_and_shell_commands_work_on_ranks(nb: Any) -> None:
    run = nb.execute("%%distributed\n%time y = 1\n!echo shell says $RANK")
    assert run.ok, run.outputs
    out = run.stream()
    for k in (0, 1):
        assert f"[rank {k}] Wall time:" in out
        assert f"[rank {k}] shell says {k}\n" in out


def test_rich_display_is_labelled_by_rank(nb: Any) -> None:
    run = nb.execute("%%distributed\nfrom IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))")
    shown = sorted(run.data(), key=lambda d: d["text/plain"])
    assert [d["text/plain"] for d in shown] == [
        "[rank 0] <IPython.core.display.HTML object>",
        "[rank 1] <IPython.core.display.HTML object>",
    ]
    assert 'data-rank="1"' in shown[1]["text/html"] and "<b>hi</b>" in shown[1]["text/html"]


def test_images_from_ranks_keep_png_and_a_text_fallback(nb: Any) -> None:
    run = nb.execute("%%rank 0\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\n")
    assert run.ok, run.outputs
    (shown,) = run.data()
    assert "image/png" in shown
    assert shown["text/plain"].startswith("[rank 0] <Figure")


@pytest.mark.parametrize("module", ["tqdm", "tqdm.auto"])
def test_progress_bar_is_one_live_line_per_rank(nb: Any, module: str) -> None:
    run = nb.execute(
        "%%distributed\n"
        f"from {module} import tqdm\nimport time\n"
        "for _ in tqdm(range(40), mininterval=0): time.sleep(0.01)\n"
    )
    assert run.ok, run.outputs
    assert "it/s" not in run.stream("stderr"), "progress bar updates leaked into the stream"
    finals = {}
    for o in run.outputs:
        if o["type"] in ("display_data", "update_display_data") and o["data"]["text/plain"].startswith(
            "[rank"
        ):
            rank = o["data"]["text/plain"][:8]
            finals[rank] = o["data"]["text/plain"]
    assert set(finals) == {"[rank 0]", "[rank 1]"}
    assert all("40/40" in text for text in finals.values()), finals
    creates = [o for o in run.outputs if o["type"] == "display_data"]
    assert len(creates) == 2, "one display per rank, updated in place"
    updates = [o for o in run.outputs if o["type"] == "update_display_data"]
    assert len(updates) <= 2 * (1 + 40 * 0.01 / 0.1 + 2) * 2


def test_error_names_rank_and_points_at_cell_lines(nb: Any) -> None:
    run = nb.execute("%%distributed\nx = 1\nif shard.rank == 1:\n    raise ValueError('bad shard')\n")
    assert not run.ok
    err = run.error
    assert err["ename"] == "DistributedError"
    text = run.error_text()
    assert text.splitlines()[0] == "rank 1 failed first: ValueError: bad shard"
    assert "----> 4     raise ValueError('bad shard')" in text
    assert f"Cell In[{run.reply['content']['execution_count']}], line 4" in text
    assert "pool.py" not in text and "magics.py" not in text and "runtime.py" not in text
    run = nb.execute("%%distributed\nprint('still here', state)")
    assert run.ok and "[rank 0] still here kept" in run.stream()


def test_status_table_and_log_files(nb: Any) -> None:
    run = nb.execute("%dist_status")
    (table,) = run.data("execute_result")
    text = table["text/plain"]
    assert "2 CPU ranks" in text
    lines = text.splitlines()
    assert re.fullmatch(r"ranks: zygote \(fork server, pid \d+\)", lines[1])  # how they came
    assert lines[2] == "2 ranks: 2 idle"
    rows = [ln.split() for ln in lines[4:6]]
    assert [r[0] for r in rows] == ["0", "1"]
    assert all(r[3] == "cpu" and r[4] == "idle" for r in rows)
    assert all(r[5].isdigit() and r[6] == "MiB" for r in rows)
    footer = lines[6]
    assert footer.startswith("logs: ") and footer.endswith("/rank-<k>.log"), footer
    for k in range(2):
        log = Path(footer.removeprefix("logs: ").replace("<k>", str(k)))
        assert "to err" in log.read_text() and "to out" in log.read_text()


def test_changing_rank_count_restarts_and_says_so(nb: Any) -> None:
    run = nb.execute("%%distributed --nproc 3\nshard.world_size")
    assert run.ok, run.outputs
    assert "restarting pool 2 → 3 ranks; rank state is lost" in run.stream()
    assert run.data("execute_result") == [{"text/plain": "3"}]
    run = nb.execute("%%distributed\n'state' in dir()")
    assert run.data("execute_result") == [{"text/plain": "False"}]


def test_shutdown_then_a_new_cell_starts_a_fresh_pool(nb: Any) -> None:
    run = nb.execute("%dist_shutdown")
    assert "pool shut down" in run.stream()
    again = nb.execute("%dist_shutdown")
    assert again.stream() == "jupyter_shard: no pool is running; nothing to shut down\n"
    run = nb.execute("%dist_status")
    assert "no pool is running" in run.stream()
    run = nb.execute("%%distributed --nproc 2\nshard.world_size")
    assert run.data("execute_result") == [{"text/plain": "2"}]


def test_a_gpus_list_without_gpus_is_one_line_and_keeps_the_pool(nb: Any) -> None:
    before = nb.execute("%%distributed\nimport os\nos.getpid()").data("execute_result")
    import torch

    visible = torch.cuda.device_count()  # 0 here; on a GPU machine, devices past the last one
    run = nb.execute(f"%%distributed --gpus {visible},{visible + 2}\nprint('never runs')")
    if visible == 0:
        assert run.stream("stderr") == (
            "UsageError: --gpus 0,2 asked for, but 0 CUDA device(s) are visible; "
            "run `--nproc 2 --device cpu` for CPU ranks\n"
        )
    else:
        err = run.stream("stderr")
        assert err.startswith(f"UsageError: --gpus {visible},{visible + 2}") and len(err.splitlines()) == 1, (
            err
        )
        assert f"GPU {visible} is not visible; this kernel sees {visible} GPU(s)" in err, err
    assert nb.execute("%%distributed\nos.getpid()").data("execute_result") == before


def test_matplotlib_magics_work_on_ranks(nb: Any) -> None:
    run = nb.execute("%%distributed\n%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2]);")
    assert run.ok, run.error_text()
    assert len([d for d in run.data("display_data") if "image/png" in d]) == 2, "a figure from each rank"
    agg = nb.execute("%%distributed\n%matplotlib agg\nimport matplotlib\nmatplotlib.get_backend()")
    assert agg.data("execute_result") == [{"text/plain": "'agg'"}]
    widget = nb.execute("%%distributed\n%matplotlib widget\nplt.plot([1, 2]);")
    assert widget.ok, widget.error_text()
    assert "[rank 0] %matplotlib widget: figures from a rank are shown as images (inline)" in widget.stream(
        "stderr"
    )
    assert len([d for d in widget.data("display_data") if "image/png" in d]) == 2
    assert nb.execute("%%distributed\n%matplotlib inline").ok


def test_ranks_follow_the_kernels_working_directory(nb: Any, tmp_path: Any) -> None:
    before = nb.execute("import os\nos.getcwd()").data("execute_result")[0]["text/plain"]
    try:
        assert nb.execute(f"os.chdir({str(tmp_path)!r})").ok
        run = nb.execute("%%distributed\nimport os\nos.getcwd()")
        assert run.data("execute_result") == [{"text/plain": repr(str(tmp_path))}]
        moved = nb.execute("%%distributed\nos.chdir('/')\nos.getcwd()")
        assert moved.data("execute_result") == [{"text/plain": "'/'"}]
        again = nb.execute("%%distributed\nos.getcwd()")
        assert again.data("execute_result") == [{"text/plain": repr(str(tmp_path))}], "each cell"
    finally:
        nb.execute(f"os.chdir({before})")


def test_errors_read_at_a_glance(nb: Any) -> None:
    # rank 1 raises a moment later, so which rank failed first does not depend on the machine's load
    same = nb.execute(
        "%%distributed\nimport time\ntime.sleep(0.3 * shard.rank)\nraise ValueError('the same on every rank')"
    )
    text = same.error_text()
    assert (
        text.splitlines()[0]
        == "rank 0 failed first: ValueError: the same on every rank (also failed: rank 1)"
    )
    assert "──── rank 0-1: ValueError: the same on every rank ────" in text
    assert text.count("Traceback (most recent call last)") == 1, "an identical traceback is shown once"
    differ = nb.execute("%%distributed\nraise ValueError(f'rank {shard.rank} differs')")
    text = differ.error_text()  # raised in one place: one traceback, each rank's message under it
    assert text.count("Traceback (most recent call last)") == 1, text
    assert "──── rank 0-1: ValueError, 2 different messages ────" in text
    assert text.splitlines()[-2:] == [
        "[rank 0] ValueError: rank 0 differs",
        "[rank 1] ValueError: rank 1 differs",
    ]
    timed = nb.execute("%%distributed --timeout 1\nimport time\ntime.sleep(30)")
    text = timed.error_text()
    assert text.splitlines()[0] == "timed out after 1 s: KeyboardInterrupt on rank 0-1"
    assert "----> 3 time.sleep(30)" in text
    assert "runner.py" not in text and "raise KeyboardInterrupt" not in text, "the pool's own frames"
    status = nb.execute("%dist_status").data("execute_result")[0]["text/plain"]
    rows = [line.split() for line in status.splitlines()[4:6]]
    assert [row[4] for row in rows] == ["interrupted", "interrupted"], status


def _reply(nb: Any, kind: str) -> dict[str, Any]:
    while True:
        msg: dict[str, Any] = nb.kc.get_shell_msg(timeout=10)
        if msg["msg_type"] == kind:
            return msg


def test_help_documents_every_option_and_tab_completes_them(nb: Any) -> None:
    code = "%%distributed --nproc 2\n1"
    nb.kc.inspect(code, 3, detail_level=0)
    doc = _reply(nb, "inspect_reply")["content"]["data"]["text/plain"]
    for option in (
        "--nproc",
        "--gpus",
        "--zero-stage",
        "--offload",
        "--precision",
        "--ranks",
        "--timeout",
        "--collective-timeout",
        "--launcher",
        "--interface",
        "--bg",
        "--no-dashboard",
        "--keep",
    ):
        assert option in doc, option
    assert "..." not in doc
    asked = {
        "%%distributed --st": ["--strategy"],
        "%%distributed --strategy ": ["none", "ddp", "fsdp", "deepspeed"],
        "%%distributed --nproc 2 --device c": ["cpu", "cuda"],
        "%%distributed --offload ": ["none", "cpu", "nvme"],
    }
    for line, expected in asked.items():
        nb.kc.complete(line, len(line))
        reply = _reply(nb, "complete_reply")["content"]
        assert reply["matches"] == expected, (line, reply["matches"])
        typed = line.rsplit(" ", 1)[-1]
        assert reply["cursor_start"] == len(line) - len(typed)
    nb.kc.complete("impo", 4)
    assert "import" in _reply(nb, "complete_reply")["content"]["matches"], "other lines complete as before"
    shown = nb.execute("%%distributed\nhelp(shard)").stream()
    assert "[rank 0] class Shard" in shown and "shard.prepare(model, opt, loader)" in shown
