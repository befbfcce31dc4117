"""``%dist_export``'s text: the cells a pool ran, rendered as a torchrun script (and an sbatch file).

Pure: strings from a transcript and a spec; :mod:`~jupyter_shard.export.files` writes them. The
script replays the pool's :class:`~jupyter_shard.pool.transcript.Transcript` in order: ``shard =
start(...)`` with the pool's strategy options (see :mod:`jupyter_shard.rank.script`), then each cell
that succeeded, verbatim (cells with IPython syntax go through IPython's own transform and a shell),
and each pushed value where it was pushed: a literal when its ``repr`` reads back equal, otherwise
the cloudpickle bytes the ranks received, in the script or, over :data:`SIDECAR_OVER`, in a file in
``<script>.data/``. Cells run on some ranks only are wrapped in ``if shard.rank ...``. A cell's last
expression stays a plain statement: evaluated, not shown. The torchrun and srun lines are the
launchers' own (:mod:`jupyter_shard.launchers.commands`).
"""

from __future__ import annotations

import base64
import shlex
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from jupyter_shard.export.source import (
    INDENT,
    LITERAL_LIMIT,
    chunks,
    literal,
    load,
    on_ranks,
    python_source,
    src,
    type_name,
    unique_name,
    uses_name,
    uses_unbound_display,
)
from jupyter_shard.launchers.commands import multi_node_torchrun_line, rendezvous_args, torchrun_line
from jupyter_shard.launchers.slurm import slurm_resources
from jupyter_shard.pool.transcript import CellEntry, PushEntry, Transcript
from jupyter_shard.spec import Device, LaunchSpec, format_ranks
from jupyter_shard.strategies import registered

__all__ = ["Rendered", "plural", "render_message", "render_sbatch", "render_script"]

SIDECAR_OVER = 1 << 20  # pickled bytes above which a pushed value goes to a file beside the script
_WRAP = " \\\n        "  # a shell line continuation in the script's header
_PLACES = "NODE being its index (0 on the first node) and HEAD the first node's address"


def _in_single_quotes(text: str) -> str:
    """``text`` as it is written inside a single-quoted shell string."""
    return text.replace("'", "'\\''")


@dataclass
class Rendered:
    """A script's text, the files it loads (name in ``<script>.data/`` -> bytes) and what it holds."""

    text: str
    sidecars: dict[str, bytes] = field(default_factory=dict)
    cells: int = 0
    failed: int = 0
    values: int = 0
    helpers: set[str] = field(default_factory=set)  # names the script imports from jupyter_shard.rank.script


def render_message(
    rendered: Rendered, spec: LaunchSpec, script: Path, data_dir: Path, sbatch: Path | None
) -> str:
    """What ``%dist_export`` says it wrote, and how to run it."""
    counts = plural(rendered.cells, "cell")
    if rendered.values:
        counts += f" and {plural(rendered.values, 'pushed value')}"
    message = f"jupyter_shard: wrote {script} ({counts}, in the order they ran"
    if rendered.failed:
        message += f"; {plural(rendered.failed, 'failed cell')} left out"
    if rendered.sidecars:
        message += f"; {plural(len(rendered.sidecars), 'large value')} in {data_dir}"
    message += f"). Run it with `{torchrun_line(spec, script.name)}` in {script.parent.resolve()}"
    if spec.nodes > 1:
        message += " on each node (NODE: the node's index, 0 on the first; HEAD: the first node's address)"
    if sbatch is not None:
        message += f"; wrote {sbatch}: submit it with `sbatch {sbatch.name}` from {sbatch.parent.resolve()}"
    return message + "."


