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
            "name": NAMES[c],
            "x": labels,
            "y": [held(e, c, device) / GIB for e in rows],
            "marker": {"color": COLORS[c]},
            "hovertemplate": f"%{{x}}<br>{NAMES[c]} %{{y:.2f}} GiB<extra></extra>",
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
                    "xref": "paper",
                    "x0": 0,
                    "x1": 1,
                    "yref": "y",
                    "y0": level,
                    "y1": level,
                    "line": {"color": "#d62728", "width": 2, "dash": dash},
                    "showlegend": True,
                    "name": f"{name}: {est.format_bytes(int(share * free.per_rank))}",
                }
            )
    return {
        "data": data,
        "layout": {
            "barmode": "stack",
            "height": 320,
            "width": 520,
            "margin": {"l": 55, "r": 10, "t": 40, "b": 70},
            "title": {"text": "Memory per rank, before activations", "font": {"size": 13}, "x": 0},
            "yaxis": {"title": {"text": "GiB"}, "gridcolor": "#eee"},
            "xaxis": {"tickangle": -30},
            "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1, "xanchor": "right"},
            "plot_bgcolor": "#fff",
            "shapes": shapes,
        },
    }
