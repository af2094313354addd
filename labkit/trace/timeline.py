"""Read a Chrome trace into lanes (compute, comm, memory, idle) per step, and measure overlap.

HolisticTraceAnalysis needs GPU kernels and fails on CPU-only traces, so this module reads
the Chrome trace JSON that `torch.profiler` exports itself (and that `capture.py` writes).
Every event lands in one lane, the GPU's classes as HolisticTraceAnalysis (HTA) draws them
(hta/utils/utils.py, `get_kernel_type`):

* **compute**: `cpu_op` and `user_annotation` events (aten ops, autograd nodes, your own
  `record_function` regions) and GPU kernels, minus the time a thread spends inside a
  communication event (a `comm:wait` region nested in a `backward` region is waiting,
  not computing). A trace with GPU work is read on the device: `step_lanes` then takes
  only the device's events (NCCL's are comm), since host spans only measure enqueueing;
* **comm**: `c10d::*`, `gloo:*`, `nccl:*`, `record_param_comms`, `ncclKernel*` /
  `ncclDevKernel*` GPU kernels, `comm:*` regions, anything on a gloo or NCCL thread, and
  the issue-to-completion spans of a `CommLog` (`commlog.py`);
* **memory**: the device's copies and memsets (`gpu_memcpy`, `gpu_memset`, and kernels named
  `Memcpy*`, `Memset*`, `dma*`), neither compute nor communication, as HTA's MEMORY class;
* **idle**: the rest of the step.

Steps are the `ProfilerStep#N` windows of the host. On a GPU trace each device event belongs to
the step whose host window launched it (the launch's `correlation`, which the kernel carries
too), not to the window it runs in: an asynchronous GPU runs behind the host, so its share of
step N often runs while the host is in step N+1. A step's device window starts where the host
step starts (or where the previous step's device work ended, if later) and ends where the later
of the host step and its last device event ends. A trace without `ProfilerStep#N` markers is
read as one step, the whole trace (`Trace.note` says so).

`overlap` gives, per step, the share of communication time hidden under compute, as HTA
defines it (compute ∩ comm over comm; memory is neither).
"""

from __future__ import annotations

import bisect
import collections
import functools
import gzip
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
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
    "intersect",
    "is_device_event",
    "load_json",
    "overlap",
    "read_trace",
    "step_device_events",
    "step_lanes",
    "step_window",
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
    lane: str | None = None  # "compute", "comm", "memory" or None (step markers, runtime calls, metadata)
    args: dict | None = field(default=None, compare=False, hash=False)  # kept for comm events (bytes)
    correlation: int | None = field(default=None, compare=False)  # a launch's, and its device event's
    step: int | None = field(default=None, compare=False)  # a device event's: the step that launched it
    on_device: bool = field(default=False, compare=False)  # a kernel, copy or memset (`is_device_event`)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class Step:
    """A `ProfilerStep#N` window."""

    number: int
    start_us: float
    end_us: float
    thread: tuple[Any, Any] | None = field(default=None, compare=False)  # (pid, tid) of the training thread

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
    note: str = ""  # how the trace was read, where it is not the usual way (no ProfilerStep markers)

    def lane(self, name: str) -> list[TraceEvent]:
        """The events of one lane ("compute", "comm" or "memory")."""
        return [e for e in self.events if e.lane == name]

    @functools.cached_property
    def device_events(self) -> list[TraceEvent]:
        """The GPU's events (kernels, copies, memsets) that have a lane."""
        return [e for e in self.events if e.on_device and e.lane is not None]

    @functools.cached_property
    def device_windows(self) -> dict[int, tuple[float, float]]:
        """Each step's device window in us (`step_window`), where device events carry their launching step."""
        return _windows(self)

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
_COMPUTE_CATEGORIES = ("cpu_op", "user_annotation", "kernel")
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# HTA's MEMORY kernels (hta/utils/utils.py, MEMORY_KERNEL_RE)
_MEMORY_KERNEL = re.compile(r"Memcpy|Memset|dma")
# The host calls that launch device work; each carries the `correlation` its device event carries too
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# Events that may carry a stream but are not the device's work: the host's, and a stream's wait for an event
# (Kineto's "cuda_sync", idle here; HTA counts it as busy, which moves idle by up to 1.9 points on its tests)
_NOT_DEVICE = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "cuda_sync")


def is_device_event(category: str, args: dict) -> bool:
    """Does this event run on the device? Kineto's kernel, copy and memset categories, or any other event
    that carries a `stream` (another accelerator's kernels: HTA takes every event on a stream as the
    device's); never the host's runtime calls, which may carry one too, nor a stream's wait for an event."""
    cat = category.lower()
    if cat in _DEVICE_CATEGORIES:
        return True
    stream = args.get("stream")
    on_stream = isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0
    return on_stream and cat not in _NOT_DEVICE and not cat.endswith(("_runtime", "_driver"))


