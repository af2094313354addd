"""Where a rank's GPU time went over its profiled steps, as Holistic Trace Analysis (HTA) measures it.

`temporal_breakdown(trace)` follows HTA's definitions (hta/analyzers/breakdown_analysis.py,
`get_temporal_breakdown`; hta/analyzers/communication_analysis.py, `get_comm_comp_overlap`), so that the
figures a learner reads here are the ones the tool people trust gives for the same trace:

* the events are the device's (kernels, copies, memsets) that the chosen steps launched, tied to them by the
  launch's `correlation` (`timeline.read_trace`); by default every step but the last, as HTA leaves the last
  profiler step out where a trace has two or more (hta/common/trace.py, `_filter_irrelevant_gpu_kernels`);
* the span runs from the first of those events to the end of the last; idle is the span less the union of
  all of them;
* compute, communication and memory are the unions of their lanes (`timeline.classify`: NCCL's kernels are
  communication; copies and memsets, memory; the other kernels, compute), each as a share of the span;
* overlap is the share of communication time during which a compute kernel also runs (compute ∩ comm over
  comm); memory counts for neither.

`analyze` reports a typical step (medians); this is the whole run, in one figure per rank. Without device
events (a CPU trace) there is nothing to break down: ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.trace.timeline import Trace, TraceEvent, intersect, subtract, union

__all__ = ["TemporalBreakdown", "temporal_breakdown"]


@dataclass(frozen=True)
class TemporalBreakdown:
    """One rank's device time over `steps` (ms), and each part's share of the span (%)."""

    rank: int
    steps: list[int]
    span_ms: float  # first device event's start to the last one's end
    idle_ms: float
    compute_ms: float
    comm_ms: float
    memory_ms: float
    overlapped_ms: float  # compute and communication at once
    note: str = ""

    def pct(self, part: str) -> float:
        """`part` ("idle", "compute", "comm", "memory") as a share of the span, in percent."""
        return 100.0 * getattr(self, f"{part}_ms") / self.span_ms if self.span_ms > 0 else 0.0

    @property
    def overlap_pct(self) -> float:
        """Share of communication time with compute running beside it (HTA's comp_comm_overlap_pctg)."""
        return 100.0 * self.overlapped_ms / self.comm_ms if self.comm_ms > 0 else 0.0

    def __str__(self) -> str:
        shares = ", ".join(f"{k} {self.pct(k):.1f} %" for k in ("idle", "compute", "comm", "memory"))
        return (
            f"rank {self.rank}, steps {self.steps}: {self.span_ms:.1f} ms of GPU time: {shares}; "
            f"{self.overlap_pct:.1f} % of communication overlapped{f' ({self.note})' if self.note else ''}"
        )


def _events_of(trace: Trace, steps: list[int]) -> list[TraceEvent]:
    """The device events `steps` launched; where the trace does not tie events to launches, those that run
    inside the steps' host windows."""
    device = trace.device_events
    if any(e.step is not None for e in device):
        wanted = set(steps)
        return [e for e in device if e.step in wanted]
    windows = [(s.start_us, s.end_us) for s in trace.steps if s.number in steps]
    return [e for e in device if any(lo <= e.start_us < hi for lo, hi in windows)]


def _total(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def temporal_breakdown(trace: Trace, steps: list[int] | None = None) -> TemporalBreakdown:
    """`trace`'s device time over `steps` (default: every step but the last, or the only one), as HTA
    defines it (module docstring)."""
    numbers = [s.number for s in trace.steps]
    if steps is None:
        steps = numbers[:-1] if len(numbers) >= 2 else numbers
    missing = [n for n in steps if n not in numbers]
    if missing:
        raise ValueError(f"steps {missing} are not in trace {trace.path}; it has steps {numbers}")
    events = _events_of(trace, steps)
    if not events:
        raise ValueError(
            f"trace {trace.path} has no GPU kernels, copies or memsets in steps {steps}: a temporal "
            "breakdown is of the device's time (for a CPU trace use labkit.trace.analyze)"
        )
    lanes = {
        k: union((e.start_us, e.end_us) for e in events if e.lane == k) for k in ("compute", "comm", "memory")
    }
    busy = union(lanes["compute"] + lanes["comm"] + lanes["memory"])
    lo, hi = busy[0][0], busy[-1][1]
    return TemporalBreakdown(
        rank=trace.rank,
        steps=list(steps),
        span_ms=(hi - lo) / 1e3,
        idle_ms=_total(subtract([(lo, hi)], busy)) / 1e3,
        compute_ms=_total(lanes["compute"]) / 1e3,
        comm_ms=_total(lanes["comm"]) / 1e3,
        memory_ms=_total(lanes["memory"]) / 1e3,
        overlapped_ms=_total(intersect(lanes["compute"], lanes["comm"])) / 1e3,
        note=trace.note,
    )
