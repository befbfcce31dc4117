"""``%dist_picker``: a form that picks a strategy for the model's size and writes its ``%%distributed`` line.

Why it exists: whether DDP, a ZeRO stage, an FSDP sharding mode or offload is right depends on how
the model's training state compares with free memory, and the options that select each one are spread
over the line and a ``--config`` JSON. The form shows every strategy's per-rank memory
(:mod:`jupyter_shard.planner.estimate`), recommends the fastest that fits, explains combinations that do
not work, and produces the line (copy, insert as a cell, use as default) and the config file. A plan
that fits only when the model is built under ``shard.init_module()`` says so, in the table and in
the recommendation (:mod:`jupyter_shard.planner.sharded_init`); on GPUs older than Ampere the form
chooses 16-mixed rather than bf16. Formulas leave activations out, so the form also takes a batch and
runs the dry run of :mod:`jupyter_shard.notebook.picker_dry_run` on the model it was opened on, at the
form's ranks and device, showing that picker's table below the form.
"""

from __future__ import annotations

import html
import importlib.util
import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
from IPython.display import clear_output, display

from jupyter_shard._util.atomic import write_atomic
from jupyter_shard.notebook.picker_chart import memory_figure
from jupyter_shard.notebook.picker_confirm import confirm_line
from jupyter_shard.notebook.picker_dry_run import GPUS, PRECISIONS, parse_line, plan_line, wants_dry_run
from jupyter_shard.notebook.picker_dry_run_view import DryRunPicker
from jupyter_shard.planner import estimate as est
from jupyter_shard.planner.choice import (
    DEFAULT_CONFIG,
    FILE_NAME,
    Choice,
    ModelInfo,
    bf16_problem,
    check_fields,
    copy_button,
    distributed_line,
    insert_line,
    model_info,
    strategy_config,
    use_line_as_default,
)
from jupyter_shard.planner.free_memory import Capability, FreeMemory, MemorySnapshot, probe_memory
from jupyter_shard.planner.sharded_init import init_note
from jupyter_shard.spec import Device, Offload, Precision, SpecError, visible_gpus

if TYPE_CHECKING:
    from jupyter_shard.pool.pool import Pool

__all__ = ["DryRunPicker", "Picker", "picker"]

PLAN_FIELDS = ("strategy", "zero_stage", "sharding", "offload")
PLOTLY_MIME = "application/vnd.plotly.v1+json"
DEFAULT_NVME = "/local_nvme"


def picker(
    arg: str,
    namespace: Mapping[str, Any],
    pool: Pool | None,
    set_default: Callable[[str], None],
    cell: str | None = None,
) -> Picker | DryRunPicker:
    """The form for ``%dist_picker ARG``; a bad ``ARG`` is one :class:`SpecError` line.

    A line with options (``MODEL --batch EXPR ...``) dry-runs the user's model and batch instead of
    counting bytes by formula (:mod:`jupyter_shard.notebook.picker_dry_run`); so does a ``cell``
    (``%%dist_picker --batch EXPR``), whose code builds the model."""
    if cell is not None or wants_dry_run(arg):
        deepspeed = importlib.util.find_spec("deepspeed") is not None
        if parse_line(arg, pool, cell=cell).confirm:
            outcome, confirmation = confirm_line(arg, namespace, pool, cell=cell, deepspeed=deepspeed)
            return DryRunPicker(outcome, set_default, confirmation)
        return DryRunPicker(plan_line(arg, namespace, pool, cell=cell, deepspeed=deepspeed), set_default)
    return Picker(
        model_info(arg, namespace), set_default, pool=pool, model_expr=arg.strip(), namespace=namespace
    )