def classify(name: str, category: str, thread_name: str = "") -> str | None:
    """The lane of one event: "comm", "compute", "memory" or None (markers, runtime calls, metadata)."""
    if name.startswith(("ProfilerStep#", "labkit:")):
        return None
    cat = category.lower()  # Kineto writes "kernel"; some exporters "Kernel"
    if cat in ("gpu_memcpy", "gpu_memset") or (cat == "kernel" and _MEMORY_KERNEL.match(name)):
        return "memory"
    if category == COMM_CATEGORY or name.startswith(_COMM_PREFIXES):
        return "comm"
    if cat not in _COMPUTE_CATEGORIES:
        return None
    thread = thread_name.lower()
    if "gloo" in thread or "nccl" in thread or (cat == "kernel" and "nccl" in name.lower()):
        return "comm"
    return "compute"


def read_trace(path: str | Path, *, rank: int | None = None) -> Trace:
    """Read a Chrome trace exported by torch.profiler (or by `capture`) into lanes and steps."""
    path = Path(path)
    data = load_json(path)
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise ValueError(
            f"{path} is not a Chrome trace (no traceEvents): pass the trace torch.profiler exports "
            "(export_chrome_trace, tensorboard_trace_handler) or that labkit.trace.capture writes"
        )
    if rank is None:
        info = data.get("distributedInfo") if isinstance(data, dict) else None
        rank = int(info.get("rank", 0)) if isinstance(info, dict) else 0
    thread_names = _thread_names(raw)
    events: list[TraceEvent] = []
    steps: dict[int, Step] = {}
    for e in raw:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        name, cat = str(e.get("name", "")), str(e.get("cat", ""))
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if name.startswith("ProfilerStep#") and cat in ("user_annotation", "cpu_op"):
            n = int(name.split("#", 1)[1])
            steps.setdefault(n, Step(n, start, start + dur, (e.get("pid"), e.get("tid"))))
            continue
        events.append(_event(e, name, cat, start, dur, thread_names))
    events.sort(key=lambda ev: ev.start_us)
    ordered = sorted(steps.values(), key=lambda s: s.number)
    note = ""
    if not ordered and events:  # e.g. a trace of a benchmark, or of a schedule without step()
        ordered = [Step(0, events[0].start_us, max(ev.end_us for ev in events))]
        note = "no ProfilerStep#N markers: the whole trace is read as one step"
    return Trace(path, _by_launching_step(events, ordered), ordered, rank, thread_names, note)


def _event(
    e: dict, name: str, cat: str, start: float, dur: float, thread_names: dict[tuple[Any, Any], str]
) -> TraceEvent:
    """One complete event with its lane, whether it is the device's and its correlation."""
    raw_args = e.get("args") if isinstance(e.get("args"), dict) else {}
    device = is_device_event(cat, raw_args)
    # another accelerator's events are read as kernels (its copies and memsets by their names)
    as_category = cat if not device or cat.lower() in _DEVICE_CATEGORIES else "kernel"
    lane = classify(name, as_category, thread_names.get((e.get("pid"), e.get("tid")), ""))
    corr = raw_args.get("correlation")
    corr = corr if isinstance(corr, int) and not isinstance(corr, bool) else None
    args = raw_args if lane == "comm" and raw_args else None
    return TraceEvent(name, cat, start, dur, e.get("tid"), e.get("pid"), lane, args, corr, None, device)


def _thread_names(raw: list[dict]) -> dict[tuple[Any, Any], str]:
    """Each (pid, tid)'s name. A thread can be named twice (kineto saw a gloo thread as "python", then as
    "pt_gloo_runloop"): keep every name. A thread running `gloo:*` work is a gloo thread."""
    names: dict[tuple[Any, Any], str] = {}
    for e in raw:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            name = str(e.get("args", {}).get("name", ""))
            if name not in names.get(key, ""):
                names[key] = f"{names[key]} / {name}" if key in names else name
    for e in raw:
        key = (e.get("pid"), e.get("tid"))
        gloo_work = e.get("ph") == "X" and str(e.get("name", "")).startswith("gloo:")
        if gloo_work and "gloo" not in names.get(key, ""):
            names[key] = f"{names.get(key, '')} (gloo)".strip()
    return names


def _by_launching_step(events: list[TraceEvent], steps: list[Step]) -> list[TraceEvent]:
    """`events` with each device event's `step`: the step whose host window holds the launch that shares its
    correlation (HTA assigns GPU events to iterations the same way, hta/common/trace.py `add_iteration`)."""
    launched = {
        e.correlation: e.start_us
        for e in events
        if e.correlation is not None and e.category.lower() in _LAUNCH_CATEGORIES
    }
    if not launched or not steps:
        return events
    by_start = sorted(steps, key=lambda s: s.start_us)
    starts = [s.start_us for s in by_start]

    def step_of(t: float) -> int | None:
        i = bisect.bisect_right(starts, t) - 1
        return by_start[i].number if i >= 0 and t < by_start[i].end_us else None

    out = []
    for e in events:
        if e.correlation in launched and e.on_device:
            e = replace(e, step=step_of(launched[e.correlation]))
        out.append(e)
    return out


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


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
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


