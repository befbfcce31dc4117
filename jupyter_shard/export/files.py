"""``%dist_export``'s files: the rendered script, its data files and the sbatch file, written safely.

Every file is written atomically (a crash leaves the old file or the new one, never half of one) with
the permissions a plain ``open()`` would give it; an existing file is replaced only with ``force``,
and a forced export removes the data files of the export it replaced that are not used any more.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TextIO

from jupyter_shard._util.atomic import write_atomic
from jupyter_shard.export.render import plural, render_message, render_sbatch, render_script
from jupyter_shard.pool.transcript import Transcript
from jupyter_shard.spec import LaunchSpec, SpecError

__all__ = ["export"]


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
            f"nothing to export: all {plural(rendered.failed, 'cell')} since the pool started failed; "
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
    return render_message(rendered, spec, script, data_dir, sbatch)


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


def _remove_stale(data_dir: Path, written: set[str]) -> None:
    """After a ``--force`` export, the data files of the export it replaced that are not used now."""
    if not data_dir.is_dir():
        return
    for old in data_dir.glob("*.pkl"):
        if old.name not in written:
            old.unlink()
    if not any(data_dir.iterdir()):
        data_dir.rmdir()
