"""Profiler capture and a small reader of Chrome traces: compute vs communication per step.

HolisticTraceAnalysis needs GPU kernels and fails on CPU-only traces, so this module reads
the Chrome trace JSON that `torch.profiler` exports itself. Every event lands in one lane:

* **compute**: `cpu_op` and `user_annotation` events (aten ops, autograd nodes, your own
  `record_function` regions) and GPU kernels, minus the time a thread spends inside a
  communication event (a `comm:wait` region nested in a `backward` region is waiting,
  not computing);
* **comm**: `c10d::*`, `gloo:*`, `nccl:*`, `record_param_comms`, `ncclKernel*` /
  `ncclDevKernel*` GPU kernels, `comm:*` regions, anything on a gloo or NCCL thread, and
  the issue-to-completion spans of a `CommLog` (below);
* **idle**: the rest of the step (`ProfilerStep#N`).

What the profiler shows for an *asynchronous* collective (measured, torch 2.13 CPU build,
gloo, 2 ranks, a 16 MB `dist.all_reduce(async_op=True)` overlapped with matmuls):

* the calling thread gets only `c10d::allreduce_`, about 60 us: the *issue*;
* the transfer is a `gloo:all_reduce` `user_annotation` on a `pt_gloo_runloop` thread with
  its real duration (96 ms, starting 3.7 ms after the issue), and gloo alternates between
  two such threads;
* `work.wait()` leaves no event at all;
* a `record_function` entered on the issuing thread and exited in the work's completion
  callback (another thread) is recorded with a wrong duration (199.9 ms for a collective
  that took 99.6 ms), so a profiler region cannot span issue to completion.

With plain gloo the `gloo:*` events are therefore enough. With the emulated interconnect
(`labkit.emulate`) they are not: gloo finishes the real transfer, and the work completes
later, when the link model says so (that Python process group also leaves no
`c10d::allreduce_` event on the calling thread; the inner `gloo:all_reduce` events remain).
The convention, which works for both:

1. code that issues a collective logs it in a `CommLog`: `log.track(work, name, nbytes,
   start_ns=t0)` records the issue time now and the completion time in a callback on
   `work.get_future()`, both on `time.perf_counter_ns()`; `labkit.comm.OverlappedDDP`
   and `allreduce_gradients_naive` do this;
2. `capture(step_fn, comm_log=log)` puts a `labkit:clock_sync` region at the start of each
   step, which maps `perf_counter` to the profiler's clock (the two clocks differ), and
   writes the log's spans into the exported JSON as `comm:<name>` events (category
   `labkit_comm`) on their own "labkit comm" thread, so the file alone tells the story and
   opens as such in Perfetto or chrome://tracing;
3. `read_trace` puts those events in the comm lane.

A completion time is taken in the future's callback, which torch runs just after it wakes
the waiters: it can be late by the completing thread's scheduling delay (about 1 ms
measured on a busy 2-core machine, where a span ended 1 ms after `wait()` had returned).

On CUDA an NCCL work's future completes when the kernel is *enqueued*
(`ProcessGroupNCCL::collective` calls `future_->markCompleted` right after the launch; it
is a CUDA-aware future), so `CommLog` skips CUDA collectives: there the NCCL kernels in
the trace are the comm lane.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CommLog",
    "CommSpan",
    "Step",
    "Trace",
    "TraceEvent",
    "capture",
    "classify",
    "overlap",
    "plot_timeline",
    "read_trace",
    "step_lanes",
]

CLOCK_SYNC = "labkit:clock_sync"
COMM_CATEGORY = "labkit_comm"
COMM_THREAD = "labkit comm (issue to completion)"

Interval = tuple[float, float]


# ------------------------------------------------------------------ communication log


@dataclass(frozen=True)
class CommSpan:
    """One collective from issue to completion, on `time.perf_counter_ns()`."""

    name: str
    start_ns: int
    end_ns: int
    nbytes: int = 0

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class CommLog:
    """Thread-safe record of collectives (issue time, completion time), newest `maxlen` kept.

    Completion callbacks run on the thread that completes the work (a gloo or emulated-link
    thread), hence the lock.
    """

    def __init__(self, maxlen: int = 10_000) -> None:
        self._spans: collections.deque[CommSpan] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, name: str, start_ns: int, end_ns: int, nbytes: int = 0) -> None:
        """Record a collective whose start and end you measured yourself."""
        with self._lock:
            self._spans.append(CommSpan(name, int(start_ns), int(end_ns), int(nbytes)))

    def track(
        self,
        work: Any,
        name: str,
        nbytes: int = 0,
        *,
        start_ns: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.futures.Future | None:
        """Record `work` from `start_ns` (default: now) until its future completes.

        Take `start_ns = time.perf_counter_ns()` just before issuing the collective. Returns
        a future that completes once the span is in the log: `work.wait()` can return a
        moment before the completion callback has run, so wait on this one too before
        reading the log. CUDA collectives are skipped and give None (their future completes
        at enqueue; the trace's NCCL kernels have the real times).
        """
        if device is not None and torch.device(device).type == "cuda":
            return None
        t0 = time.perf_counter_ns() if start_ns is None else int(start_ns)

        def done(fut: torch.futures.Future) -> None:
            self.add(name, t0, time.perf_counter_ns(), nbytes)
            fut.wait()  # re-raise a failed collective's error to whoever waits on us

        return work.get_future().then(done)

    def spans(self) -> list[CommSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._spans)


# --------------------------------------------------------------------------- capture


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _trace_path(path: str | Path | None, rank: int) -> Path:
    """One file per rank: `{rank}` in `path` is filled in, a directory gets trace_rank<r>.json."""
    if path is None:
        return Path(tempfile.gettempdir()) / "labkit_traces" / f"trace_rank{rank}.json"
    text = str(path)
    if "{rank}" in text:
        return Path(text.format(rank=rank))
    p = Path(text)
    if p.is_dir() or p.suffix == "":
        return p / f"trace_rank{rank}.json"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return p.with_name(f"{p.stem}_rank{rank}{p.suffix}")
    return p


def capture(
    step_fn: Callable[[], Any],
    *,
    steps: int = 3,
    warmup: int = 1,
    path: str | Path | None = None,
    comm_log: CommLog | None = None,
) -> Path:
    """Profile `warmup + steps` calls of `step_fn()`, keep the last `steps`; return the trace path.

    A bounded capture (schedule wait=0, warmup, active=steps, repeat=1) with CPU activity,
    plus CUDA when this process already uses CUDA (an emulated rank on a GPU machine does
    not, and should not create a CUDA context), and record_shapes=False. Steps appear as
    `ProfilerStep#N`; a `.json.gz` path is written gzipped.
    `path`: a file, a directory, or a pattern with `{rank}`; by default
    `<tmp>/labkit_traces/trace_rank<r>.json`. Every rank of a group calls this for itself.
    `comm_log`: spans to merge into the trace (see the module docstring).
    """
    if steps < 1:
        raise ValueError(f"capture(steps={steps}): need at least one profiled step; use steps=3.")
    if warmup < 0:
        raise ValueError(f"capture(warmup={warmup}): warmup must be >= 0; use warmup=1.")
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    out = _trace_path(path, _rank())
    out.parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    anchors: list[tuple[int, int]] = []  # perf_counter_ns just before and after each clock_sync
    prof = profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(out)),
        record_shapes=False,
    )
    # The profiler starts and stops inside enter, step() and exit; only those are muted.
    with _without_kineto_log():
        prof.__enter__()
    try:
        for _ in range(warmup + steps):
            t0 = time.perf_counter_ns()
            with record_function(CLOCK_SYNC):
                pass
            anchors.append((t0, time.perf_counter_ns()))
            step_fn()
            if cuda:
                torch.cuda.synchronize()  # the step's kernels end inside its ProfilerStep
            with _without_kineto_log():
                prof.step()
    finally:
        with _without_kineto_log():
            prof.__exit__(None, None, None)

    if comm_log is not None:
        _merge_comm_log(out, comm_log, anchors[warmup:])
    return out


_KINETO_LOG_PREFIXES = ("USDT:", "STAGE:")


@contextlib.contextmanager
def _without_kineto_log() -> Iterator[None]:
    """Drop the lines kineto writes to file descriptor 2 when the profiler starts or stops.

    torch 2.13's kineto prints "USDT:... profiler_start" / "profiler_stop" there (and, with
    KINETO_LOG_LEVEL set, "STAGE:..." lines) each time the profiler starts or stops, on
    every rank; in a notebook they fill the output of `labkit.launch`. Every other line is
    written back to descriptor 2 when the block ends.
    """
    fd = 2  # kineto writes to the process's file descriptor 2, whatever sys.stderr is
    try:
        saved = os.dup(fd)
    except OSError:  # no descriptor 2: nothing to filter
        yield
        return
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [
                line
                for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                if not line.startswith(_KINETO_LOG_PREFIXES)
            ]
            if kept:
                os.write(fd, "".join(kept).encode())


def _merge_comm_log(path: Path, comm_log: CommLog, anchors: list[tuple[int, int]]) -> None:
    """Write the log's spans that fall inside the trace into it, on the profiler's clock."""
    data = _load_json(path)
    events = data["traceEvents"]
    syncs = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("name") == CLOCK_SYNC), key=lambda e: e["ts"]
    )
    if not syncs or len(syncs) != len(anchors):
        raise RuntimeError(
            f"{path}: found {len(syncs)} '{CLOCK_SYNC}' events for {len(anchors)} profiled steps; "
            "cannot align the CommLog with the profiler clock."
        )
    # offset (us) = profiler time - perf_counter time; the narrowest anchor is the most precise.
    best = min(range(len(anchors)), key=lambda i: anchors[i][1] - anchors[i][0])
    sync, (a0, a1) = syncs[best], anchors[best]
    offset_us = (sync["ts"] + sync["dur"] / 2) - (a0 + a1) / 2 / 1e3
    lo = min(e["ts"] for e in syncs)
    hi = max(e["ts"] + e.get("dur", 0) for e in events if e.get("ph") == "X" and "ts" in e)
    pid = sync["pid"]
    events.append(
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": COMM_THREAD, "args": {"name": COMM_THREAD}}
    )
    for s in comm_log.spans():
        ts = s.start_ns / 1e3 + offset_us
        end = s.end_ns / 1e3 + offset_us
        if not lo <= ts <= hi:  # a span belongs to the step that issued it
            continue
        events.append(
            {
                "ph": "X",
                "cat": COMM_CATEGORY,
                "name": f"comm:{s.name}",
                "pid": pid,
                "tid": COMM_THREAD,
                "ts": ts,
                "dur": end - ts,
                "args": {"bytes": s.nbytes},
            }
        )
    _dump_json(path, data)


def _load_json(path: Path) -> Any:
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def _dump_json(path: Path, data: Any) -> None:
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            json.dump(data, f)
    else:
        path.write_text(json.dumps(data))


# ------------------------------------------------------------------------ reading


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
    data = _load_json(path)
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
        events.append(TraceEvent(name, cat, start, dur, e.get("tid"), e.get("pid"), lane))
    events.sort(key=lambda ev: ev.start_us)
    return Trace(path, events, sorted(steps.values(), key=lambda s: s.number), rank, thread_names)


# ------------------------------------------------------------------ interval math


def _union(intervals: Iterable[Interval]) -> list[Interval]:
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


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
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


def step_lanes(trace: Trace, step: int | None = None) -> dict[str, list[Interval]]:
    """Compute, comm and idle intervals of one step (default: the last), in ms from its start.

    compute is, thread by thread, the compute events minus the comm events of that same
    thread (a thread blocked in a wait is not computing), then united across threads.
    """
    s = trace.step(step)
    lo, hi = s.start_us, s.end_us
    comm = _union(_clip(trace.lane("comm"), lo, hi))
    by_thread: dict[tuple[Any, Any], list[TraceEvent]] = collections.defaultdict(list)
    for ev in trace.events:
        if ev.lane is not None:
            by_thread[(ev.pid, ev.tid)].append(ev)
    compute: list[Interval] = []
    for evs in by_thread.values():
        busy = _union(_clip([e for e in evs if e.lane == "compute"], lo, hi))
        blocked = _union(_clip([e for e in evs if e.lane == "comm"], lo, hi))
        compute.extend(_subtract(busy, blocked))
    compute = _union(compute)
    idle = _subtract([(lo, hi)], _union(compute + comm))

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


# -------------------------------------------------------------------------- figure


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
