"""Pictures of traces: one step per rank, a compute lane and a comm lane.

`plot_timeline` draws what `timeline.py` reads; lab 03 shows it before and after the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from labkit.trace.timeline import Trace, overlap, read_trace, step_lanes

__all__ = ["plot_timeline"]


def plot_timeline(
    traces_by_rank: Sequence[Trace | str | Path] | Mapping[int, Trace | str | Path],
    ax: Any = None,
    title: str = "One training step: compute vs communication",
    step: int | None = None,
) -> Any:
    """Draw one step (default: the last) per rank: a compute lane and a comm lane, ms on x.

    Accepts traces or trace paths, as a list in rank order or a {rank: trace} mapping.
    Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    items = traces_by_rank.items() if isinstance(traces_by_rank, Mapping) else enumerate(traces_by_rank)
    rows = [(r, t if isinstance(t, Trace) else read_trace(t)) for r, t in items]
    if not rows:
        raise ValueError("plot_timeline got no traces; pass [read_trace(p) for p in paths].")
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.9 + 0.8 * len(rows)))
    else:
        fig = ax.figure

    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    yticks, ylabels, x_max = [], [], 0.0
    for row, (rank, tr) in enumerate(rows):
        lanes = step_lanes(tr, step)
        stats = overlap(tr, tr.step(step).number)
        x_max = max(x_max, stats["step_ms"])
        for k, lane in enumerate(("compute", "comm")):
            y = -(row * 2.6 + k)
            bars = [(a, b - a) for a, b in lanes[lane]]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[lane], label=lane if row == 0 else None)
            yticks.append(y)
            ylabels.append(f"rank {rank} {lane}")
        ax.text(
            stats["step_ms"],
            -(row * 2.6) - 0.5,
            f"  step {stats['step_ms']:.1f} ms\n  overlap {stats['overlap_pct']:.0f}%",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(yticks, ylabels)
    ax.set_xlim(0, x_max * 1.15 if x_max > 0 else 1)
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
