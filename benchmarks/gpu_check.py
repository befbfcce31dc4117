"""``make gpu-check``: on a GPU machine with no network, install the bundle, measure, test, and report.

The machine has Python 3.12 with torch (a CUDA build) and Lightning; ``make gpu-bundle`` (elsewhere,
``gpu_bundle.py``) brought the rest as wheels in ``gpu-bundle/``. ``check`` runs, each stage under its
own timeout, the whole within ``--minutes``:

1. **install**: a venv in ``.gpu-venv`` that sees the host's packages (``--system-site-packages``, and
   a ``.pth`` naming the host interpreter's site directories, for a host Python that is itself a venv),
   the bundle installed with ``pip --no-index``, torch and Lightning held at the versions found;
2. **bench** (``bench``, in that venv): one training step of a small GPT-style transformer on a
   one-GPU pool (``Pool.run``, what a ``%%distributed`` cell does) against the identical code under
   ``torchrun --nproc-per-node 1`` on the same GPU, in rounds that alternate which side goes first;
   the pool's cold start and warm restart, each to a first result on the GPU;
3. **tests**: ``pytest -m gpu tests/gpu`` with the time left;
4. one report, ``--results`` (``benchmarks/results/gpu_check.md``): device, versions, stages, test
   counts and failures, the figures and the targets.

A stage that fails or runs out of time is reported and the next one still runs. Stages run with this
checkout first on ``PYTHONPATH``, so ranks and tests use the tree, not the bundled wheel (whose metadata
provides the entry points). Without a GPU, ``check --python .venv/bin/python --device cpu --quick``
runs the same stages on CPU ranks in an existing environment (the tests then skip).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # run as a script (`make gpu-check`): beside this file
    import gpu_verdict
except ImportError:  # imported as part of the benchmarks package (the tests)
    from benchmarks import gpu_verdict

ROOT = Path(__file__).resolve().parent.parent
HELD = ("torch", "lightning", "pytorch-lightning")  # the host's own: pinned while the bundle installs
INSTALL = ("jupyter_shard", "deepspeed", "pytest", "pytest-timeout")
THROUGHPUT_TARGET = 0.98  # the pool's step within 2 % of torchrun's
RESTART_TARGET = 1.5  # seconds, warm restart of a one-GPU pool to a first result
INSTALL_LIMIT, BENCH_LIMIT = 120.0, 150.0  # seconds; the tests get what is left of --minutes
FIRST_CELL = "import torch\ntorch.ones(1, device=shard.device).sum().item()"

# Requirements that pin what the host has of HELD, as the venv sees it.
HELD_VERSIONS = """
import importlib.metadata as m
for name in {held!r}:
    try:
        print(f"{{name}}=={{m.version(name)}}")
    except m.PackageNotFoundError:
        pass
"""

# The training cell, identical on both sides: a decoder-only transformer (pre-norm blocks, causal
# attention, an untied LM head) over random tokens, AdamW, each step timed between device syncs.
TRAIN = """
import gc, json, time, torch
from torch import nn
torch.manual_seed(0)
vocab, width, depth, heads, seq, batch = {vocab}, {width}, {depth}, {heads}, {seq}, {batch}

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))

model = GPT()
parameters = sum(p.numel() for p in model.parameters())
model, opt = shard.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
tokens = torch.randint(vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(shard.rank))
tokens = tokens.to(shard.device)
on_gpu = shard.device.type == "cuda"
sync = (lambda: torch.cuda.synchronize(shard.device)) if on_gpu else (lambda: None)
gc.collect()  # the last round's model, which shard.prepare has just let go of
if on_gpu:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(shard.device)
times = []
for step in range({warmup} + {steps}):
    sync()
    started = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    shard.backward(loss)
    shard.step()
    sync()
    times.append(time.perf_counter() - started)
