"""Where each rank's step went, read from its traces: compute, communication, waiting, data, host syncs.

`analyze(traces)` takes one run's per-rank traces (a directory written by `capture`, or a list of paths) and
returns, per rank, a `RankBreakdown` of a typical profiled step (the median over steps). It reads whichever
timeline is closest to the device:

* **emulated device timeline** (`*.device.json`, the virtual clock): compute is the time the rank did
  not wait, communication each collective from issue to completion, phases (`phases.py`) named spans;
* **GPU kernels** in a host trace: compute is the union of non-NCCL kernels, communication the NCCL
  kernels, memory the copies and memsets (neither), each kernel in the step that launched it
  (`timeline.step_window`), so host-side spans that only enqueue work (`backward`, `optimizer.step`)
  never count as overlap; each NCCL kernel is one of the step's collectives (`step_collectives`), its
  size from the arguments Kineto copies onto it from the launching `record_param_comms` ("In msg
  nelems", "Out msg nelems", "dtype": `collective_bytes`);
* **CPU host trace** alone: the lanes of `timeline.step_lanes`; each `gloo:*` span (gloo's own thread runs
  the transfer, with its real duration: `commlog.py`) is one of the step's collectives.

From the host trace it also takes the operators with the most self time, data loading (`data_loading.py`:
PyTorch's "enumerate(DataLoader)#..." spans, Python work outside any operator before the forward, and
`phase("data...")`; on the emulated device timeline, where the job named none with `phase`, the host's share
of its step carried over to the device step) and host synchronisations (`aten::item`,
`aten::_local_scalar_dense`, `cuda*Synchronize`; not capture's own wait at the end of each step,
`STEP_END_SYNC`). HolisticTraceAnalysis is not needed (it fails on
CPU-only traces). `diagnose.py` turns the breakdown into a verdict.
"""

from __future__ import annotations

import collections
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.trace.commlog import COMM_CATEGORY
from labkit.trace.data_loading import DATA_PREFIXES, data_time
from labkit.trace.phases import PHASE_CATEGORY
from labkit.trace.timeline import (
    STEP_END_SYNC,
    Trace,
    TraceEvent,
    load_json,
    read_trace,
    step_device_events,
    step_lanes,
    step_window,
    subtract,
    union,
)

__all__ = ["Collective", "RankBreakdown", "analyze", "collective_bytes", "read_timelines", "trace_files"]

Interval = tuple[float, float]

HOST_SYNC_OPS = (
    "aten::item",
    "aten::_local_scalar_dense",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
)
# Bytes per element of the "dtype" Kineto writes for a collective (c10's ScalarType names)
_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2,
    "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
}


def collective_bytes(args: dict[str, Any] | None) -> int | None:
    """A collective's size in bytes from its trace event's arguments: labkit's own "bytes", or Kineto's
    element counts and dtype (the larger of the input and the output message: an all-gather's whole
    output, as nccl-tests counts it). None where the trace does not say."""
    if not args:
        return None
    if isinstance(args.get("bytes"), int):
        return args["bytes"]
    counts = [args.get(k) for k in ("In msg nelems", "Out msg nelems")]
    counts = [c for c in counts if isinstance(c, int) and not isinstance(c, bool)]
    size = _DTYPE_BYTES.get(str(args.get("dtype")))
    if not counts or size is None:
        return None
    return max(counts) * size


@dataclass(frozen=True)
class Collective:
    """One collective of a profiled step (ms from the step's start)."""

    name: str
    start_ms: float
    end_ms: float
    nbytes: int | None
    waited_ms: float  # how long the rank was blocked while it was in flight
    compute_before_ms: float  # the rank's compute before it was issued, in the same step
    compute_after_ms: float  # the rank's compute after it ended, in the same step
    overlapped_ms: float  # the rank's compute while it was in flight


@dataclass
class RankBreakdown:
    """One rank's profiled steps, per step (ms; the median over the profiled steps)."""

    rank: int
    source: str  # "emulated device timeline", "GPU kernels" or "CPU host trace"
    steps: int
    step_ms: float
    compute_ms: float  # less data loading and host syncs
    comm_ms: float  # collectives in flight (union)
    wait_ms: float  # blocked or idle: the step less compute
    exposed_comm_ms: float  # communication not hidden under compute
    data_ms: float  # loading data in the training process: DataLoader spans, Python work before the forward
    host_sync_ms: float
    host_syncs: float  # host synchronisations per step
    collectives: float  # per step
    comm_bytes: float  # per step (0 when the trace does not say)
    top_ops: list[tuple[str, float]] = field(default_factory=list)  # (operator, self ms per step)
    step_collectives: list[Collective] = field(default_factory=list)  # of the last profiled step
    memory_ms: float = 0.0  # the device's copies and memsets (union), neither compute nor communication
    host_python_ms: float = 0.0  # of data_ms: Python work outside any torch operator before the forward
    note: str = ""  # how the trace was read, where not the usual way (`timeline.Trace.note`)

    @property
    def overlap_pct(self) -> float:
        """Share of communication time hidden under compute."""
        return 100.0 * (1 - self.exposed_comm_ms / self.comm_ms) if self.comm_ms > 0 else 0.0


