"""Bounded `torch.profiler` capture, one Chrome trace per rank, with `CommLog` spans merged in.

`capture(step_fn, steps=3, warmup=1, path=...)` profiles a few steps (a schedule with
wait=0, warmup, active=steps, repeat=1: traces stay small), on CUDA too when this rank is
on a GPU (`labkit.machine.runtime.on_gpu`), and writes the spans of a `CommLog` (`commlog.py`) into
the exported JSON so that asynchronous collectives appear from issue to completion. On the
emulated cluster's virtual clock it also writes the device timeline (`device.py`). The files
are read back by `timeline.py`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from labkit import validate
from labkit.machine import runtime, timer
from labkit.trace.commlog import COMM_CATEGORY, COMM_THREAD, CommLog
from labkit.trace.device import device_trace_path, write_device_trace
from labkit.trace.timeline import STEP_END_SYNC, dump_json, load_json

__all__ = ["CLOCK_SYNC", "capture"]

CLOCK_SYNC = "labkit:clock_sync"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _trace_path(path: str | Path | None, rank: int) -> Path:
    """One file per rank: `{rank}` in `path` is filled in, a directory gets trace_rank<r>.json."""
    if path is None:
        world, local = os.environ.get("WORLD_SIZE", "1"), os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit() and world.isdigit() and int(world) > int(local):  # torchrun over several nodes
            raise ValueError(
                f"capture(path=None) on rank {rank} of a {world}-rank job over several nodes would "
                f"write to this node's {tempfile.gettempdir()}, where the other nodes' ranks cannot be "
                "read with it: pass path= a folder on a file system every node shares"
            )
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
    device_trace: bool = True,
) -> Path:
    """Profile `warmup + steps` calls of `step_fn()`, keep the last `steps`; return the trace path.

    A bounded capture (schedule wait=0, warmup, active=steps, repeat=1) with CPU activity,
    plus CUDA when this process already uses CUDA (an emulated rank on a GPU machine does
    not, and should not create a CUDA context), and record_shapes=False. Steps appear as
    `ProfilerStep#N`; a `.json.gz` path is written gzipped.
    `path`: a file, a directory, or a pattern with `{rank}`; by default
    `<tmp>/labkit_traces/trace_rank<r>.json`. Every rank of a group calls this for itself.
    `comm_log`: spans to merge into the trace (see the module docstring).
    On the emulated cluster's virtual clock, with `device_trace`, the device timeline of the
    same steps is written next to it (`labkit.trace.device.device_trace_path(path)`); the
    profiler's own bookkeeping runs on the rank's thread there and counts as compute.
    """
    validate.positive_int("capture steps", steps, "capture(step_fn, steps=3)")
    validate.non_negative_int("capture warmup", warmup, "capture(step_fn, warmup=1)")
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    out = _trace_path(path, _rank())
    out.parent.mkdir(parents=True, exist_ok=True)
    # CUDA activity where the rank's tensors are on a CUDA device: not on CI's fake CUDA machine, whose
    # tensors stay on the CPU (a CPU build's profiler fails every op's CUDA event there)
    cuda = runtime.device().type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    anchors: list[tuple[int, int]] = []  # perf_counter_ns just before and after each clock_sync
    clock = timer.virtual_clock() if device_trace else None
    windows: list[tuple[int, float, float]] = []  # (step, virtual start, virtual end)
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
        for i in range(warmup + steps):
            t0 = time.perf_counter_ns()
            with record_function(CLOCK_SYNC):
                pass
            anchors.append((t0, time.perf_counter_ns()))
            v0 = clock.now() if clock is not None else 0.0
            step_fn()
            with record_function(STEP_END_SYNC):  # analyze does not count it as the job's host sync
                runtime.synchronize()  # on a GPU the step's kernels end inside its ProfilerStep
            if clock is not None:
                windows.append((i, v0, clock.now()))
            with _without_kineto_log():
                prof.step()
    finally:
        with _without_kineto_log():
            prof.__exit__(None, None, None)

    if comm_log is not None:
        _merge_comm_log(out, comm_log, anchors[warmup:])
    if clock is not None:
        write_device_trace(device_trace_path(out), clock, windows[warmup:], _rank())
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
    data = load_json(path)
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
    dump_json(path, data)