report = json.dumps({{
    "times": times[{warmup}:],
    "loss": loss.item(),
    "parameters": parameters,
    "peak": torch.cuda.max_memory_allocated(shard.device) if on_gpu else 0,
}})
del model, opt, logits, loss
"""

# torchrun's worker: the same Shard helper a rank builds, over the group a pool's rank would have.
WORKER = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from jupyter_shard.rank.shard import Shard, set_current
local = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local) if {device!r} == "cuda" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
else:
    dist.init_process_group("gloo")
shard = Shard(dist.get_rank(), local, dist.get_world_size(), device, "ddp", lambda *a: None, {options!r})
set_current(shard)
exec(compile({train!r}, "train", "exec"))
if dist.get_rank() == 0:
    with open({out!r}, "w") as fh:
        fh.write(report)
dist.destroy_process_group()
"""

VERSIONS = """
import platform, torch
cuda = shard.device.type == "cuda"
versions = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version() if cuda else None,
    "nccl": str(torch.cuda.nccl.version()) if cuda else None,
    "device": torch.cuda.get_device_name(shard.device) if cuda else platform.processor() or "cpu",
    "capability": ".".join(map(str, torch.cuda.get_device_capability(shard.device))) if cuda else None,
    "memory_gib": torch.cuda.get_device_properties(shard.device).total_memory / 2**30 if cuda else None,
}
"""

SIZES = {  # model and run sizes: (device, quick) -> settings
    ("cuda", False): dict(vocab=16384, width=768, depth=8, heads=12, seq=512, batch=16, warmup=10, steps=40),
    ("cuda", True): dict(vocab=8192, width=512, depth=4, heads=8, seq=256, batch=8, warmup=5, steps=10),
    ("cpu", False): dict(vocab=2048, width=128, depth=2, heads=4, seq=64, batch=8, warmup=3, steps=10),
    ("cpu", True): dict(vocab=512, width=64, depth=2, heads=4, seq=32, batch=4, warmup=2, steps=5),
}


# -- bench: runs in the venv ---------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _quiet_pool(scratch: Path, device: str, precision: str = "32") -> Any:
    from jupyter_shard import LaunchSpec, Pool
    from jupyter_shard.pool.output import ConsoleSink

    spec = LaunchSpec.create(nproc=1, device=device, strategy="ddp", precision=precision)
    return Pool(spec=spec, log_dir=scratch / "logs", sink=ConsoleSink(io.StringIO(), io.StringIO()))


def cold_start(scratch: Path, device: str) -> float:
    """Seconds from constructing a pool, with no zygote running (a kernel's first cell), to a first
    result computed on the rank's device."""
    from jupyter_shard.launchers import zygote

    zygote.close_all()
    started = time.perf_counter()
    pool = _quiet_pool(scratch, device)
    try:
        pool.run(FIRST_CELL)
        return time.perf_counter() - started
    finally:
        pool.shutdown()
        zygote.close_all()


def warm_restart(pool: Any) -> float:
    started = time.perf_counter()
    pool.restart()
    pool.run(FIRST_CELL)
    return time.perf_counter() - started


def torchrun_side(scratch: Path, device: str, precision: str, code: str) -> dict[str, Any]:
    out = scratch / "torchrun.json"
    worker = scratch / "worker.py"
    options = {"precision": precision, "accumulate": 1}
    worker.write_text(WORKER.format(root=str(ROOT), device=device, options=options, train=code, out=str(out)))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(worker),
    ]
    # a session of its own: killpg ends the agent and its worker
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}): {stderr.decode(errors='replace')[-2000:]}")
    report: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return report


