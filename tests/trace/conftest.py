"""What the trace tests share: small synthetic traces written by hand, in the profiler's trace shape."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

MS = 1000.0  # trace times are in microseconds


def _x(name, cat, start_ms, dur_ms, tid=1, **args):
    e = {"ph": "X", "name": name, "cat": cat, "pid": 0, "tid": tid, "ts": start_ms * MS, "dur": dur_ms * MS}
    if args:
        e["args"] = args
    return e


def _write(path: Path, events, rank: int) -> Path:
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": rank}}))
    return path


def _step(n=0, start=0.0, dur=10.0):
    return _x(f"ProfilerStep#{n}", "user_annotation", start, dur)


def _emulated(tmp: Path, rank: int, compute, colls, phases=(), host_ops=(), host_step_ms=10.0) -> None:
    """A host trace plus its device timeline, one 10 ms step: compute intervals (ms), collectives
    (name, start, end, bytes), phases (name, start, end) and host ops (name, start, duration); the host's
    step lasts `host_step_ms` of its wall clock."""
    dev = [_step()] + [_x("compute", "kernel", a, b - a) for a, b in compute]
    dev += [_x(f"comm:{n}", "labkit_comm", a, b - a, tid=2, bytes=nb) for n, a, b, nb in colls]
    dev += [_x(f"phase:{n}", "labkit_phase", a, b - a, tid=3) for n, a, b in phases]
    _write(tmp / f"trace_rank{rank}.device.json", dev, rank)
    host = [_step(dur=host_step_ms)] + [_x(n, "cpu_op", a, d) for n, a, d in host_ops]
    _write(tmp / f"trace_rank{rank}.json", host, rank)


@pytest.fixture
def traces() -> SimpleNamespace:
    """Writers of synthetic traces: `x` (one complete event, times in ms), `step` (a ProfilerStep), `write`
    (a trace file of a rank) and `emulated` (a rank's host trace and emulated device timeline)."""
    return SimpleNamespace(x=_x, step=_step, write=_write, emulated=_emulated)
