"""What ``%dist_picker MODEL --batch EXPR`` shows: the dry run's per-rank table, the recommendation and
its ``%%distributed`` line, as a widget and as plain text.

Why it exists: the numbers of :mod:`jupyter_shard.notebook.picker_dry_run` are only useful with their
provenance (traced, or a formula with its measured accuracy) and with the line that runs the plan; the
line inserts as a ``%%distributed`` cell exactly as the formula form's does (the JupyterLab extension
listens for the ``insert-cell`` message). ``report`` is the same content as text, for logs and tests;
with ``--confirm`` both show each rank's measured peak on the live pool next to the predicted one.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from jupyter_shard._util.atomic import write_atomic
from jupyter_shard.notebook.picker_confirm import Confirmation
from jupyter_shard.notebook.picker_dry_run import Outcome, Verdict
from jupyter_shard.planner import estimate as est
from jupyter_shard.planner.choice import (
    DEFAULT_CONFIG,
    copy_button,
    distributed_line,
    insert_line,
    strategy_config,
    use_line_as_default,
)
from jupyter_shard.spec import Precision

__all__ = ["DryRunPicker", "report"]

COLUMNS = ("parameters", "gradients", "optimizer", "activations", "transient")
NVME_PATH = "/local_nvme"


def _fb(size: int | None) -> str:
    return "–" if size is None else est.format_bytes(size)


def _fit(v: Verdict) -> str:
    return "?" if v.fits is None else ("yes" if v.fits else f"no, {est.format_bytes(v.over)} over")


def _unit(v: Verdict) -> str:
    unit = v.plan.largest_unit
    return "–" if unit is None else f"{unit[0]} ({est.format_bytes(unit[1])})"


def _sources(out: Outcome) -> list[str]:
    """Each distinct source line once, numbered in the order the plans use them."""
    seen: list[str] = []
    for v in out.verdicts:
        for key in (*COLUMNS, "peak_bytes", "host_bytes", "step", "precision", "device"):
            text = v.plan.source.get(key)
            if text and text not in seen:
                seen.append(text)
    return seen


def _reserved(out: Outcome) -> bool:
    """Whether the plans are CUDA's, whose allocator reserves more than the peak of live tensors."""
    return any(v.plan.reserved_bytes for v in out.verdicts)


def _fix_lines(v: Verdict) -> list[str]:
    lines = []
    for fix in v.fixes:
        peak = "" if fix.peak is None else f" → peak {est.format_bytes(fix.peak)}"
        peak += "" if fix.traced or fix.peak is None else " (trace less the saving)"
        lines.append(f"{fix.what}{peak}")
    return lines


def _heading(out: Outcome) -> str:
    a = out.args
    where = f"{a.world_size} {'GPUs' if a.device.value == 'cuda' else 'CPU ranks'}"
    mixed = "" if a.precision == Precision.FP32.value else f", {a.precision}"
    return f"Dry run of {a.model} on batch {out.batch.expression()}, {where}{mixed}"