_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def _rank_of(path: Path) -> int | None:
    """The rank a trace file is of: the `distributedInfo` Kineto writes in it, else its name (`rank3`,
    `rank-3`, `rank_3`), else None."""
    try:
        data = load_json(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable trace: {exc}") from None
    info = data.get("distributedInfo") if isinstance(data, dict) else None
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def _listed(traces: str | Path | Sequence[str | Path]) -> list[Path]:
    """The trace files of a directory (sorted), or the paths given; each must exist."""
    if isinstance(traces, (str, Path)):
        root = Path(traces)
        if not root.is_dir():
            raise ValueError(
                f"{root} is not a directory of traces; pass the folder capture wrote, or a list of paths"
            )
        paths = sorted(p for p in root.iterdir() if p.name.endswith((".json", ".json.gz")))
    else:
        paths = [Path(p) for p in traces]
    if not paths:
        raise ValueError(f"no trace files in {traces!r}: capture a run first (labkit.trace.capture)")
    for p in paths:
        if not p.exists():
            raise ValueError(f"{p} does not exist")
    return paths


def trace_files(traces: str | Path | Sequence[str | Path]) -> list[tuple[int, Path | None, Path | None]]:
    """(rank, host trace, device trace) of one run: from a directory, or a list of trace paths. Each file's
    rank is `_rank_of`'s; one file without a rank is rank 0; two files of one rank, or several where one has
    no rank, are an error naming them."""
    from labkit.trace.device import device_trace_path

    paths = _listed(traces)
    ranks = {p: _rank_of(p) for p in paths}
    unknown = [str(p) for p, r in ranks.items() if r is None]
    if unknown and len(paths) > 1:
        raise ValueError(
            f"no rank in {', '.join(unknown)} (no distributedInfo, no rank in the name) among {len(paths)} "
            "traces: name each file after its rank (trace_rank0.json) or pass one trace"
        )
    by_rank: dict[int, list[Path | None]] = {}
    for p in paths:
        slot = 1 if ".device." in p.name else 0
        entry = by_rank.setdefault(ranks[p] or 0, [None, None])
        if entry[slot] is not None:
            kind = "device timeline" if slot else "trace"
            raise ValueError(
                f"{entry[slot]} and {p} are both rank {ranks[p] or 0}'s {kind}: pass one run's traces, one "
                "file per rank"
            )
        entry[slot] = p
    for entry in by_rank.values():
        if entry[0] is not None and entry[1] is None and device_trace_path(entry[0]).exists():
            entry[1] = device_trace_path(entry[0])
    return [(r, h, d) for r, (h, d) in sorted(by_rank.items())]


def _total(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _clip(events: list[TraceEvent], lo: float, hi: float) -> list[Interval]:
    return [(max(e.start_us, lo), min(e.end_us, hi)) for e in events if e.end_us > lo and e.start_us < hi]


def _self_times(host: Trace, lo: float, hi: float) -> dict[str, float]:
    """Self time (us) of each CPU operator within [lo, hi]: its time less its children's, thread by thread."""
    out: dict[str, float] = collections.defaultdict(float)
    by_thread: dict[Any, list[TraceEvent]] = collections.defaultdict(list)
    for e in host.events:
        if e.category == "cpu_op" and lo <= e.start_us < hi:
            by_thread[(e.pid, e.tid)].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.start_us, -e.dur_us))
        stack: list[list[Any]] = []  # [event, children time]
        for e in evs:
            while stack and stack[-1][0].end_us <= e.start_us:
                done, child = stack.pop()
                out[done.name] += done.dur_us - child
            if stack:
                stack[-1][1] += e.dur_us
            stack.append([e, 0.0])
        for done, child in stack:
            out[done.name] += done.dur_us - child
    return out


def _host_syncs(host: Trace | None, lo: float, hi: float) -> list[Interval]:
    """The job's host synchronisations in [lo, hi]: not the ones inside capture's own `STEP_END_SYNC`."""
    if host is None:
        return []
    own = [(e.pid, e.tid, e.start_us, e.end_us) for e in host.events if e.name == STEP_END_SYNC]
    hits = [
        e
        for e in host.events
        if e.name in HOST_SYNC_OPS
        and not any(p == e.pid and t == e.tid and a <= e.start_us and e.end_us <= b for p, t, a, b in own)
    ]
    return union(_clip(hits, lo, hi))