def step_window(trace: Trace, step: int | None = None) -> tuple[float, float]:
    """(start, end) in us of a step (default: the last): the host's `ProfilerStep#N`, or on a GPU trace whose
    device events carry their launching step, the device window of the module docstring."""
    s = trace.step(step)
    return trace.device_windows.get(s.number, (s.start_us, s.end_us))


def _windows(trace: Trace) -> dict[int, tuple[float, float]]:
    """Each step's device window, where the trace ties device events to launches (else none)."""
    own: dict[int, list[float]] = collections.defaultdict(list)
    for e in trace.device_events:
        if e.step is not None:
            own[e.step].append(e.end_us)
    if not own:
        return {}
    out, previous = {}, float("-inf")
    for s in sorted(trace.steps, key=lambda s: s.start_us):
        lo = max(s.start_us, previous)
        hi = max([s.end_us, lo, *own.get(s.number, [])])
        out[s.number] = (lo, hi)
        previous = hi
    return out


def step_device_events(trace: Trace, number: int) -> list[TraceEvent]:
    """The device's events of a step: those it launched, where the trace ties them to launches; else every
    device event (clipped to the window by the caller), and the emulated device timeline's CommLog spans."""
    device = trace.device_events
    if any(e.step is not None for e in device):
        return [e for e in device if e.step == number]
    return device + [e for e in trace.events if e.lane == "comm" and e.category == COMM_CATEGORY]


def step_lanes(trace: Trace, step: int | None = None) -> dict[str, list[Interval]]:
    """Compute, comm, memory and idle intervals of one step (default: the last), in ms from its start
    (`step_window`).

    With device events in the trace (GPU kernels, copies, memsets; the emulated device timeline's compute and
    CommLog spans), the lanes are the device's: compute = the kernels that are not NCCL's, comm = NCCL's
    kernels, memory = copies and memsets. Host spans (`backward`, `optimizer.step`) only measure the time to
    enqueue work, so an NCCL kernel running while the host enqueues is not overlapped with anything (a naive
    step with no overlap on the device would show most of its communication as overlapped). Without device
    events (CPU traces) compute is, thread by thread, the compute events minus the comm events of that same
    thread (a thread blocked in a wait is not computing), then united across threads; memory is empty."""
    number = trace.step(step).number
    lo, hi = step_window(trace, number)
    if trace.device_events:
        mine = step_device_events(trace, number)
        lanes = {
            k: union(_clip([e for e in mine if e.lane == k], lo, hi)) for k in ("compute", "comm", "memory")
        }
    else:
        lanes = {"comm": union(_clip(trace.lane("comm"), lo, hi)), "memory": []}
        by_thread: dict[tuple[Any, Any], list[TraceEvent]] = collections.defaultdict(list)
        for ev in trace.events:
            if ev.lane is not None:
                by_thread[(ev.pid, ev.tid)].append(ev)
        compute: list[Interval] = []
        for evs in by_thread.values():
            busy = union(_clip([e for e in evs if e.lane == "compute"], lo, hi))
            blocked = union(_clip([e for e in evs if e.lane == "comm"], lo, hi))
            compute.extend(subtract(busy, blocked))
        lanes["compute"] = union(compute)
    lanes["idle"] = subtract([(lo, hi)], union(lanes["compute"] + lanes["comm"] + lanes["memory"]))

    def ms(intervals: list[Interval]) -> list[Interval]:
        return [((a - lo) / 1e3, (b - lo) / 1e3) for a, b in intervals]

    return {k: ms(lanes[k]) for k in ("compute", "comm", "memory", "idle")}


def overlap(trace: Trace, step: int | None = None) -> dict[str, Any]:
    """Per-step compute, comm, memory and overlapped time (ms) and overlap_pct = overlapped / comm · 100,
    overlapped being compute ∩ comm (HTA's `get_comm_comp_overlap`; memory is neither).

    `step=None` averages over every profiled step (overlap_pct from the totals); an int
    selects `ProfilerStep#<step>`. Also returns idle_ms, step_ms (the step's window) and the step numbers
    used.
    """
    numbers = [s.number for s in trace.steps] if step is None else [trace.step(step).number]
    if not numbers:
        trace.step(None)  # raises the helpful error
    totals = dict.fromkeys(("compute_ms", "comm_ms", "memory_ms", "overlapped_ms", "idle_ms", "step_ms"), 0.0)
    for n in numbers:
        lanes = step_lanes(trace, n)
        totals["compute_ms"] += _total(lanes["compute"])
        totals["comm_ms"] += _total(lanes["comm"])
        totals["memory_ms"] += _total(lanes["memory"])
        totals["overlapped_ms"] += _total(intersect(lanes["compute"], lanes["comm"]))
        totals["idle_ms"] += _total(lanes["idle"])
        lo, hi = step_window(trace, n)
        totals["step_ms"] += (hi - lo) / 1e3
    out: dict[str, Any] = {k: v / len(numbers) for k, v in totals.items()}
    out["overlap_pct"] = 100.0 * totals["overlapped_ms"] / totals["comm_ms"] if totals["comm_ms"] > 0 else 0.0
    out["steps"] = numbers
    out["rank"] = trace.rank
    return out
