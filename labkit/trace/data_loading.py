"""Data loading in a host trace, found from what PyTorch itself records: no label in the job needed.

Two shapes of loading data in the training process, as learners write them:

* through a `torch.utils.data.DataLoader` (in the process: `num_workers=0`): PyTorch's own profiler span
  around each batch it yields, "enumerate(DataLoader)#<iterator>.__next__", holds the dataset's
  `__getitem__` (tokenising, augmenting) and the collation;
* inline, before the forward: Python work on the training thread (reading text, tokenising) in which no
  torch operator runs. The host trace shows it as time on that thread outside every operator, between the
  step's start and its first operator that computes (not one that only makes or moves the batch's tensors,
  `PREP_OPS`, and not the optimizer's `zero_grad`), where a batch was made in that lead. Later gaps between
  operators are the model's own Python overhead, which every eager step has, and are not counted.

`phase("data...")` regions (labkit's own label) count too, as one more way to name the same work. A
training thread descheduled by the OS also shows as a gap (two emulated ranks sharing a core): only the
step's lead is read, where that is a small share of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.trace.phases import PHASE_PREFIX
from labkit.trace.timeline import Step, Trace, TraceEvent, subtract, union

__all__ = ["DATALOADER_PREFIX", "DATA_PREFIXES", "PREP_OPS", "DataTime", "data_time"]

DATALOADER_PREFIX = "enumerate(DataLoader)"
DATA_PREFIXES = (DATALOADER_PREFIX, PHASE_PREFIX + "data")  # the spans that name data loading
# Operators that only make, shape or move a batch's tensors: the batch's preparation, not the model's work
PREP_OPS = (
    "aten::to", "aten::_to_copy", "aten::copy_", "aten::empty", "aten::empty_strided", "aten::lift_fresh",
    "aten::tensor", "aten::stack", "aten::cat", "aten::zeros", "aten::ones", "aten::full", "aten::arange",
    "aten::view", "aten::reshape", "aten::unsqueeze", "aten::slice", "aten::select", "aten::narrow",
    "aten::as_strided", "aten::clone", "aten::detach", "aten::detach_", "aten::alias", "aten::pin_memory",
    "aten::_pin_memory", "aten::is_pinned", "aten::scalar_tensor", "aten::resize_", "aten::set_",
)
_NOT_WORK = ("labkit:", "Optimizer.zero_grad", *DATA_PREFIXES)

Interval = tuple[float, float]


@dataclass(frozen=True)
class DataTime:
    """One step's data loading on the host (us): the DataLoader's spans (and `phase("data")`), and the
    Python work outside any operator before the forward; `intervals` is their union."""

    dataloader_us: float
    python_us: float
    intervals: list[Interval]


def _total(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _top_level(events: list[TraceEvent]) -> list[TraceEvent]:
    """The events not nested in another (one thread's, sorted by start)."""
    out: list[TraceEvent] = []
    for e in sorted(events, key=lambda e: (e.start_us, -e.dur_us)):
        if not out or e.start_us >= out[-1].end_us:
            out.append(e)
    return out


def _lead(top: list[TraceEvent]) -> float | None:
    """Where the step's first operator that computes starts, if a batch was made before it (an operator of
    `PREP_OPS` or a DataLoader span: the lead is the batch's preparation); else None."""
    made = False
    for e in top:
        if e.name in PREP_OPS or e.name.startswith(DATALOADER_PREFIX):
            made = True
        elif not e.name.startswith(_NOT_WORK):
            return e.start_us if made else None
    return None


def data_time(host: Trace, step: Step) -> DataTime:
    """The data loading of `step` in `host` (module docstring)."""
    lo, hi = step.start_us, step.end_us
    named = [
        (max(e.start_us, lo), min(e.end_us, hi))
        for e in host.events
        if e.name.startswith(DATA_PREFIXES) and e.end_us > lo and e.start_us < hi
    ]
    named = union(named)
    python: list[Interval] = []
    if step.thread is not None:
        mine = [
            e
            for e in host.events
            if (e.pid, e.tid) == step.thread and e.category in ("cpu_op", "user_annotation")
            and lo <= e.start_us < hi
        ]
        top = _top_level(mine)
        end = _lead(top)
        if end is not None:
            python = subtract(subtract([(lo, end)], union((e.start_us, e.end_us) for e in top)), named)
    return DataTime(_total(named), _total(python), union(named + python))
