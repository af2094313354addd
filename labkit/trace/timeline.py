"""Read a Chrome trace into lanes (compute, comm, idle) per step, and measure overlap.

HolisticTraceAnalysis needs GPU kernels and fails on CPU-only traces, so this module reads
the Chrome trace JSON that `torch.profiler` exports itself (and that `capture.py` writes).
Every event lands in one lane:

* **compute**: `cpu_op` and `user_annotation` events (aten ops, autograd nodes, your own
  `record_function` regions) and GPU kernels, minus the time a thread spends inside a
  communication event (a `comm:wait` region nested in a `backward` region is waiting,
  not computing). A trace with GPU kernels is read on the device: `step_lanes` then takes
  only kernels (NCCL's are comm), since host spans only measure enqueueing;
* **comm**: `c10d::*`, `gloo:*`, `nccl:*`, `record_param_comms`, `ncclKernel*` /
  `ncclDevKernel*` GPU kernels, `comm:*` regions, anything on a gloo or NCCL thread, and
  the issue-to-completion spans of a `CommLog` (`commlog.py`);
* **idle**: the rest of the step (`ProfilerStep#N`).

`overlap` gives, per step, the share of communication time hidden under compute.
"""

from __future__ import annotations

import collections
import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.trace.commlog import COMM_CATEGORY

__all__ = [
    "STEP_END_SYNC",
    "Step",
    "Trace",
    "TraceEvent",
    "classify",
    "dump_json",
    "load_json",
    "overlap",
    "read_trace",
    "step_lanes",
    "subtract",
    "union",
]

# The span around `capture`'s own wait for a step's kernels (so that they end inside its ProfilerStep#N): the
# cudaDeviceSynchronize inside it is capture's doing, not a host sync of the job (`analyze` leaves it out).
STEP_END_SYNC = "labkit:step_end_sync"

Interval = tuple[float, float]


def load_json(path: Path) -> Any:
    """A trace file's JSON; `.gz` files are read gunzipped."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def dump_json(path: Path, data: Any) -> None:
    """Write a trace file's JSON; `.gz` files are written gzipped."""
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            json.dump(data, f)
    else:
        path.write_text(json.dumps(data))


@dataclass(frozen=True)
class TraceEvent:
    """One complete ("X") event of a Chrome trace; times in microseconds."""

    name: str
    category: str
    start_us: float
    dur_us: float
    tid: Any
    pid: Any = 0
    lane: str | None = None  # "compute", "comm" or None (step markers, metadata)
    args: dict | None = field(default=None, compare=False, hash=False)  # kept for comm events (bytes)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class Step:
    """A `ProfilerStep#N` window."""

    number: int
    start_us: float
    end_us: float

    @property
    def ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3


@dataclass
class Trace:
    """The events of one rank's trace, with lanes assigned, and its profiler steps."""

    path: Path | None
    events: list[TraceEvent]
    steps: list[Step]
    rank: int = 0
    thread_names: dict[tuple[Any, Any], str] = field(default_factory=dict)

    def lane(self, name: str) -> list[TraceEvent]:
        """The events of one lane ("compute" or "comm")."""
        return [e for e in self.events if e.lane == name]

    def step(self, number: int | None = None) -> Step:
        """Step `number`, or the last one (the most warmed up) when None."""
        if not self.steps:
            raise ValueError(
                f"trace {self.path} has no ProfilerStep#N events; capture it with labkit.trace.capture."
            )
        if number is None:
            return self.steps[-1]
        for s in self.steps:
            if s.number == number:
                return s
        raise ValueError(
            f"step={number} is not in trace {self.path}; it has steps {[s.number for s in self.steps]}."
        )


_COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "comm:", "record_param_comms", "ncclKernel", "ncclDevKernel")
_COMPUTE_CATEGORIES = ("cpu_op", "user_annotation", "kernel", "gpu_memcpy", "gpu_memset")


def classify(name: str, category: str, thread_name: str = "") -> str | None:
    """The lane of one event: "comm", "compute" or None (markers, runtime calls, metadata)."""
    if name.startswith(("ProfilerStep#", "labkit:")):
        return None
    if category == COMM_CATEGORY or name.startswith(_COMM_PREFIXES):
        return "comm"
    if category not in _COMPUTE_CATEGORIES:
        return None
    thread = thread_name.lower()
    if "gloo" in thread or "nccl" in thread or (category == "kernel" and "nccl" in name.lower()):
        return "comm"
    return "compute"