def bench(args: argparse.Namespace) -> int:
    import jupyter_shard
    from jupyter_shard.gpus import nvidia_smi

    device, results_path = args.device, Path(args.json)
    # what a one-rank pool gives its rank; set here, torchrun's worker gets the same
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    sizes = dict(SIZES[(device, args.quick)])
    precision = "bf16-mixed" if device == "cuda" else "32"
    rounds, colds, warms = (1, 1, 2) if args.quick else (3, 2, 5)
    rounds = args.rounds if args.rounds is not None else rounds
    sizes["steps"] = args.steps if args.steps is not None else sizes["steps"]
    colds, warms = (0, 0) if args.no_starts else (colds, warms)
    results: dict[str, Any] = {"device": device, "precision": precision, "sizes": sizes}
    smi = nvidia_smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader") or ""
    results["nvidia_smi"] = smi.strip().splitlines()
    results["packages"] = _versions_of(
        "lightning", "deepspeed", "jupyter_shard", "pytest", "pyzmq", "ipython"
    )
    results["jupyter_shard_from"] = str(Path(jupyter_shard.__file__).parent)

    def save() -> None:  # after every measurement: a stage that times out keeps what it measured
        results_path.write_text(json.dumps(results, indent=1))

    try:
        measure(results, save, args.device, sizes, precision, rounds, colds, warms)
    except Exception as e:
        results["error"] = f"{type(e).__name__}: {e}"[-3000:]
        save()
        raise
    return 0


def measure(
    results: dict[str, Any],
    save: Callable[[], None],
    device: str,
    sizes: dict[str, int],
    precision: str,
    rounds: int,
    colds: int,
    warms: int,
) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        scratch = Path(tmp)
        results["cold"] = []
        for _ in range(colds):
            results["cold"].append(cold_start(scratch, device))
            print(f"cold start: {results['cold'][-1]:.2f} s", flush=True)
            save()
        with _quiet_pool(scratch, device, precision) as pool:
            pool.run(VERSIONS)
            results["versions"] = pool.pull("versions")
            save()
            results["warm"] = []
            for _ in range(warms):
                results["warm"].append(warm_restart(pool))
                print(f"warm restart: {results['warm'][-1]:.2f} s", flush=True)
                save()
            code = TRAIN.format(**sizes)
            results["rounds"] = []
            for n in range(rounds):
                sides: dict[str, Any] = {}
                for side in ("pool", "torchrun") if n % 2 == 0 else ("torchrun", "pool"):
                    if side == "pool":
                        pool.run(code, timeout=300)
                        sides[side] = json.loads(pool.pull("report"))
                    else:
                        sides[side] = torchrun_side(scratch, device, precision, code)
                sides["first"] = "pool" if n % 2 == 0 else "torchrun"
                results["rounds"].append(sides)
                steps = {
                    side: f"{_median(sides[side]['times']) * 1e3:.2f} ms" for side in ("pool", "torchrun")
                }
                print(f"round {n + 1}: median step {steps}", flush=True)
                save()
            import gpu_calibrate  # beside this file: the dry run against the allocator, same pool and model

            try:  # one GPU runs one plan: ddp at world size 1 (the planner shards only over 2 or more)
                results["calibration"] = gpu_calibrate.calibrate(pool, TRAIN, sizes, device, precision)
            except Exception as e:  # the figures above stand; the report says why this did not
                results["calibration_error"] = f"{type(e).__name__}: {e}"[-1500:]
            save()


# -- check: runs with the host's Python (standard library only) ---------------------------------------


@dataclass
class Stage:
    name: str
    status: str = "not run"
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _env() -> dict[str, str]:
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run_stage(stage: Stage, command: list[str], timeout: float) -> None:
    """Run ``command`` (its output goes straight through) until it ends or ``timeout`` passes; then
    SIGINT to its process group (pytest still writes its report), SIGKILL 30 s later."""
    if timeout < 10:
        stage.status = "skipped: no time left"
        return
    print(f"+ [{stage.name}, {timeout:.0f} s at most] {' '.join(command)}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, env=_env(), start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
        stage.status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        stage.status = f"timed out after {timeout:.0f} s"
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stage.seconds = time.monotonic() - started


def _output(command: list[str], timeout: float) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=timeout).stdout