def _collectives(
    events: list[TraceEvent], compute: list[Interval], lo: float, hi: float, prefix: str = ""
) -> list[Collective]:
    """Each collective of a step [lo, hi) (an emulated CommLog span or an NCCL kernel) against the step's
    compute intervals: how long it ran with nothing computed beside it, the compute before and after it."""
    waits = subtract([(lo, hi)], compute)
    out = []
    for e in sorted(events, key=lambda e: e.start_us):
        start, end = e.start_us, e.end_us
        waited = _total([(max(a, start), min(b, end)) for a, b in waits if b > start and a < end])
        after = _total(subtract(compute, [(lo, end)]))
        before = _total(subtract(compute, [(start, hi)]))
        during = _total(compute) - before - after
        out.append(
            Collective(
                e.name.removeprefix(prefix),
                (start - lo) / 1e3,
                (end - lo) / 1e3,
                collective_bytes(e.args),
                waited / 1e3,
                before / 1e3,
                after / 1e3,
                during / 1e3,
            )
        )
    return out


def _host_to_device(host: Trace, step, comm_events: list, lo: float, hi: float) -> float:
    """Device microseconds per host microsecond of the rank's own work in one step.

    From the step's start to its first collective the rank only computes, on both clocks, so the ratio of
    the two spans maps the work before it (data loading is there) without the wall-clock waits later in the
    step, which two ranks sharing a core stretch at random. Without a collective, the whole step's ratio.
    """
    host_lo = step.start_us
    first_host = min(
        (e.start_us for e in host.lane("comm") if host_lo <= e.start_us < step.end_us), default=None
    )
    first_dev = min((e.start_us for e in comm_events), default=None)
    if first_host is not None and first_dev is not None and first_host > host_lo and first_dev > lo:
        return (first_dev - lo) / (first_host - host_lo)
    return (hi - lo) / max(step.end_us - host_lo, 1e-9)


def _device_breakdown(dev: Trace, host: Trace | None, rank: int) -> RankBreakdown:
    """From the emulated device timeline (virtual time), with names from the host trace."""
    rows = []
    for i, s in enumerate(dev.steps):
        lo, hi = s.start_us, s.end_us
        compute = union(_clip([e for e in dev.events if e.name == "compute"], lo, hi))
        comm_events = [e for e in dev.events if e.category == COMM_CATEGORY and lo <= e.start_us < hi]
        comm = union(_clip(comm_events, lo, hi))
        waits = subtract([(lo, hi)], compute)
        phases = [e for e in dev.events if e.category == PHASE_CATEGORY and lo <= e.start_us < hi]
        data_us = _total(union(_clip([e for e in phases if e.name.startswith(DATA_PREFIXES)], lo, hi)))
        colls = _collectives(comm_events, compute, lo, hi, "comm:")
        host_step = host.steps[i] if host is not None and i < len(host.steps) else None
        syncs = _host_syncs(host, host_step.start_us, host_step.end_us) if host_step else []
        # The host trace is on the wall clock, the device timeline on the virtual one: what the host did is
        # carried over to the device step at the rank's own ratio of the two (on a simulated GPU the wall
        # clock is FakeTensor dispatch, tens of times the modelled step: an optimizer's .item() on its CPU
        # step counters, which costs a GPU nothing, read 105 % of the capstone's step there unscaled)
        scale = _host_to_device(host, host_step, comm_events, lo, hi) if host_step is not None else 1.0
        python_us = 0.0
        if host_step is not None and not data_us:
            # Data loading the job did not name: what PyTorch records on the host (data_loading.py), carried
            # over to the device step (the virtual clock charges that work as compute, in its own time)
            found = data_time(host, host_step)
            data_us, python_us = _total(found.intervals) * scale, found.python_us * scale
        rows.append(
            dict(
                step=(hi - lo) / 1e3,
                compute=max(0.0, _total(compute) - data_us) / 1e3,
                comm=_total(comm) / 1e3,
                wait=_total(waits) / 1e3,
                exposed=_total(subtract(comm, compute)) / 1e3,
                data=data_us / 1e3,
                python=python_us / 1e3,
                sync=_total(syncs) * scale / 1e3,
                nsync=len(syncs),
                colls=colls,
                bytes=sum(c.nbytes or 0 for c in colls),
                host_step=host_step,
            )
        )
    return _combine(rank, "emulated device timeline", rows, host)