class Picker(widgets.VBox):  # type: ignore[misc]
    """The form. ``line``, ``recommendation``, ``estimates`` and ``current`` follow every field."""

    def __init__(
        self,
        model: ModelInfo,
        set_default: Callable[[str], None],
        *,
        pool: Pool | None = None,
        memory: MemorySnapshot | None = None,
        gpu_count: int | None = None,
        deepspeed: bool | None = None,
        model_expr: str = "",
        namespace: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.model_expr = model_expr
        self.namespace: Mapping[str, Any] = namespace if namespace is not None else {}
        self.pool = pool
        self.dry_run: DryRunPicker | None = None  # the last dry run the form ran
        self.memory = memory if memory is not None else probe_memory(pool)
        self.gpu_count = visible_gpus() if gpu_count is None else gpu_count
        self.deepspeed = importlib.util.find_spec("deepspeed") is not None if deepspeed is None else deepspeed
        self._set_default = set_default
        self._written: tuple[str, str] | None = None
        self._holding = self._applying = False
        self._following = True
        self.line = ""
        self.recommendation = ""
        self.advice: est.Recommendation | None = None
        self.estimates: list[est.Estimate] = []
        self.current: est.Estimate | None = None
        self.config: dict[str, Any] | None = None
        self.chart: dict[str, Any] | None = None  # the memory chart's Plotly figure, beside the table
        self.config_file = ""
        self.notes: list[str] = []
        self.devices = (pool.spec.gpus or ()) if pool is not None else ()  # a running pool's --gpus 0,2
        super().__init__(children=self._build(pool))
        self._update()

    # -- building ------------------------------------------------------------------------------

    def _build(self, pool: Pool | None) -> list[Any]:
        spec = pool.spec if pool is not None else None
        device = spec.device.value if spec is not None else "auto"
        nproc = spec.nproc if spec is not None else (self.gpu_count or 2)
        gpu = device == "cuda" or (device == "auto" and self.gpu_count > 0)
        precision = Precision.BF16_MIXED if gpu else Precision.FP32  # CPU: fp32, unless chosen
        if gpu and bf16_problem(self._capabilities(nproc)):
            precision = Precision.FP16_MIXED
        count = est.format_count(self.model.parameters) if self.model.parameters else ""
        style, text = {"description_width": "9em"}, widgets.Text
        self.fields: dict[str, Any] = {
            "count": text(value=count, description="Parameters", placeholder="124M, 1.3B, 7e9", style=style),
            "strategy": widgets.Dropdown(
                options=[("DDP", "ddp"), ("FSDP", "fsdp"), ("DeepSpeed", "deepspeed")],
                description="Strategy",
                style=style,
            ),
            "nproc": widgets.BoundedIntText(
                value=nproc, min=1, max=est.MAX_RANKS, description="Ranks / GPUs", style=style
            ),
            "device": widgets.Dropdown(
                options=["auto", "cpu", "cuda"], value=device, description="Device", style=style
            ),
            "precision": widgets.Dropdown(
                options=[p.value for p in (Precision.BF16_MIXED, Precision.FP16_MIXED, Precision.FP32)],
                value=precision.value,
                description="Precision",
                style=style,
            ),
            "zero_stage": widgets.Dropdown(options=[0, 1, 2, 3], description="ZeRO stage", style=style),
            "sharding": widgets.Dropdown(
                options=list(est.SHARDING), description="FSDP sharding", style=style
            ),
            "offload": widgets.Dropdown(
                options=[o.value for o in Offload], description="Offload", style=style
            ),
            "nvme_path": text(value=DEFAULT_NVME, description="NVMe path", style=style),
            "checkpoint": text(
                description="Checkpointing",
                placeholder=", ".join(self.model.blocks) or "module classes, e.g. Block",
                style=style,
            ),
            "config_name": text(description="Config name", style=style),
        }
        for widget in self.fields.values():
            widget.observe(self._update, names="value")
        self.outputs = {
            name: widgets.HTML() for name in ("notes", "advice", "table", "config", "copy", "done")
        }
        self.chart_view = widgets.Output()
        self.text = widgets.Textarea(rows=1, layout=widgets.Layout(width="100%"))
        self.text.observe(self._keep_line, names="value")
        self.buttons = {
            "write": widgets.Button(description="Write config", icon="save"),
            "insert": widgets.Button(description="Insert as new cell", icon="plus"),
            "default": widgets.Button(description="Use as default", icon="check"),
            "recommended": widgets.Button(description="Use recommended", icon="star"),
        }
        self.buttons["write"].on_click(lambda _: self.write_config())
        self.buttons["insert"].on_click(lambda _: self.insert_cell())
        self.buttons["default"].on_click(lambda _: self.use_as_default())
        self.buttons["recommended"].on_click(lambda _: self.apply_recommendation())
        self.dry_fields: dict[str, Any] = {
            "batch": text(description="Batch", placeholder="torch.randn(8, 1024), one rank's", style=style),
            "gpu": widgets.Dropdown(
                options=[("free memory here", ""), *((name, name) for name in GPUS)],
                description="Judge against",
                style=style,
            ),
        }
        self.buttons["dry_run"] = widgets.Button(description="Dry run", icon="play")
        self.buttons["dry_run"].on_click(lambda _: self.run_dry_run())
        self.outputs["dry_run"] = widgets.HTML()
        self.dry_run_view = widgets.VBox()
        names = list(self.fields)
        left, right = [self.fields[n] for n in names[:5]], [self.fields[n] for n in names[5:]]
        out, buttons = self.outputs, self.buttons
        row = [out["copy"], buttons["insert"], buttons["default"], buttons["recommended"], buttons["write"]]
        return [
            widgets.HBox([widgets.VBox(left), widgets.VBox(right)]),
            out["notes"],
            out["advice"],
            widgets.HBox([out["table"], self.chart_view], layout=widgets.Layout(align_items="flex-start")),
            out["config"],
            self.text,
            widgets.HBox(row),
            out["done"],
            widgets.HBox([*self.dry_fields.values(), self.buttons["dry_run"]]),
            out["dry_run"],
            self.dry_run_view,
        ]

    # -- following the fields --------------------------------------------------------------------

    def _update(self, change: Any = None) -> None:
        if self._holding:
            return
        if change is not None and any(change.owner is self.fields[n] for n in PLAN_FIELDS):
            self._following = False  # a strategy chosen by hand: stop following the recommendation
        values = {name: widget.value for name, widget in self.fields.items()}
        choice = check_fields(values, self.gpu_count, self.model, self._capabilities(int(values["nproc"])))
        parameters = self._parameters(str(values["count"]), choice.notes)
        self._configure(choice, str(values["config_name"]), str(values["nvme_path"]))
        text = self._config_text()
        written = self.config is not None and self._written == (self.config_file, text)
        config = self.config_file if written else None
        self.line = distributed_line(
            choice.plan, choice.device, choice.nproc, choice.precision, config, self.devices
        )
        if self.config is not None and not written:
            choice.notes.append(
                f"This choice needs {self.config_file}: press “Write {self.config_file}” and the line "
                f"gets --config {self.config_file}."
            )
        self.notes = choice.notes
        free = self._estimate(choice, parameters)
        self._render(choice, free)
        recommended = self.advice.choice if self.advice is not None else None
        if self._following and recommended is not None and recommended.plan != choice.plan:
            self.apply_recommendation()

    def _capabilities(self, nproc: int) -> tuple[Capability | None, ...]:
        """The compute capability of each GPU the line would use."""
        devices = self.devices if len(self.devices) == nproc else range(nproc)
        return self.memory.capabilities_of(devices)

    def _parameters(self, text: str, notes: list[str]) -> int | None:
        if not text.strip():
            return None
        exact = self.model.parameters
        if exact and text.strip() == est.format_count(exact):
            return exact  # the field shows a model's count rounded; estimate with the exact one
        try:
            return est.parse_count(text)
        except SpecError as exc:
            notes.append(f"{str(exc)[0].upper()}{str(exc)[1:]}.")
            return None

    def _configure(self, choice: Choice, name: str, nvme_path: str) -> None:
        nvme_path = nvme_path.strip() or DEFAULT_NVME
        if choice.plan.offload is Offload.NVME and not Path(nvme_path).expanduser().is_dir():
            choice.notes.append(
                f"NVMe path {nvme_path} is not a directory here: set it to one on a local NVMe drive "
                "(DeepSpeed keeps its swap files there)."
            )
        self.config = strategy_config(choice.plan, choice.checkpoint, nvme_path)
        default = DEFAULT_CONFIG.get(choice.plan.strategy, "options")
        name = name.strip().removesuffix(".json") or default
        if not FILE_NAME.match(name):
            choice.notes.append(f"Config name {name!r} is not a plain file name; using {default}.json.")
            name = default
        self.config_file = f"{name}.json"

    def _config_text(self) -> str:
        return json.dumps(self.config, indent=2) + "\n" if self.config is not None else ""

    def _estimate(self, choice: Choice, parameters: int | None) -> FreeMemory | None:
        free = self.memory.free_for(choice.device, choice.nproc)
        if parameters is None:
            self.estimates, self.current, self.advice = [], None, None
            self.recommendation = (
                "Type the parameter count (124M, 1.3B, 7e9), or run `%dist_picker model` to count a model's."
            )
            return free
        self.estimates = est.compare(parameters, choice.nproc, choice.precision)
        self.current = est.estimate(choice.plan, parameters, choice.nproc, choice.precision)
        candidates = [e for e in self.estimates if self.deepspeed or e.plan.strategy != "deepspeed"]
        self.advice = est.recommend(candidates, free)
        note = init_note(self.advice.choice, free) if self.advice.choice is not None else ""
        if note and self.advice.fits:
            self.advice = replace(self.advice, reason=f"{self.advice.reason} It {note}.")
        self.recommendation = self.advice.text
        if not self.deepspeed:
            self.recommendation += (
                " deepspeed is not installed (pip install 'jupyter_shard[deepspeed]'): only ddp and fsdp "
                "are recommended."
            )
        return free

    def _render(self, choice: Choice, free: FreeMemory | None) -> None:
        strategy = choice.plan.strategy
        self.fields["zero_stage"].disabled = strategy != "deepspeed"
        self.fields["sharding"].disabled = strategy != "fsdp"
        self.fields["nvme_path"].disabled = choice.plan.offload is not Offload.NVME
        self.fields["config_name"].disabled = self.config is None
        out = self.outputs
        items = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        out["notes"].value = f"<ul style='color:var(--jp-warn-color0,#b35c00)'>{items}</ul>" if items else ""
        out["advice"].value = _advice_html(self.recommendation, self.current, free)
        out["table"].value = _table_html(self.estimates, self.current, self.advice, free)
        self._chart(free)
        body = html.escape(self._config_text())
        out["config"].value = f"<b>{html.escape(self.config_file)}</b><pre>{body}</pre>" if body else ""
        out["copy"].value = copy_button(self.line, "Copy line")
        self.text.value = self.line
        self.buttons["write"].description = f"Write {self.config_file}"
        self.buttons["write"].disabled = self.config is None

    def _chart(self, free: FreeMemory | None) -> None:
        """Redraw the stacked bars of each strategy's bytes per rank against the free memory."""
        rows = list(self.estimates)
        if self.current is not None and self.current.plan not in {e.plan for e in rows}:
            rows.append(self.current)
        recommended = self.advice.choice.plan if self.advice is not None and self.advice.choice else None
        self.chart = memory_figure(rows, self.current, recommended, free) if rows else None
        with self.chart_view:
            clear_output(wait=True)
            if self.chart is not None:
                text = "; ".join(f"{e.plan.label} {est.format_bytes(e.device_bytes)}" for e in rows)
                display({PLOTLY_MIME: self.chart, "text/plain": f"per rank: {text}"}, raw=True)

    def _keep_line(self, change: object = None) -> None:
        if self.text.value != self.line:
            self.text.value = self.line  # read-only: selectable, but edits do not stick

    # -- buttons -----------------------------------------------------------------------------------

    def apply_recommendation(self) -> None:
        """Set strategy, stage, sharding and offload to the recommended plan, and follow it from now on
        (until a strategy field is changed by hand)."""
        plan = self.advice.choice.plan if self.advice is not None and self.advice.choice else None
        self._following = True
        if plan is None or self._applying:
            return
        self._applying = self._holding = True
        try:
            values = (plan.strategy, plan.zero_stage, plan.sharding, plan.offload.value)
            for name, value in zip(PLAN_FIELDS, values, strict=True):
                self.fields[name].value = value
        finally:
            self._holding = False
        try:
            self._update()
        finally:
            self._applying = False

    def write_config(self) -> Path | None:
        """Write the config JSON into the current directory; the line then carries ``--config``."""
        if self.config is None:
            return None
        path = Path.cwd() / self.config_file
        text = self._config_text()
        try:
            write_atomic(path, text)
        except OSError as exc:
            self._done(f"Could not write {path}: {exc}")
            return None
        self._written = (self.config_file, text)
        self._update()
        self._done(f"Wrote {path}; the line now carries --config {self.config_file}.")
        return path

    def insert_cell(self) -> None:
        """Ask the JupyterLab extension to insert the line as a new cell below."""
        insert_line(self.send, self.line, self._done)

    def use_as_default(self) -> None:
        use_line_as_default(self._set_default, self.line, self._done)

    def _done(self, message: str) -> None:
        self.outputs["done"].value = f"<i>{html.escape(message)}</i>"

    # -- the dry run ---------------------------------------------------------------------------

    def dry_run_line(self) -> str:
        """The ``%dist_picker`` line the form's dry run runs: its model, the batch field, and the form's
        ranks, device and precision (16-mixed, which the dry run does not follow, plans in 32)."""
        if not self.model_expr or not all(n.isidentifier() for n in self.model_expr.split(".")):
            raise SpecError(
                "%dist_picker: the dry run needs the model itself; open the form with `%dist_picker model` "
                "on a variable holding it (or a function that builds it)"
            )
        batch = str(self.dry_fields["batch"].value).strip()
        if not batch:
            raise SpecError("%dist_picker: type a batch, such as torch.randn(8, 1024), to dry-run the model")
        parts = [self.model_expr, "--batch", batch, "--world-size", str(self.fields["nproc"].value)]
        device = str(self.fields["device"].value)
        gpu = str(self.dry_fields["gpu"].value)
        if gpu:
            device = "cuda"
            parts += ["--gpu", gpu]
        parts += ["--device", device] if device != "auto" else []
        precision = str(self.fields["precision"].value)
        parts += ["--precision", precision] if precision in PRECISIONS else []
        return shlex.join(parts)

    def run_dry_run(self) -> DryRunPicker | None:
        """Run the dry run for the form's fields and show its picker below the form (its table, its
        recommended line to insert or use as default); a mistake is one line in the form."""
        self.outputs["dry_run"].value = ""
        try:
            line = self.dry_run_line()
            outcome = plan_line(
                line,
                self.namespace,
                self.pool,
                memory=self.memory,
                gpu_count=self.gpu_count,
                deepspeed=self.deepspeed,
            )
        except SpecError as exc:
            self.dry_run = None
            self.dry_run_view.children = ()
            self.outputs["dry_run"].value = f"<i>{html.escape(str(exc))}</i>"
            return None
        self.dry_run = DryRunPicker(outcome, self._set_default)
        self.dry_run_view.children = (self.dry_run,)
        self.outputs["dry_run"].value = f"<i>Ran <code>%dist_picker {html.escape(line)}</code></i>"
        return self.dry_run


def _advice_html(recommendation: str, current: est.Estimate | None, free: FreeMemory | None) -> str:
    lines = [f"<b>Recommended:</b> {html.escape(recommendation)}"]
    if free is not None:
        where = "host RAM per rank (shared by all CPU ranks)" if free.device is Device.CPU else "per GPU"
        lines.append(f"Free: {est.format_bytes(free.per_rank)} {where}, from {html.escape(free.source)}.")
    if current is not None:
        device = free.device if free is not None else Device.CUDA
        fit = "" if free is None else (" — fits" if est.fits(current, free) else " — does not fit")
        note = init_note(current, free) if fit == " — fits" else ""
        fit = f" — {note}" if note else fit
        lines.append(f"<b>Your choice</b>, {current.plan.label}: {est.needs(current, device)}{fit}.")
    return "<br>".join(lines)


def _table_html(
    estimates: list[est.Estimate],
    current: est.Estimate | None,
    advice: est.Recommendation | None,
    free: FreeMemory | None,
) -> str:
    """Every strategy's per-rank bytes; ★ marks the recommendation, ▶ (bold) the form's choice."""
    rows = list(estimates)
    if current is not None and current.plan not in {e.plan for e in rows}:
        rows.append(current)
    recommended = advice.choice.plan if advice is not None and advice.choice is not None else None
    head = ["", "strategy", "device", "host RAM", "NVMe", "params", "grads", "optimizer", "fits"]
    notes: set[str] = set()
    lines = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for e in rows:
        chosen = current is not None and e.plan == current.plan
        mark = ("★" if e.plan == recommended else "") + ("▶" if chosen else "")
        parts = [getattr(e.device, c) + getattr(e.host, c) + getattr(e.disk, c) for c in est.COMPONENTS]
        sizes = [
            est.format_bytes(b) if b else "–" for b in (e.device_bytes, e.host_bytes, e.disk_bytes, *parts)
        ]
        fit = "?" if free is None else ("yes" if est.fits(e, free) else "no")
        note = init_note(e, free) if fit == "yes" else ""
        fit += " †" if note else ""
        notes.update([note] if note else [])
        cells = "".join(f"<td>{html.escape(c)}</td>" for c in (mark, e.plan.label, *sizes, fit))
        lines.append(f"<tr style='font-weight:{'bold' if chosen else 'normal'}'>{cells}</tr>")
    footer = "".join(f"<div>† {html.escape(n[0].upper() + n[1:])}.</div>" for n in sorted(notes))
    caption = "<caption>Per rank, before activations</caption>"
    return f"<table>{caption}{''.join(lines)}</table>{footer}" if rows else ""
