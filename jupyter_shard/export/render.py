"""``%dist_export``: the cells a pool ran, written out as a torchrun script (and an sbatch file).

The script replays the pool's :class:`~jupyter_shard.kernel.transcript.Transcript` in order: ``shard =
start(...)`` with the pool's strategy options (see :mod:`jupyter_shard.rank.script`), then each cell that
succeeded, verbatim (cells with IPython syntax go through IPython's own transform and a shell), and
each pushed value where it was pushed: a literal when its ``repr`` reads back equal, otherwise the
cloudpickle bytes the ranks received, in the script or, over :data:`SIDECAR_OVER`, in a file in
``<script>.data/``. Cells run on some ranks only are wrapped in ``if shard.rank ...``. A cell's last
expression stays a plain statement: evaluated, not shown. Files are written atomically and an
existing file is replaced only with ``--force``.
"""

from __future__ import annotations

import argparse
import ast
import base64
import io
import json
import os
import pprint
import shlex
import sys
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from jupyter_shard._atomic import write_atomic
from jupyter_shard.kernel.transcript import CellEntry, PushEntry, Transcript
from jupyter_shard.spec import Device, LaunchSpec, SpecError, format_ranks

if TYPE_CHECKING:
    from jupyter_shard.kernel.pool import Pool

__all__ = ["Rendered", "export", "export_magic", "render_sbatch", "render_script"]

SIDECAR_OVER = 1 << 20  # pickled bytes above which a pushed value goes to a file beside the script
LITERAL_LIMIT = 64 * 1024  # characters above which a value is pickled even if it reads back as a literal
_CHUNK = 96  # base64 characters per script line
_INDENT = "    "
_WRAP = " \\\n        "  # a shell line continuation in the script's header


class _Parser(argparse.ArgumentParser):
    """argparse that raises one :class:`SpecError` line instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise SpecError(f"%dist_export: {message}; usage: {self.usage}")


def _parse(line: str) -> argparse.Namespace:
    usage = "%dist_export train.py [--sbatch job.sbatch] [--force]"
    parser = _Parser(prog="dist_export", usage=usage, add_help=False, exit_on_error=False)
    parser.add_argument("script")
    parser.add_argument("--sbatch")
    parser.add_argument("--force", action="store_true")
    try:
        opts, extra = parser.parse_known_args(shlex.split(line))
    except SpecError:
        raise
    except (ValueError, argparse.ArgumentError) as exc:
        raise SpecError(f"%dist_export: {exc}; usage: {usage}") from None
    if extra:
        raise SpecError(f"%dist_export: unknown option {extra[0]!r}; usage: {usage}")
    return opts


def export_magic(line: str, pool: Pool) -> str:
    """``%dist_export train.py [--sbatch job.sbatch] [--force]``: what was written and how to run it."""
    opts = _parse(line)
    sbatch = Path(opts.sbatch) if opts.sbatch else None
    return export(pool.transcript, pool.spec, Path(opts.script), sbatch=sbatch, force=opts.force)


@dataclass
class Rendered:
    """A script's text, the files it loads (name in ``<script>.data/`` -> bytes) and what it holds."""

    text: str
    sidecars: dict[str, bytes] = field(default_factory=dict)
    cells: int = 0
    failed: int = 0
    values: int = 0
    helpers: set[str] = field(default_factory=set)  # names the script imports from jupyter_shard.rank.script


def export(
    transcript: Transcript,
    spec: LaunchSpec,
    script: Path,
    *,
    sbatch: Path | None = None,
    force: bool = False,
    source: str | None = None,
) -> str:
    """Write ``script`` (and its data files, and ``sbatch``); a paragraph saying what and how to run."""
    if not transcript.cells():
        raise SpecError("nothing to export: no %%distributed cell has run since the pool started")
    data_dir = script.with_name(script.name + ".data")
    when = datetime.now()
    rendered = render_script(
        transcript, spec, script.name, source=source or _source(), when=when, sbatch=sbatch
    )
    if not rendered.cells:
        raise SpecError(
            f"nothing to export: all {_plural(rendered.failed, 'cell')} since the pool started failed; "
            "run them again without errors first"
        )
    targets = [script] + ([sbatch] if sbatch else []) + ([data_dir] if rendered.sidecars else [])
    _check_targets(targets, force)
    for name, blob in rendered.sidecars.items():
        data_dir.mkdir(exist_ok=True)
        _write(data_dir / name, blob)
    if force:
        _remove_stale(data_dir, set(rendered.sidecars))
    _write(script, rendered.text)
    if sbatch is not None:
        job = render_sbatch(spec, os.path.relpath(script, sbatch.parent), when=when, name=sbatch.name)
        _write(sbatch, job)
    return _message(rendered, spec, script, data_dir, sbatch)