def install(stage: Stage, host: str, venv: Path, bundle: Path, deadline: float) -> str:
    """Make the venv and install the bundle into it; returns the venv's python."""
    started = time.monotonic()
    python = str(venv / "bin" / "python")
    try:
        if not bundle.is_dir():
            raise RuntimeError(
                f"no {bundle}: run `make gpu-bundle` where PyPI is reachable and carry it here"
            )
        if not Path(python).exists():
            made = subprocess.run([host, "-m", "venv", "--system-site-packages", str(venv)], check=False)
            if made.returncode != 0:  # no ensurepip (Debian without python3-venv): pip comes from the host
                subprocess.run(
                    [host, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True
                )
        query = "import json, site; print(json.dumps(site.getsitepackages()"
        query += " + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])))"
        host_sites = json.loads(_output([host, "-c", query], 60))
        purelib = _output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 60
        ).strip()
        Path(purelib, "_gpu_check_host.pth").write_text(
            "".join(f"{p}\n" for p in host_sites if Path(p).is_dir())
        )
        held = _output([python, "-c", HELD_VERSIONS.format(held=HELD)], 60)
        if "torch==" not in held:
            raise RuntimeError(
                f"{host} has no torch: set GPU_PYTHON to the Python that has torch and Lightning"
            )
        constraints = venv / "constraints.txt"
        constraints.write_text(held)
        has_pip = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, check=False)
        pip = [python, "-m", "pip"] if has_pip.returncode == 0 else [host, "-m", "pip", "--python", python]
        command = [*pip, "install", "--no-index", f"--find-links={bundle}", f"--constraint={constraints}"]
        command += ["--disable-pip-version-check", "--no-input", *INSTALL]
        print(f"+ [install] holding {' '.join(held.split())}\n+ {' '.join(command)}", flush=True)
        subprocess.run(command, check=True, timeout=max(deadline - time.monotonic(), 1.0))
        stage.status = "ok"
    except (OSError, RuntimeError, subprocess.SubprocessError, ValueError) as e:
        stage.status = f"failed: {e}"
        print(f"error: install: {e}", flush=True)
    stage.seconds = time.monotonic() - started
    return python


def check(args: argparse.Namespace) -> int:
    started = time.monotonic()
    deadline = started + args.minutes * 60
    wanted = set(args.stages.split(","))
    stages = {name: Stage(name) for name in ("install", "bench", "tests")}
    loads = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    bench_json, junit = work / "bench.json", work / "tests.xml"
    if args.python is not None:
        python = args.python
        stages["install"].status = f"skipped: ran in {python}"
    elif "install" in wanted:
        limit = started + INSTALL_LIMIT
        python = install(stages["install"], args.host, args.venv.resolve(), args.bundle.resolve(), limit)
    else:
        python = str(args.venv / "bin" / "python")
        stages["install"].status = "skipped"
    ready = stages["install"].ok or stages["install"].status.startswith("skipped")
    rehearsal = args.device == "cpu"
    visible = _visible_gpus(python) if ready else 0
    if visible == 0 and not rehearsal:
        ready = False  # nothing GPU-specific could run: said in the verdict, the exit status 1
        for name in ("bench", "tests"):
            stages[name].status = "not run: no GPU is visible"
    if "bench" in wanted and ready:
        command = [python, __file__, "bench", "--json", str(bench_json), "--device", args.device]
        command += ["--quick"] if args.quick else []
        command += [] if args.rounds is None else ["--rounds", str(args.rounds)]
        command += [] if args.steps is None else ["--steps", str(args.steps)]
        command += ["--no-starts"] if args.no_starts else []
        longer = args.rounds is not None or args.steps is not None  # asked for: --minutes bounds it alone
        limit = deadline - time.monotonic() - (10 if longer else 0)
        run_stage(stages["bench"], command, limit if longer else min(BENCH_LIMIT, limit))
    collected: list[str] = []
    if "tests" in wanted and ready:
        base = [python, "-m", "pytest", "-m", "gpu", *gpu_verdict.GPU_FILES, "-p", "no:cacheprovider"]
        collected = _collected([*base, "--collect-only", "-q"])
        command = [*base, "-q", "-rfEs", f"--junitxml={junit}"]
        run_stage(stages["tests"], command, deadline - time.monotonic() - 10)
    tests = _tests(junit)
    statuses = {name: stage.status for name, stage in stages.items()}
    verdict = gpu_verdict.problems(statuses, sorted(wanted), tests, collected, visible, rehearsal)
    text = report(stages, _read_json(bench_json), tests, args, loads, time.monotonic() - started, verdict)
    shutil.rmtree(work, ignore_errors=True)
    if args.results == "-":
        print(text)
    else:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(text)
        print(f"report: {args.results}")
    for line in verdict:
        print(f"gpu-check: {line}", flush=True)
    print(
        "gpu-check: "
        + ("FAILED" if verdict else "passed")
        + (" (a rehearsal on CPU ranks)" if rehearsal else "")
    )
    return 1 if verdict else 0


