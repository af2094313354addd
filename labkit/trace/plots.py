"""Pictures of traces: one step per rank, a compute lane and a comm lane.

`plot_timeline` draws what `timeline.py` reads; lab 03 shows it before and after the fix, drawing the
traced step nearest the median (`typical_step`) with the recorded median marked, so that the picture and the
record show the same run (a last step that happened to be slow is not the step the lab records).
`mark_diagnosis` marks on such a figure what `diagnose` found (lab 05). `plot_pipeline` draws a
pipeline step as a Gantt chart, one row per rank, each forward and backward
of each micro-batch where it ran (lab 04, from `labkit.course.experiments.imbalanced_pipeline`'s spans).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from labkit.trace.timeline import Trace, overlap, read_trace, step_lanes

__all__ = ["mark_diagnosis", "plot_pipeline", "plot_timeline", "typical_step"]

# traces or their paths, in rank order or by rank
TracesByRank = Sequence[Trace | str | Path] | Mapping[int, Trace | str | Path]


def _axes(ax: Any, height: float) -> tuple[Any, Any]:
    """A 10-inch-wide figure of `height` inches, or the figure of the axes given."""
    import matplotlib.pyplot as plt

    if ax is None:
        return plt.subplots(figsize=(10, height))
    return ax.figure, ax


def _finish(fig: Any, ax: Any, title: str) -> Any:
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _rows(traces_by_rank: TracesByRank) -> list[tuple[int, Trace]]:
    items = traces_by_rank.items() if isinstance(traces_by_rank, Mapping) else enumerate(traces_by_rank)
    return [(r, t if isinstance(t, Trace) else read_trace(t)) for r, t in items]


def typical_step(traces_by_rank: TracesByRank) -> int:
    """The number of the traced step whose time on its slowest rank is the median over the steps every rank
    traced (the lower median for an even count): the step to draw next to a recorded median."""
    rows = _rows(traces_by_rank)
    if not rows:
        raise ValueError("typical_step got no traces; pass [read_trace(p) for p in paths].")
    common = set.intersection(*({s.number for s in tr.steps} for _, tr in rows))
    if not common:
        raise ValueError(
            "the traces share no step number: "
            + "; ".join(f"rank {r}: {[s.number for s in tr.steps]}" for r, tr in rows)
        )
    slowest = sorted((max(overlap(tr, n)["step_ms"] for _, tr in rows), n) for n in common)
    return slowest[(len(slowest) - 1) // 2][1]


def plot_timeline(
    traces_by_rank: TracesByRank,
    ax: Any = None,
    title: str = "One training step: compute vs communication",
    step: int | None = None,
    recorded_ms: float | None = None,
) -> Any:
    """Draw one step (default: the last) per rank: a compute lane and a comm lane (and a memory lane, the
    GPU's copies and memsets, where a trace has any), ms on x. `recorded_ms` (the step time a lab records,
    a median over its timed steps) is marked as a dashed line, so that one step drawn is seen against it.

    Accepts traces or trace paths, as a list in rank order or a {rank: trace} mapping.
    Returns the matplotlib Figure.
    """
    rows = _rows(traces_by_rank)
    if not rows:
        raise ValueError("plot_timeline got no traces; pass [read_trace(p) for p in paths].")
    fig, ax = _axes(ax, 0.9 + 0.8 * len(rows))

    colors = {"compute": "tab:blue", "comm": "tab:orange", "memory": "tab:green"}
    all_lanes = [step_lanes(tr, step) for _, tr in rows]
    names = ("compute", "comm", "memory") if any(ls["memory"] for ls in all_lanes) else ("compute", "comm")
    pitch = len(names) + 0.6
    yticks, ylabels, x_max = [], [], 0.0
    for row, ((rank, tr), lanes) in enumerate(zip(rows, all_lanes, strict=True)):
        stats = overlap(tr, tr.step(step).number)
        x_max = max(x_max, stats["step_ms"])
        for k, lane in enumerate(names):
            y = -(row * pitch + k)
            bars = [(a, b - a) for a, b in lanes[lane]]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[lane], label=lane if row == 0 else None)
            yticks.append(y)
            ylabels.append(f"rank {rank} {lane}")
        ax.text(
            stats["step_ms"],
            -(row * pitch) - 0.5,
            f"  step {stats['step_ms']:.1f} ms\n  overlap {stats['overlap_pct']:.0f}%",
            va="center",
            fontsize=8,
        )
    if recorded_ms is not None:
        label = f"recorded {recorded_ms:.1f} ms"
        ax.axvline(recorded_ms, color="black", linestyle="--", linewidth=1, label=label)
        x_max = max(x_max, recorded_ms)
    ax.set_yticks(yticks, ylabels)
    ax.set_xlim(0, x_max * 1.15 if x_max > 0 else 1)
    return _finish(fig, ax, title)


def plot_pipeline(
    spans_by_rank: Sequence[Sequence[tuple[str, int, int, float, float]]],
    step_ms: float | None = None,
    ax: Any = None,
    title: str = "One pipeline step",
) -> Any:
    """A Gantt chart of one pipeline step: per rank, its forward ("F") and backward ("B") spans
    `(kind, stage, micro_batch, start_ms, end_ms)`, labelled with the micro-batch; white is idle.
    Returns the matplotlib Figure."""
    if not spans_by_rank:
        raise ValueError("plot_pipeline got no ranks; pass summary.spans from summarize_pipeline.")
    fig, ax = _axes(ax, 0.8 + 0.55 * len(spans_by_rank))
    end = (
        step_ms
        if step_ms is not None
        else max((e for spans in spans_by_rank for *_, e in spans), default=1.0)
    )
    shades = {"F": ("tab:blue", "lightsteelblue"), "B": ("tab:green", "darkseagreen")}
    for rank, spans in enumerate(spans_by_rank):
        busy = sum(e - a for *_, a, e in spans)
        for kind, stage, mb, a, e in spans:
            # a second chunk per rank (interleaved schedules): the lighter shade
            color = shades[kind][stage // len(spans_by_rank) % 2]
            ax.broken_barh(
                [(a, e - a)], (-rank - 0.4, 0.8), facecolor=color, edgecolor="white", linewidth=0.5
            )
            if e - a > end * 0.012:
                ax.text((a + e) / 2, -rank, str(mb), ha="center", va="center", fontsize=7, color="white")
        ax.text(end, -rank, f"  idle {100 * (1 - busy / end):.0f}%", va="center", fontsize=8)
    ax.broken_barh([], (0, 0), facecolor="tab:blue", label="forward (micro-batch no.)")
    ax.broken_barh([], (0, 0), facecolor="tab:green", label="backward")
    ax.set_yticks([-r for r in range(len(spans_by_rank))], [f"rank {r}" for r in range(len(spans_by_rank))])
    ax.set_xlim(0, end * 1.12)
    return _finish(fig, ax, title)


def mark_diagnosis(fig: Any, traces: Sequence[Trace], diagnosis: Any, step: int | None = None) -> Any:
    """Mark a diagnosis on a `plot_timeline` figure of the same traces: the straggler's rows, the data
    loading phases, or the collectives the ranks waited for; the verdict goes in the title."""
    ax = fig.axes[0]
    color = "tab:red"
    for row, tr in enumerate(traces):
        s = tr.step(step)
        y = -(row * 2.6)
        if diagnosis.kind == "straggler" and tr.rank == diagnosis.rank:
            ax.axhspan(y - 1.5, y + 0.5, color=color, alpha=0.12)
        # the events to outline, and the lane they sit in (the phase lane, or the one below it)
        if diagnosis.kind == "data_loading":
            marked = [
                e for e in tr.events if e.category == "labkit_phase" and e.name.startswith("phase:data")
            ]
            top, hatch = y - 0.45, "//"
        elif diagnosis.kind in ("sync_collective", "small_collectives"):
            marked, top, hatch = list(tr.lane("comm")), y - 1.45, None
        else:
            marked, top, hatch = [], y, None
        for e in marked:
            if s.start_us <= e.start_us < s.end_us:
                ax.broken_barh(
                    [((e.start_us - s.start_us) / 1e3, e.dur_us / 1e3)],
                    (top, 0.9),
                    facecolor="none",
                    edgecolor=color,
                    hatch=hatch,
                    linewidth=1.0,
                )
    who = "" if diagnosis.rank is None else f" on rank {diagnosis.rank}"
    ax.set_title(f"{ax.get_title()}\ndiagnosis: {diagnosis.kind}{who} (marked in red)", fontsize=10)
    fig.tight_layout()
    return fig