def _message(rendered: Rendered, spec: LaunchSpec, script: Path, data_dir: Path, sbatch: Path | None) -> str:
    counts = _plural(rendered.cells, "cell")
    if rendered.values:
        counts += f" and {_plural(rendered.values, 'pushed value')}"
    message = f"jupyter_shard: wrote {script} ({counts}, in the order they ran"
    if rendered.failed:
        message += f"; {_plural(rendered.failed, 'failed cell')} left out"
    if rendered.sidecars:
        message += f"; {_plural(len(rendered.sidecars), 'large value')} in {data_dir}"
    message += f"). Run it with `{_torchrun_line(spec, script.name)}` in {script.parent.resolve()}"
    if spec.nodes > 1:
        message += " on each node (HEAD: the first node's address)"
    if sbatch is not None:
        message += f"; wrote {sbatch}: submit it with `sbatch {sbatch.name}` from {sbatch.parent.resolve()}"
    return message + "."


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def render_script(
    transcript: Transcript,
    spec: LaunchSpec,
    script_name: str,
    *,
    source: str,
    when: datetime,
    sbatch: Path | None = None,
) -> Rendered:
    """The script for ``transcript``, as it would be saved under ``script_name``."""
    out = Rendered("")
    body: list[str] = []
    for entry in transcript.entries:
        if isinstance(entry, CellEntry):
            body.append(_cell(entry, out))
        else:
            body.append(_push(entry, script_name + ".data", out))
    shell = any(_uses_name(block, "get_ipython") for block in body) or _uses_unbound_display(body)
    out.helpers.update(["finish", "start"] + (["ipython"] if shell else []))
    registration = _registered_strategy(spec, out)
    header = _header(spec, script_name, source, when, out, sbatch)
    head = [header, "", f"from jupyter_shard.rank.script import {', '.join(sorted(out.helpers))}", ""]
    head += [*registration, _start_call(spec)]
    if shell:
        head.append("get_ipython = ipython(globals())  # cells below use IPython syntax (magics, !cmd)")
    out.text = "\n".join(head) + "\n\n" + "\n".join(body) + "\nfinish()\n"
    return out


def _header(
    spec: LaunchSpec, name: str, source: str, when: datetime, out: Rendered, sbatch: Path | None
) -> str:
    cells = _plural(out.cells, "cell")
    lines = [
        f'r"""Exported by jupyter_shard %dist_export on {when:%Y-%m-%d %H:%M}: {cells} '
        f"run on {_shape(spec)}.",
        "",
        f"Source: {_plain(source)}",
        "",
        "Run it as the notebook's pool ran (add --tee 3 to label each output line with its rank)"
        + (":" if spec.nodes == 1 else ", on each node, HEAD being the first node's address:"),
        f"    {_torchrun_line(spec, name, _WRAP)}",
    ]
    if spec.nodes == 1:
        lines += [
            "On N nodes (N times the ranks): on each node, HEAD being the first node's address,",
            f"    torchrun --nnodes N --nproc-per-node {spec.nproc} --rdzv-backend c10d{_WRAP}"
            f"--rdzv-endpoint HEAD:29500 --rdzv-id RUN {name}",
        ]
    if sbatch is not None:
        lines.append(f"Under SLURM: sbatch {sbatch.name}")
    lines += [
        "",
        "Cells run in the order they ran in the notebook; cells that failed there are left out.",
        "Values pushed with %dist_push are assigned where they were pushed. A cell's last expression",
        "(its Out[n] in the notebook) is evaluated but not shown: print it to see it. shard.log",
        "scalars go to JSON Lines files per rank (see jupyter_shard.rank.script).",
        '"""',
    ]
    return "\n".join(lines)


def _shape(spec: LaunchSpec, nodes: bool = True) -> str:
    """``2 CPU ranks (ddp)``, ``2 nodes × 4 GPU ranks (fsdp)``."""
    kind = "GPU" if spec.device is Device.CUDA else "CPU"
    ranks = _plural(spec.nproc, f"{kind} rank")
    where = f"{spec.nodes} nodes × " if nodes and spec.nodes > 1 else ""
    return f"{where}{ranks} ({spec.strategy})"


def _torchrun_line(spec: LaunchSpec, name: str, wrap: str = " ") -> str:
    if spec.nodes == 1:
        return f"torchrun --nproc-per-node {spec.nproc} {name}"
    return (
        f"torchrun --nnodes {spec.nodes} --nproc-per-node {spec.nproc} --rdzv-backend c10d{wrap}"
        f"--rdzv-endpoint HEAD:29500 --rdzv-id RUN {name}"
    )


