"""The picker's chart: each strategy's memory per rank as stacked bars against the free memory.

Bars stack what one rank must hold for parameters, gradients and optimizer state (on its device, and
on CPU ranks also what is offloaded to the same host RAM), one bar per strategy in the table's order;
a solid line marks the free memory per rank and a dashed one the share a plan may use
(:data:`~jupyter_shard.planner.estimate.HEADROOM`). A Plotly figure, as dicts: drawn beside the table.
"""

from __future__ import annotations

from typing import Any

from jupyter_shard.planner import estimate as est
from jupyter_shard.planner.free_memory import FreeMemory
from jupyter_shard.spec import Device

GIB = 2**30
COLORS = {"params": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c"}
NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}


def bar_label(e: est.Estimate, current: est.Estimate | None, recommended: est.Plan | None) -> str:
    """The bar's category: the plan, ★ when recommended, ▶ when it is the form's choice."""
    mark = ("★ " if e.plan == recommended else "") + (
        "▶ " if current is not None and e.plan == current.plan else ""
    )
    return mark + e.plan.label


def held(e: est.Estimate, component: str, device: Device) -> int:
    """Bytes of ``component`` that count against the free memory per rank (as ``estimate.demand``)."""
    on_device: int = getattr(e.device, component)
    return on_device + (getattr(e.host, component) if device is Device.CPU else 0)


def memory_figure(
    rows: list[est.Estimate],
    current: est.Estimate | None,
    recommended: est.Plan | None,
    free: FreeMemory | None,
) -> dict[str, Any]:
    device = free.device if free is not None else Device.CUDA
    labels = [bar_label(e, current, recommended) for e in rows]
    data: list[dict[str, Any]] = [
        {
            "type": "bar",
            "orientation": "h",
            "name": NAMES[c],
            "y": labels,
            "x": [held(e, c, device) / GIB for e in rows],
            "marker": {"color": COLORS[c]},
            "hovertemplate": f"%{{y}}<br>{NAMES[c]} %{{x:.2f}} GiB<extra></extra>",
        }
        for c in est.COMPONENTS
    ]
    shapes = []
    if free is not None:
        where = "host RAM per rank" if device is Device.CPU else "free per GPU"
        for share, dash, name in ((1.0, "solid", where), (float(est.HEADROOM), "dash", "usable")):
            level = share * free.per_rank / GIB
            shapes.append(
                {
                    "type": "line",
                    "yref": "paper",
                    "y0": 0,
                    "y1": 1,
                    "xref": "x",
                    "x0": level,
                    "x1": level,
                    "line": {"color": "#d62728", "width": 2, "dash": dash},
                    "showlegend": True,
                    "name": f"{name}: {est.format_bytes(int(share * free.per_rank))}",
                }
            )
    return {
        "data": data,
        "layout": {
            "barmode": "stack",
            "height": 130 + 22 * len(rows),
            "width": 440,
            "margin": {"l": 10, "r": 20, "t": 30, "b": 90},
            "title": {"text": "Memory per rank, before activations", "font": {"size": 13}, "x": 0},
            "xaxis": {"title": {"text": "GiB"}, "gridcolor": "#eee", "rangemode": "tozero"},
            "yaxis": {"autorange": "reversed", "automargin": True},  # the table's order, top down
            "legend": {"orientation": "h", "x": 0, "y": 0, "yanchor": "bottom", "yref": "container"},
            "plot_bgcolor": "#fff",
            "shapes": shapes,
        },
    }
