"""The dispatch figures: round trip p50 and p90 by rank count, and cold start and warm restart to
first result, one colour per system in every figure."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import percentile, pyplot
from benchmarks.dispatch.results import COLD, ROUND_TRIP, WARM, Results

COLOURS = {
    "floor": "0.45",
    "kernel": "0.7",
    "shard": "tab:blue",
    "shard-paced": "tab:blue",
    "shard-nb": "tab:cyan",
    "shard-nb-bare": "tab:purple",
    "shard-nb-run": "tab:brown",
    "shard-spawn": "tab:purple",
    "ipp": "tab:red",
    "ipp-nb": "tab:orange",
    "jd": "tab:green",
    "jd-nb": "tab:olive",
    "shard-tree": "tab:blue",
    "shard-base": "tab:gray",
}


def plot(res: Results, folder: Path, stem: str = "dispatch") -> list[str]:
    """Draw the two figures into ``folder``; their file names."""
    plt = pyplot()
    written = []
    if res.trips:
        fig, ax = plt.subplots(figsize=(9, 5.5))
        ranks = sorted(res.trips)
        for name, label in ROUND_TRIP.items():
            xs = [n for n in ranks if name in res.trips[n]]
            if not xs:
                continue
            p50 = [percentile(res.trips[n][name], 50) * 1e3 for n in xs]
            p90 = [percentile(res.trips[n][name], 90) * 1e3 for n in xs]
            ax.plot(xs, p50, "o-", color=COLOURS[name], label=label.replace("`", ""))
            ax.plot(xs, p90, "v--", color=COLOURS[name], alpha=0.5)
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(n) for n in ranks])
        ax.set_xlabel("ranks / engines")
        ax.set_ylabel("no-op round trip, ms (solid: p50, dashed: p90)")
        ax.axhline(1.0, color="black", lw=0.8, ls=":", label="1 ms target (4 ranks)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        fig.savefig(folder / f"{stem}-roundtrip.png", dpi=120)
        plt.close(fig)
        written.append(f"{stem}-roundtrip.png")
    if any(res.cold.values()) or any(res.warm.values()):
        fig, axes = plt.subplots(1, 2, figsize=(13, 6.5))
        for ax, table, labels, title in (
            (axes[0], res.cold, COLD, "cold start"),
            (axes[1], res.warm, WARM, "warm restart"),
        ):
            ranks = sorted(n for n in table if table[n])
            names = [k for k in labels if any(k in table[n] for n in ranks)]
            width = 0.8 / max(len(names), 1)
            for i, name in enumerate(names):
                left = [j + i * width for j, n in enumerate(ranks) if name in table[n]]
                ys = [table[n][name].median for n in ranks if name in table[n]]
                bars = ax.bar(left, ys, width, label=labels[name].replace("`", ""), color=COLOURS[name])
                ax.bar_label(bars, fmt="%.2f", fontsize=7)
            ax.set_xticks(
                [j + width * (len(names) - 1) / 2 for j in range(len(ranks))], [str(n) for n in ranks]
            )
            ax.set_xlabel("ranks / engines")
            ax.set_ylabel(f"{title} to first result, s (median)")
            ax.set_yscale("log")
            ax.set_ylim(bottom=0.05)
            if title == "warm restart":
                ax.axhline(1.0, color="black", lw=0.8, ls=":", label="1 s target (4 ranks)")
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(folder / f"{stem}-start.png", dpi=120)
        plt.close(fig)
        written.append(f"{stem}-start.png")
    return written