def read_trace(path: str | Path, *, rank: int | None = None) -> Trace:
    """Read a Chrome trace exported by torch.profiler (or by `capture`) into lanes and steps."""
    path = Path(path)
    data = load_json(path)
    raw = data["traceEvents"] if isinstance(data, dict) else data
    if rank is None:
        info = data.get("distributedInfo") if isinstance(data, dict) else None
        rank = int(info.get("rank", 0)) if isinstance(info, dict) else 0

    # A thread can be named twice (kineto saw a gloo thread as "python", then as
    # "pt_gloo_runloop"): keep every name. A thread running `gloo:*` work is a gloo thread.
    thread_names: dict[tuple[Any, Any], str] = {}
    for e in raw:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            name = str(e.get("args", {}).get("name", ""))
            if name not in thread_names.get(key, ""):
                thread_names[key] = f"{thread_names[key]} / {name}" if key in thread_names else name
    for e in raw:
        key = (e.get("pid"), e.get("tid"))
        if (
            e.get("ph") == "X"
            and str(e.get("name", "")).startswith("gloo:")
            and "gloo" not in thread_names.get(key, "")
        ):
            thread_names[key] = f"{thread_names.get(key, '')} (gloo)".strip()

    events: list[TraceEvent] = []
    steps: dict[int, Step] = {}
    for e in raw:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        name, cat = str(e.get("name", "")), str(e.get("cat", ""))
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if name.startswith("ProfilerStep#") and cat in ("user_annotation", "cpu_op"):
            n = int(name.split("#", 1)[1])
            steps.setdefault(n, Step(n, start, start + dur))
            continue
        lane = classify(name, cat, thread_names.get((e.get("pid"), e.get("tid")), ""))
        args = e.get("args") if lane == "comm" and isinstance(e.get("args"), dict) else None
        events.append(TraceEvent(name, cat, start, dur, e.get("tid"), e.get("pid"), lane, args))
    events.sort(key=lambda ev: ev.start_us)
    return Trace(path, events, sorted(steps.values(), key=lambda s: s.number), rank, thread_names)


# ------------------------------------------------------------------ interval math


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of (start, end) intervals, sorted and disjoint."""
    merged: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two unions (sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a minus b, both unions."""
    out = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


def _total(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def _clip(events: Iterable[TraceEvent], lo: float, hi: float) -> list[Interval]:
    return [
        (max(ev.start_us, lo), min(ev.end_us, hi)) for ev in events if ev.end_us > lo and ev.start_us < hi
    ]


# ------------------------------------------------------------------------ analysis


_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def step_lanes(trace: Trace, step: int | None = None) -> dict[str, list[Interval]]:
    """Compute, comm and idle intervals of one step (default: the last), in ms from its start.

    With GPU kernels in the trace, the lanes are the device's: compute = the kernels, copies and memsets that
    are not NCCL's, comm = NCCL's kernels (and `CommLog` spans, which the emulated device timeline has). Host
    spans (`backward`, `optimizer.step`) only measure the time to enqueue work, so an NCCL kernel running
    while the host enqueues is not overlapped with anything (a naive step with no overlap on the device would
    show most of its communication as overlapped). Without kernels (CPU traces) compute is, thread by thread,
    the compute events minus the comm events of that same thread (a thread blocked in a wait is not
    computing), then united across threads."""
    s = trace.step(step)
    lo, hi = s.start_us, s.end_us
    device = [e for e in trace.events if e.category in _DEVICE_CATEGORIES and e.lane is not None]
    if device:  # (the emulated device timeline is written the same way: "kernel" compute, CommLog spans)
        comm = union(
            _clip(
                [
                    e
                    for e in trace.events
                    if e.lane == "comm" and (e.category in _DEVICE_CATEGORIES or e.category == COMM_CATEGORY)
                ],
                lo,
                hi,
            )
        )
        compute = union(_clip([e for e in device if e.lane == "compute"], lo, hi))
    else:
        comm = union(_clip(trace.lane("comm"), lo, hi))
        by_thread: dict[tuple[Any, Any], list[TraceEvent]] = collections.defaultdict(list)
        for ev in trace.events:
            if ev.lane is not None:
                by_thread[(ev.pid, ev.tid)].append(ev)
        compute = []
        for evs in by_thread.values():
            busy = union(_clip([e for e in evs if e.lane == "compute"], lo, hi))
            blocked = union(_clip([e for e in evs if e.lane == "comm"], lo, hi))
            compute.extend(subtract(busy, blocked))
        compute = union(compute)
    idle = subtract([(lo, hi)], union(compute + comm))

    def ms(intervals: list[Interval]) -> list[Interval]:
        return [((a - lo) / 1e3, (b - lo) / 1e3) for a, b in intervals]

    return {"compute": ms(compute), "comm": ms(comm), "idle": ms(idle)}


def overlap(trace: Trace, step: int | None = None) -> dict[str, Any]:
    """Per-step compute, comm and overlapped time (ms) and overlap_pct = overlapped / comm · 100.

    `step=None` averages over every profiled step (overlap_pct from the totals); an int
    selects `ProfilerStep#<step>`. Also returns idle_ms, step_ms and the step numbers used.
    """
    numbers = [s.number for s in trace.steps] if step is None else [trace.step(step).number]
    if not numbers:
        trace.step(None)  # raises the helpful error
    totals = {"compute_ms": 0.0, "comm_ms": 0.0, "overlapped_ms": 0.0, "idle_ms": 0.0, "step_ms": 0.0}
    for n in numbers:
        lanes = step_lanes(trace, n)
        totals["compute_ms"] += _total(lanes["compute"])
        totals["comm_ms"] += _total(lanes["comm"])
        totals["overlapped_ms"] += _total(_intersect(lanes["compute"], lanes["comm"]))
        totals["idle_ms"] += _total(lanes["idle"])
        totals["step_ms"] += trace.step(n).ms
    out: dict[str, Any] = {k: v / len(numbers) for k, v in totals.items()}
    out["overlap_pct"] = 100.0 * totals["overlapped_ms"] / totals["comm_ms"] if totals["comm_ms"] > 0 else 0.0
    out["steps"] = numbers
    out["rank"] = trace.rank
    return out