def report(out: Outcome, line: str, confirmation: Confirmation | None = None) -> str:
    """The picker's content as plain text: the table, what would make faster plans fit, the
    recommendation, ``--confirm``'s real steps, the line, and where each figure comes from."""
    cuda = _reserved(out)
    head = ["strategy", *COLUMNS, "peak", *(["reserved"] if cuda else []), "host", "largest unit", "fits"]
    rows = [head]
    for v in out.verdicts:
        p = v.plan
        sizes = [_fb(getattr(p, c)) for c in COLUMNS]
        peaks = [_fb(p.peak_bytes), *([_fb(p.reserved_bytes)] if cuda else [])]
        rows.append([v.name, *sizes, *peaks, _fb(p.host_bytes), _unit(v), _fit(v)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [_heading(out) + ", per rank:"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    free = f"Free per rank: {_fb(out.free)} from {out.free_source}." if out.free is not None else ""
    lines += [free] if free else []
    for v in out.verdicts:
        for text in _fix_lines(v):
            lines.append(f"  to fit {v.name}: {text}")
    lines.append(f"Recommended: {out.reason}")
    lines += [f"Note: {n}" for n in out.notes]
    if out.largest_batch is not None:
        lines.append(_largest_text(out.largest_batch))
    lines += confirmation.lines() if confirmation is not None else []
    lines += [f"Line: {line}"] if line else []
    lines.append("Sources:")
    lines += [f"  [{i}] {s}" for i, s in enumerate(_sources(out), start=1)]
    return "\n".join(lines)


def _largest_text(found: tuple[str, int, int | None]) -> str:
    name, size, peak = found
    if not size:
        return f"Largest batch with {name}: none fits, not even a batch of 1."
    how = "the dry run measured it and the size above it"
    return f"Largest batch with {name}: {size} (peak {_fb(peak)} per rank; {how})."


class DryRunPicker(widgets.VBox):  # type: ignore[misc]
    """The dry run's table and recommendation, with the recommended line to copy, insert or use as
    the default. ``line``, ``config``, ``config_file`` and ``report`` are set once."""

    def __init__(
        self, outcome: Outcome, set_default: Callable[[str], None], confirmation: Confirmation | None = None
    ) -> None:
        self.outcome = outcome
        self.confirmation = confirmation  # --confirm: the found batch's real steps on the live pool
        self._set_default = set_default
        args = outcome.args
        chosen = next((v for v in outcome.verdicts if v.name == outcome.recommended), None)
        self.config: dict[str, Any] | None = None
        self.config_file = ""
        self.line = ""
        if chosen is not None:
            from jupyter_shard.notebook.picker_dry_run import LINE_PLANS

            plan = LINE_PLANS[chosen.name]
            self.config = strategy_config(plan, (), NVME_PATH)
            self.config_file = f"{DEFAULT_CONFIG.get(plan.strategy, 'options')}.json" if self.config else ""
            config = self.config_file or None
            # the line runs the precision the dry run traced (the model's own dtype, or bf16-mixed)
            precision = Precision(args.precision)
            self.line = distributed_line(plan, args.device, args.world_size, precision, config)
        self.report = report(outcome, self.line, confirmation)
        self.done = widgets.HTML()
        self.buttons = {
            "insert": widgets.Button(description="Insert as new cell", icon="plus", disabled=not self.line),
            "default": widgets.Button(description="Use as default", icon="check", disabled=not self.line),
        }
        self.buttons["insert"].on_click(lambda _: self.insert_cell())
        self.buttons["default"].on_click(lambda _: self.use_as_default())
        body = widgets.HTML(_html(outcome, self.line, self.config, self.config_file, confirmation))
        row = [widgets.HTML(copy_button(self.line, "Copy line"))] if self.line else []
        super().__init__(children=[body, widgets.HBox([*row, *self.buttons.values()]), self.done])

    def __repr__(self) -> str:
        return self.report

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any] | None:
        """The widget, with the whole report as its text/plain: where the widget cannot render
        (nbconvert, GitHub's viewer, a frontend without ipywidgets) the table is what is read, and
        ipywidgets cuts a text/plain to its first 110 characters."""
        bundle: dict[str, Any] | None = super()._repr_mimebundle_(**kwargs)
        if bundle is not None:
            bundle["text/plain"] = self.report
        return bundle

    def write_config(self) -> Path | None:
        """Write the plan's config JSON (FSDP's sharding) into the current directory, which the line
        names with ``--config``; None when the line needs none or it could not be written."""
        if self.config is None:
            return None
        path = Path.cwd() / self.config_file
        try:
            write_atomic(path, json.dumps(self.config, indent=2) + "\n")
        except OSError as exc:
            self._done(f"Could not write {path}: {exc}")
            return None
        return path

    def insert_cell(self) -> None:
        """Write the config the line names, then ask the JupyterLab extension to insert the line."""
        if not self.line or (self.config is not None and self.write_config() is None):
            return
        insert_line(self.send, self.line, self._done)

    def use_as_default(self) -> None:
        if not self.line or (self.config is not None and self.write_config() is None):
            return
        use_line_as_default(self._set_default, self.line, self._done)

    def _done(self, message: str) -> None:
        self.done.value = f"<i>{html.escape(message)}</i>"


def _html(
    out: Outcome,
    line: str,
    config: dict[str, Any] | None,
    config_file: str,
    confirmation: Confirmation | None = None,
) -> str:
    esc = html.escape
    sources = _sources(out)
    cuda = _reserved(out)
    reserved = ["reserved (CUDA's allocator)"] if cuda else []
    head = ["", "strategy", *COLUMNS, "peak (device)", *reserved, "host", "largest unit gathered", "fits"]
    rows = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for v in out.verdicts:
        p = v.plan

        def cell(key: str, size: int, plan: Any = p) -> str:
            text = plan.source.get(key, "")
            mark = f"<sup>{sources.index(text) + 1}</sup>" if text in sources else ""
            return f"<td title='{esc(text, quote=True)}'>{esc(_fb(size))}{mark}</td>"

        cells = [f"<td>{'★' if v.name == out.recommended else ''}</td>", f"<td>{esc(v.name)}</td>"]
        cells += [cell(c, getattr(p, c)) for c in COLUMNS]
        cells += [cell("peak_bytes", p.peak_bytes), *([cell("device", p.reserved_bytes)] if cuda else [])]
        cells += [cell("host_bytes", p.host_bytes)]
        cells += [f"<td>{esc(_unit(v))}</td>", f"<td>{esc(_fit(v))}</td>"]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    parts = [
        f"<b>{esc(_heading(out))}</b>",
        f"<table><caption>Per rank, at the peak of a training step</caption>{''.join(rows)}</table>",
    ]
    if out.free is not None:
        parts.append(f"Free per rank: {esc(_fb(out.free))} from {esc(out.free_source)}.")
    fixes = [f"<li><b>{esc(v.name)}</b>: {esc(t)}</li>" for v in out.verdicts for t in _fix_lines(v)]
    if fixes:
        parts.append(f"What would make the faster plans fit:<ul>{''.join(fixes)}</ul>")
    parts.append(f"<b>Recommended:</b> {esc(out.reason)}")
    parts += [f"<i>{esc(n)}</i>" for n in out.notes]
    if out.largest_batch is not None:
        parts.append(esc(_largest_text(out.largest_batch)))
    if confirmation is not None:
        title, *steps = confirmation.lines()
        parts.append(f"{esc(title)}<pre>{esc(chr(10).join(steps))}</pre>")
    if line:
        parts.append(f"<code>{esc(line)}</code>")
    if config is not None:
        parts.append(
            f"{esc(config_file)} (written on insert): <pre>{esc(json.dumps(config, indent=2))}</pre>"
        )
    items = "".join(f"<li>{esc(s)}</li>" for s in sources)
    parts.append(f"<details><summary>Where each figure comes from</summary><ol>{items}</ol></details>")
    return "<br>".join(parts)