def plural(count: int, noun: str) -> str:
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
    shell = any(uses_name(block, "get_ipython") for block in body) or uses_unbound_display(body)
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
    cells = plural(out.cells, "cell")
    lines = [
        f'r"""Exported by jupyter_shard %dist_export on {when:%Y-%m-%d %H:%M}: {cells} '
        f"run on {_shape(spec)}.",
        "",
        f"Source: {_plain(source)}",
        "",
        "Run it as the notebook's pool ran (add --tee 3 to label each output line with its rank)"
        + (":" if spec.nodes == 1 else f", on each node, {_PLACES}:"),
        f"    {torchrun_line(spec, name, _WRAP)}",
    ]
    if spec.nodes == 1:
        lines += [
            f"On N nodes (N times the ranks): on each node, {_PLACES},",
            f"    {multi_node_torchrun_line('N', spec.nproc, name, _WRAP)}",
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
    ranks = plural(spec.nproc, f"{kind} rank")
    where = f"{spec.nodes} nodes × " if nodes and spec.nodes > 1 else ""
    return f"{where}{ranks} ({spec.strategy})"


def _start_call(spec: LaunchSpec) -> str:
    options = spec.rank_options()
    if options.get("config"):
        options["config"] = str(Path(options["config"]).resolve())
    items = "".join(f"{INDENT * 2}{src(k)}: {src(v)},\n" for k, v in options.items())
    return (
        "shard = start(\n"
        f"{INDENT}strategy={src(spec.strategy)},\n"
        f"{INDENT}device={src(spec.device.value)},\n"
        f"{INDENT}timeout={spec.timeout!r},\n"
        f"{INDENT}options={{\n{items}{INDENT}}},\n"
        ")"
    )


def _plain(text: str) -> str:
    """``text`` safe inside the header docstring."""
    return text.replace("\\", "/").replace('"', "'")


def _registered_strategy(spec: LaunchSpec, out: Rendered) -> list[str]:
    """A strategy registered in the notebook with ``register_strategy`` is registered in the script."""
    import cloudpickle

    entry = registered(spec.strategy)
    if entry is None:
        return []
    blob = base64.b64encode(cloudpickle.dumps(entry)).decode("ascii")
    out.helpers.add("unpickle")
    return [
        "from jupyter_shard.strategies import register_strategy",
        "",
        f"# --strategy {spec.strategy} was registered in the notebook with register_strategy",
        f"_strategy, _defaults = unpickle({chunks(blob)})",
        f"register_strategy({src(spec.strategy)}, _strategy, **_defaults)",
        "",
    ]


def _cell(entry: CellEntry, out: Rendered) -> str:
    label = f"cell [{entry.exec_count}]" if entry.exec_count > 0 else "cell"
    if entry.status != "ok":
        out.failed += 1
        return f"# --- {label} failed in the notebook: left out ---\n"
    out.cells += 1
    code = python_source(entry.code)
    if entry.ranks is not None:
        label += f" on rank {format_ranks(entry.ranks)}"
    return f"# --- {label} ---\n" + on_ranks(entry.ranks, code)


def _push(entry: PushEntry, data_dir: str, out: Rendered) -> str:
    names = " ".join(name for name, _ in entry.values)
    where = f" to rank {format_ranks(entry.ranks)}" if entry.ranks is not None else ""
    lines = []
    for name, blob in entry.pickled():
        out.values += 1
        value, loaded = load(blob)
        text = literal(value) if loaded and len(blob) <= 4 * LITERAL_LIMIT else None
        if text is not None:
            lines.append(f"{name} = {text}")
            continue
        kind = type_name(value) if loaded else "a value this kernel cannot unpickle"
        size = f"{len(blob) / 1024:.1f} KiB" if len(blob) < SIDECAR_OVER else f"{len(blob) / 2**20:.1f} MiB"
        if len(blob) > SIDECAR_OVER:
            file = unique_name(f"{name}.pkl", out.sidecars)
            out.sidecars[file] = blob
            out.helpers.add("unpickle_file")
            lines.append(f"{name} = unpickle_file(__file__, {src(data_dir + '/' + file)})  # {kind}, {size}")
        else:
            encoded = base64.b64encode(blob).decode("ascii")
            out.helpers.add("unpickle")
            lines.append(f"{name} = unpickle({chunks(encoded)})  # {kind}, cloudpickle {size}")
    return f"# --- %dist_push {names}{where} ---\n" + on_ranks(entry.ranks, "\n".join(lines) + "\n")


def render_sbatch(spec: LaunchSpec, script: str, *, when: datetime, name: str = "job.sbatch") -> str:
    """An sbatch file running ``script`` (a path relative to the submission directory) under torchrun."""
    job = Path(script).stem
    torchrun = Path(sys.executable).with_name("torchrun")
    # Each task learns its node's index from SLURM, so the torchrun line is expanded by the task's
    # shell (single quotes), not by this script's (which runs on the first node only).
    rendezvous = rendezvous_args(
        '"$SLURM_JOB_NUM_NODES"', spec.nproc, '"$SLURM_NODEID"', '"$head"', '"$port"', '"$SLURM_JOB_ID"'
    )
    lines = [
        "#!/bin/bash",
        f"# Written by jupyter_shard %dist_export on {when:%Y-%m-%d %H:%M}: {script} on "
        f"{plural(spec.nodes, 'node')} × {_shape(spec, nodes=False)}.",
        f"# Submit it from the directory it is in: sbatch {name}",
        f"#SBATCH --job-name={job}",
        *(f"#SBATCH {option}" for option in slurm_resources(spec)),
        f"#SBATCH --output={job}-%j.out",
        "set -eu",
        "export PYTHONUNBUFFERED=1  # rank output reaches the log as it is printed",
        "",
        "# torchrun of the environment the notebook ran in (it has torch and jupyter_shard)",
        f'TORCHRUN="${{TORCHRUN:-{torchrun if torchrun.exists() else "torchrun"}}}"',
        'mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'export TORCHRUN head="${hosts[0]}" port=$((20000 + SLURM_JOB_ID % 20000))',
        "",
        f"# one torchrun per node starts its {spec.nproc} ranks; node 0 ($head) hosts the rendezvous store",
        "# (torch's static rendezvous: nothing pickled); --tee 3 labels each line with its rank",
        f'srun bash -c \'exec "$TORCHRUN" {" ".join(rendezvous[:6])} \\',
        f"{INDENT}{' '.join(rendezvous[6:])} \\",
        f"{INDENT}--tee 3 {_in_single_quotes(shlex.quote(script))}'",
    ]
    return "\n".join(lines) + "\n"