def _host_breakdown(host: Trace, rank: int) -> RankBreakdown:
    """From a host trace: the device's events when there are any (GPU kernels, copies, memsets), each step
    its own (`timeline.step_window`), else the CPU lanes."""
    gpu = bool(host.device_events)
    source = "GPU kernels" if gpu else "CPU host trace"
    rows = []
    for s in host.steps:
        lo, hi = step_window(host, s.number)
        lanes = {
            k: [(lo + a * 1e3, lo + b * 1e3) for a, b in v] for k, v in step_lanes(host, s.number).items()
        }
        compute, comm = lanes["compute"], lanes["comm"]
        colls: list[Collective] = []
        if gpu:  # NCCL's kernels are the collectives (one per collective, or per group of them)
            mine = step_device_events(host, s.number)
            nccl = [e for e in mine if e.lane == "comm" and lo <= e.start_us < hi]
            colls = _collectives(nccl, compute, lo, hi)
            ncoll = len(colls)
        else:
            in_step = [e for e in host.lane("comm") if lo <= e.start_us < hi]
            # gloo's transfers, timed on its own threads: each against the compute of every thread
            colls = _collectives([e for e in in_step if e.name.startswith("gloo:")], compute, lo, hi)
            comm_events = [e for e in in_step if e.category == COMM_CATEGORY]
            ncoll = len(colls) or len(comm_events) or len([e for e in in_step if e.name.startswith("c10d::")])
        found = data_time(host, s)  # the host's own spans and Python work: host time
        data = found.intervals
        syncs = _host_syncs(host, s.start_us, s.end_us)
        busy = union(compute + comm + lanes["memory"])
        rows.append(
            dict(
                step=(hi - lo) / 1e3,
                compute=max(0.0, _total(compute) - (0 if gpu else _total(data))) / 1e3,
                comm=_total(comm) / 1e3,
                memory=_total(lanes["memory"]) / 1e3,
                wait=_total(subtract([(lo, hi)], busy if gpu else compute)) / 1e3,
                exposed=_total(subtract(comm, compute)) / 1e3,
                data=_total(data) / 1e3,
                python=found.python_us / 1e3,
                sync=_total(syncs) / 1e3,
                nsync=len(syncs),
                colls=colls,
                ncoll=ncoll,
                bytes=sum(c.nbytes or 0 for c in colls),
                host_step=s,
            )
        )
    return _combine(rank, source, rows, host)


def _combine(rank: int, source: str, rows: list[dict], host: Trace | None) -> RankBreakdown:
    if not rows:
        raise ValueError(
            f"rank {rank}'s trace has no ProfilerStep#N windows; capture it with labkit.trace.capture"
        )
    n = len(rows)

    def mean(
        key: str,
    ) -> float:  # the median over steps: one step with a slow moment of the host does not count
        return statistics.median(r[key] for r in rows)

    top: dict[str, float] = collections.defaultdict(float)
    if host is not None:
        for r in rows:
            if r["host_step"] is not None:
                for name, us in _self_times(host, r["host_step"].start_us, r["host_step"].end_us).items():
                    top[name] += us / 1e3 / n
    ncoll = [r.get("ncoll", len(r["colls"])) for r in rows]
    return RankBreakdown(
        rank=rank,
        source=source,
        steps=n,
        step_ms=statistics.median(r["step"] for r in rows),
        compute_ms=mean("compute"),
        comm_ms=mean("comm"),
        wait_ms=mean("wait"),
        exposed_comm_ms=mean("exposed"),
        data_ms=mean("data"),
        host_python_ms=mean("python"),
        host_sync_ms=mean("sync"),
        host_syncs=mean("nsync"),
        collectives=sum(ncoll) / n,
        comm_bytes=mean("bytes"),
        top_ops=sorted(top.items(), key=lambda kv: -kv[1])[:8],
        step_collectives=rows[-1]["colls"],
        memory_ms=mean("memory") if "memory" in rows[0] else 0.0,
        note=host.note if host is not None else "",
    )


def analyze(traces: str | Path | Sequence[str | Path]) -> list[RankBreakdown]:
    """Per rank (in rank order), where its profiled steps went; see the module docstring."""
    out = []
    for rank, host_path, dev_path in trace_files(traces):
        host = read_trace(host_path, rank=rank) if host_path is not None else None
        if dev_path is not None:
            out.append(_device_breakdown(read_trace(dev_path, rank=rank), host, rank))
        else:
            out.append(_host_breakdown(host, rank))
    return out


def read_timelines(traces: str | Path | Sequence[str | Path]) -> list[Trace]:
    """Every rank's device timeline of one run (`labkit.trace.device.read_timeline`), in rank order: what
    `plot_timeline` draws."""
    return [
        read_trace(dev if dev is not None else host, rank=rank) for rank, host, dev in trace_files(traces)
    ]