def _visible_gpus(python: str) -> int:
    """CUDA devices the check's Python sees (0 when it cannot tell)."""
    try:
        text = _output([python, "-c", "import torch; print(torch.cuda.device_count())"], 180)
        return int(text.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0


def _collected(command: list[str]) -> list[str]:
    """The test ids pytest collects (to name the ones a timed-out stage never reached)."""
    try:
        done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def _read_json(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    return {}


def _tests(junit: Path) -> list[dict[str, Any]]:
    """One row per test case of pytest's JUnit XML: id, outcome, seconds, message."""
    try:
        root = ElementTree.parse(junit).getroot()
    except (OSError, ElementTree.ParseError):
        return []
    rows = []
    for case in root.iter("testcase"):
        row = {"outcome": "passed", "message": "", "detail": ""}
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                row["outcome"] = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                row["message"] = child.get("message") or (child.text or "").strip()
                row["detail"] = (child.text or "").strip() if child.tag != "skipped" else ""
        row["test"] = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        rows.append({**row, "seconds": float(case.get("time") or 0)})
    return rows


def _versions_of(*names: str) -> dict[str, str]:
    found = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


# -- the report ------------------------------------------------------------------------------------------


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _seconds(value: float) -> str:
    return "n/a" if value != value else f"{value:.2f}"


def git_state(root: Path = ROOT) -> tuple[str, bool] | None:
    """``(commit, tracked files differ from it)`` of the checkout at ``root``; None outside git."""
    try:
        head = _output(["git", "-C", str(root), "rev-parse", "HEAD"], 10).strip()
        dirty = _output(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], 10).strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head, bool(dirty)


def _git_revision() -> str:
    state = git_state()
    if state is None:
        return "not a git checkout"
    return f"revision {state[0][:7]}" + (" with uncommitted changes" if state[1] else "")


def tree_digest(root: Path = ROOT) -> str:
    """SHA-256 over the code a check runs from the tree (the package, the tests, the benchmarks):
    their paths and bytes, in path order."""
    digest = hashlib.sha256()
    for folder in ("jupyter_shard", "tests", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _revisions(bundle: Path) -> str:
    """What the bundle was made from (``gpu-bundle/REVISION``: its commit and the digest of its code)
    and whether this tree's code is the same; a copy of the tree sent to another machine can carry
    another repository state, and ranks and tests run the tree, not the bundled wheel."""
    try:
        stamp = json.loads((bundle / "REVISION").read_text())
        commit, made = str(stamp["commit"]), str(stamp["tree"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{_git_revision()} (the bundle names no revision)"
    dirty = " with uncommitted changes" if stamp.get("dirty") else ""
    same = "the tree's code is the bundle's" if made == tree_digest() else "the tree's code differs from it"
    return f"bundle made at {commit[:12]}{dirty}; {same} (this tree's git: {_git_revision()})"


def _target(what: str, value: float, unit: str, met: bool | None) -> tuple[str, str, str]:
    shown = "n/a" if value != value else f"{value:.3f}{unit}" if not unit else f"{value:.2f} {unit}"
    return what, shown, "n/a" if met is None or value != value else "met" if met else "not met"


def _training(bench: dict[str, Any]) -> tuple[list[str], float]:
    """The training section's lines, and the median throughput ratio over rounds (NaN without rounds)."""
    rounds = [r for r in bench.get("rounds", []) if "pool" in r and "torchrun" in r]
    if not rounds:
        return ["No training round finished (see the bench stage)."], float("nan")
    s, first = bench["sizes"], rounds[0]["pool"]
    lines = [
        f"A GPT-style decoder: {s['depth']} pre-norm blocks of width {s['width']}, {s['heads']} heads, "
        f"sequence {s['seq']}, batch {s['batch']}, vocabulary {s['vocab']} "
        f"({first['parameters'] / 1e6:.1f}M parameters), AdamW, `{bench['precision']}`, strategy `ddp` on "
        "one rank, built with `shard.prepare`. Each round runs it on the pool (`Pool.run`) and under "
        "`torchrun --nproc-per-node 1` (the same code and `Shard` helper), "
        f"{s['warmup']} untimed steps then {s['steps']} timed, each between device syncs; the side that "
        "goes first alternates. Throughput ratio = torchrun step / pool step (1.0: no overhead).",
        "",
        "| round | first | pool step (ms, median) | torchrun step (ms, median) | throughput ratio "
        "| loss pool / torchrun | peak CUDA MiB pool / torchrun |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for n, r in enumerate(rounds, 1):
        ours, theirs = _median(r["pool"]["times"]), _median(r["torchrun"]["times"])
        ratios.append(theirs / ours)
        lines.append(
            f"| {n} | {r['first']} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {theirs / ours:.3f} "
            f"| {r['pool']['loss']:.4f} / {r['torchrun']['loss']:.4f} "
            f"| {r['pool']['peak'] / 2**20:.0f} / {r['torchrun']['peak'] / 2**20:.0f} |"
        )
    pooled = _median([t for r in rounds for t in r["torchrun"]["times"]]) / _median(
        [t for r in rounds for t in r["pool"]["times"]]
    )
    lines += [
        "",
        f"Median ratio over rounds {_median(ratios):.3f} (range {min(ratios):.3f}–{max(ratios):.3f}); "
        f"pooled over every timed step {pooled:.3f}.",
    ]
    return lines, _median(ratios)


def report(
    stages: dict[str, Stage],
    bench: dict[str, Any],
    tests: list[dict[str, Any]],
    args: argparse.Namespace,
    loads: tuple[float, float, float],
    seconds: float,
    verdict: list[str] | None = None,
) -> str:
    versions, packages = bench.get("versions", {}), bench.get("packages", {})
    dry = " (a rehearsal on CPU ranks: nothing GPU-specific ran)" if args.device == "cpu" else ""
    device = versions.get("device", "n/a")
    if versions.get("memory_gib"):
        device += f", {versions['memory_gib']:.0f} GiB, compute capability {versions['capability']}"
    torch = (
        f"{versions.get('torch', 'n/a')} (CUDA {versions.get('cuda')}, cuDNN {versions.get('cudnn')}, "
        + (f"NCCL {versions.get('nccl')})")
    )
    lines = [
        f"# GPU check{dry}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_revisions(args.bundle)}; "
        f"the check took {seconds:.0f} s (budget {args.minutes:g} min).",
        "",
        "## Verdict",
        "",
        *(
            [f"**FAILED**: {len(verdict)} problem(s):", "", *(f"- {_cell(line)}" for line in verdict)]
            if verdict
            else ["**Passed**: every stage ran, every collected test ran, every skip was for a device count."]
        ),
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| device | {_cell(device)} |",
        f"| nvidia-smi | {_cell('; '.join(bench.get('nvidia_smi', [])) or 'n/a')} |",
        f"| host | {_cell(platform.node())}, {os.cpu_count()} CPUs, {_cell(platform.platform())} |",
        f"| Python | {versions.get('python', platform.python_version())} |",
        f"| torch | {_cell(torch)} |",
        *(f"| {name} | {_cell(version)} |" for name, version in packages.items()),
        f"| jupyter_shard imported from | `{bench.get('jupyter_shard_from', 'n/a')}` |",
        f"| load average | {' '.join(f'{x:.2f}' for x in loads)} before, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after |",
        "",
        "## Stages",
        "",
        "| stage | result | time |",
        "|---|---|---|",
        *(f"| {s.name} | {_cell(s.status)} | {s.seconds:.0f} s |" for s in stages.values()),
        "",
        "## Tests: `pytest -m gpu tests/gpu`",
        "",
    ]
    if tests:
        counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
        lines += [
            f"**{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
            f"{counts['skipped']} skipped** ({len(tests)} reported; the stage: {stages['tests'].status}).",
            "",
            "| test | outcome | s | message |",
            "|---|---|---|---|",
            *(
                f"| `{t['test']}` | {t['outcome']} | {t['seconds']:.1f} | {_cell(t['message'])[:400]} |"
                for t in tests
            ),
        ]
        for t in tests:
            if t["detail"]:
                tail = t["detail"][-2500:]
                lines += [
                    "",
                    f"<details><summary>{t['test']}</summary>",
                    "",
                    "```",
                    tail,
                    "```",
                    "</details>",
                ]
    else:
        lines.append(f"No results: the stage {stages['tests'].status}.")
    train, ratio = _training(bench)
    if "error" in bench:
        train = [f"The bench stage stopped on: `{_cell(bench['error'])[:1500]}`", "", *train]
    cold, warm = bench.get("cold", []), bench.get("warm", [])
    lines += ["", "## Benchmark", "", "### One training step: pool against torchrun", "", *train, ""]
    lines += [
        "### Starts",
        "",
        "| | median (s) | each (s) |",
        "|---|---|---|",
        f"| cold start to a first result on the device (no zygote yet) | {_seconds(_median(cold))} "
        f"| {', '.join(f'{x:.2f}' for x in cold) or 'n/a'} |",
        f"| warm restart (`Pool.restart()`) to a first result | {_seconds(_median(warm))} "
        f"| {', '.join(f'{x:.2f}' for x in warm) or 'n/a'} |",
        "",
        f"First result: `{FIRST_CELL.replace(chr(10), '; ')}`.",
        "",
    ]
    targets = [
        _target(
            f"Training step throughput ≥ {THROUGHPUT_TARGET} × torchrun's, one GPU",
            ratio,
            "",
            ratio >= THROUGHPUT_TARGET,
        ),
        _target(
            f"Warm restart to first result ≤ {RESTART_TARGET} s, one-GPU pool",
            _median(warm),
            "s",
            _median(warm) <= RESTART_TARGET,
        ),
    ]
    import gpu_calibrate

    lines += gpu_calibrate.lines(bench.get("calibration", []), bench.get("calibration_error"))
    lines += ["### Targets", "", "| target | measured | |", "|---|---|---|"]
    lines += [f"| {what} | {value} | {status} |" for what, value, status in targets]
    lines += ["", *(f"<!-- target: {what} | {value} | {status} -->" for what, value, status in targets), ""]
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give 1 or more")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("check", help="install, bench, test, report (what `make gpu-check` runs)")
    run.add_argument("--bundle", type=Path, default=ROOT / "gpu-bundle")
    run.add_argument("--venv", type=Path, default=ROOT / ".gpu-venv")
    run.add_argument("--host", default=sys.executable, help="the Python that has torch and Lightning")
    run.add_argument("--python", help="run in this existing environment instead (no venv, no install)")
    run.add_argument(
        "--results", default=str(ROOT / "benchmarks" / "results" / "gpu_check.md"), help="- prints"
    )
    run.add_argument("--stages", default="install,bench,tests", help="a subset, comma-separated")
    run.add_argument("--minutes", type=float, default=8.75, help="the whole check's budget")
    for sub in (run, measure := commands.add_parser("bench", help="the measurements alone (in the venv)")):
        sub.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
        sub.add_argument("--quick", action="store_true", help="smaller model, one round, fewer starts")
        sub.add_argument(
            "--rounds", type=_positive, help="rounds of pool against torchrun (default: 3, --quick 1)"
        )
        sub.add_argument(
            "--steps", type=_positive, help="timed steps per side and round (default: the model size's)"
        )
        sub.add_argument("--no-starts", action="store_true", help="measure no cold or warm start")
    measure.add_argument("--json", required=True, help="where the measurements go")
    args = parser.parse_args(argv)
    return check(args) if args.command == "check" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