def _start_call(spec: LaunchSpec) -> str:
    options = spec.rank_options()
    if options.get("config"):
        options["config"] = str(Path(options["config"]).resolve())
    items = "".join(f"{_INDENT * 2}{_src(k)}: {_src(v)},\n" for k, v in options.items())
    return (
        "shard = start(\n"
        f"{_INDENT}strategy={_src(spec.strategy)},\n"
        f"{_INDENT}device={_src(spec.device.value)},\n"
        f"{_INDENT}timeout={spec.timeout!r},\n"
        f"{_INDENT}options={{\n{items}{_INDENT}}},\n"
        ")"
    )


def _src(value: object) -> str:
    """Python source for an option value, strings in double quotes as ruff formats them."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _plain(text: str) -> str:
    """``text`` safe inside the header docstring."""
    return text.replace("\\", "/").replace('"', "'")


def _registered_strategy(spec: LaunchSpec, out: Rendered) -> list[str]:
    """A strategy registered in the notebook with ``register_strategy`` is registered in the script."""
    import cloudpickle

    from jupyter_shard.strategies import registered

    entry = registered(spec.strategy)
    if entry is None:
        return []
    blob = base64.b64encode(cloudpickle.dumps(entry)).decode("ascii")
    out.helpers.add("unpickle")
    return [
        "from jupyter_shard.strategies import register_strategy",
        "",
        f"# --strategy {spec.strategy} was registered in the notebook with register_strategy",
        f"_strategy, _defaults = unpickle({_chunks(blob)})",
        f"register_strategy({_src(spec.strategy)}, _strategy, **_defaults)",
        "",
    ]


def _cell(entry: CellEntry, out: Rendered) -> str:
    label = f"cell [{entry.exec_count}]" if entry.exec_count > 0 else "cell"
    if entry.status != "ok":
        out.failed += 1
        return f"# --- {label} failed in the notebook: left out ---\n"
    out.cells += 1
    code = _python(entry.code)
    if entry.ranks is not None:
        label += f" on rank {format_ranks(entry.ranks)}"
    return f"# --- {label} ---\n" + _on_ranks(entry.ranks, code)


def _python(code: str) -> str:
    """The cell as plain Python: verbatim, or through IPython's transform when it has IPython syntax."""
    from IPython.core.inputtransformer2 import TransformerManager

    code = code if code.endswith("\n") else code + "\n"
    transformed = str(TransformerManager().transform_cell(code))
    return code if transformed == code else transformed


def _push(entry: PushEntry, data_dir: str, out: Rendered) -> str:
    names = " ".join(name for name, _ in entry.values)
    where = f" to rank {format_ranks(entry.ranks)}" if entry.ranks is not None else ""
    lines = []
    for name, blob in entry.values:
        out.values += 1
        value, loaded = _load(blob)
        literal = _literal(value) if loaded and len(blob) <= 4 * LITERAL_LIMIT else None
        if literal is not None:
            lines.append(f"{name} = {literal}")
            continue
        kind = _type_name(value) if loaded else "a value this kernel cannot unpickle"
        size = f"{len(blob) / 1024:.1f} KiB" if len(blob) < SIDECAR_OVER else f"{len(blob) / 2**20:.1f} MiB"
        if len(blob) > SIDECAR_OVER:
            file = _unique(f"{name}.pkl", out.sidecars)
            out.sidecars[file] = blob
            out.helpers.add("unpickle_file")
            lines.append(f"{name} = unpickle_file(__file__, {_src(data_dir + '/' + file)})  # {kind}, {size}")
        else:
            text = base64.b64encode(blob).decode("ascii")
            out.helpers.add("unpickle")
            lines.append(f"{name} = unpickle({_chunks(text)})  # {kind}, cloudpickle {size}")
    return f"# --- %dist_push {names}{where} ---\n" + _on_ranks(entry.ranks, "\n".join(lines) + "\n")


def _load(blob: bytes) -> tuple[Any, bool]:
    import cloudpickle

    try:
        return cloudpickle.loads(blob), True
    except Exception:
        return None, False


def _literal(value: Any) -> str | None:
    """``value`` as Python source if it reads back equal and of the same type, else None."""
    try:
        text = pprint.pformat(value, width=100, sort_dicts=False)
        if len(text) > LITERAL_LIMIT:
            return None
        back = ast.literal_eval(text)
        same = type(back) is type(value) and bool(back == value)
    except Exception:
        return None
    return text if same else None


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _chunks(text: str) -> str:
    if len(text) <= _CHUNK:
        return repr(text)
    parts = [f'{_INDENT}"{text[i : i + _CHUNK]}"' for i in range(0, len(text), _CHUNK)]
    return "\n" + "\n".join(parts) + "\n"


def _unique(name: str, taken: dict[str, bytes]) -> str:
    stem, n, candidate = name.removesuffix(".pkl"), 1, name
    while candidate in taken:
        n += 1
        candidate = f"{stem}-{n}.pkl"
    return candidate


def _on_ranks(ranks: tuple[int, ...] | None, code: str) -> str:
    """``code`` as is, or inside ``if shard.rank ...:`` (lines inside multi-line strings kept as they are)."""
    if ranks is None:
        return code
    test = f"== {ranks[0]}" if len(ranks) == 1 else f"in {ranks!r}"
    try:
        empty = not ast.parse(code).body
    except SyntaxError:
        empty = False
    if empty:
        code += "pass\n"
    keep = _string_lines(code)
    lines = code.splitlines(keepends=True)
    body = [
        line if i in keep or not line.strip() else _INDENT + line for i, line in enumerate(lines, start=1)
    ]
    return f"if shard.rank {test}:\n" + "".join(body)


def _string_lines(code: str) -> set[int]:
    """Line numbers that continue a token begun on an earlier line (the inside of a multi-line string)."""
    rows: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.end[0] > token.start[0]:
                rows.update(range(token.start[0] + 1, token.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        pass
    return rows


def _uses_name(code: str, name: str) -> bool:
    try:
        return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(ast.parse(code)))
    except SyntaxError:
        return name in code


def _uses_unbound_display(blocks: Sequence[str]) -> bool:
    """``display(...)`` with no import or definition of ``display``: IPython's builtin, on the ranks."""
    used, bound = False, False
    for block in blocks:
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "display":
                used |= isinstance(node.ctx, ast.Load)
                bound |= isinstance(node.ctx, ast.Store)
            elif isinstance(node, ast.alias):
                bound |= (node.asname or node.name) == "display"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound |= node.name == "display"
    return used and not bound


def render_sbatch(spec: LaunchSpec, script: str, *, when: datetime, name: str = "job.sbatch") -> str:
    """An sbatch file running ``script`` (a path relative to the submission directory) under torchrun."""
    job = Path(script).stem
    torchrun = Path(sys.executable).with_name("torchrun")
    lines = [
        "#!/bin/bash",
        f"# Written by jupyter_shard %dist_export on {when:%Y-%m-%d %H:%M}: {script} on "
        f"{_plural(spec.nodes, 'node')} × {_shape(spec, nodes=False)}.",
        f"# Submit it from the directory it is in: sbatch {name}",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={spec.nproc}",
    ]
    if spec.device is Device.CUDA:
        lines.append(f"#SBATCH --gpus-per-node={spec.nproc}")
    for option, attr in (("partition", "partition"), ("time", "time_limit"), ("account", "account")):
        value = getattr(spec, attr, None)
        if value:
            lines.append(f"#SBATCH --{option}={value}")
    lines += [
        f"#SBATCH --output={job}-%j.out",
        "set -eu",
        "export PYTHONUNBUFFERED=1  # rank output reaches the log as it is printed",
        "",
        "# torchrun of the environment the notebook ran in (it has torch and jupyter_shard)",
        f'TORCHRUN="${{TORCHRUN:-{torchrun if torchrun.exists() else "torchrun"}}}"',
        'mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'head="${hosts[0]}"',
        "port=$((20000 + SLURM_JOB_ID % 20000))",
        "",
        f"# one torchrun per node starts its {spec.nproc} ranks; --tee 3 labels each line with its rank",
        f'srun "$TORCHRUN" --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node {spec.nproc} \\',
        f'{_INDENT}--rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" \\',
        f"{_INDENT}--tee 3 {shlex.quote(script)}",
    ]
    return "\n".join(lines) + "\n"


def _source() -> str:
    notebook = os.environ.get("JPY_SESSION_NAME")
    return notebook if notebook else f"a session in {os.getcwd()}"


def _check_targets(targets: Sequence[Path], force: bool) -> None:
    if len({t.resolve() for t in targets}) < len(targets):
        raise SpecError("%dist_export: the script and the --sbatch file need different names")
    for target in targets:
        if not target.parent.is_dir():
            raise SpecError(f"%dist_export: directory {target.parent} does not exist; create it first")
        if target.exists() and not force:
            raise SpecError(
                f"%dist_export: {target} exists; add --force to overwrite it, or give another file name"
            )


def _write(path: Path, content: str | bytes) -> None:
    def write_bytes(fh: TextIO) -> None:
        assert isinstance(content, bytes)
        fh.buffer.write(content)

    write_atomic(path, write_bytes if isinstance(content, bytes) else content)
    os.chmod(path, 0o666 & ~_umask())  # as a plain open() would have made it, not the temp file's 0600


def _umask() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _remove_stale(data_dir: Path, written: set[str]) -> None:
    """After a ``--force`` export, the data files of the export it replaced that are not used now."""
    if not data_dir.is_dir():
        return
    for old in data_dir.glob("*.pkl"):
        if old.name not in written:
            old.unlink()
    if not any(data_dir.iterdir()):
        data_dir.rmdir()
