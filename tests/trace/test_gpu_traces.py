"""labkit.trace on GPU-shaped traces written here (Kineto's shapes: kernels tied to their launch by
`correlation`, copies and memsets, several streams, sub-microsecond timestamps, no ProfilerStep, the rank in
`distributedInfo`), each against the figure Holistic Trace Analysis's definitions give (worked by hand in the
comments). The agreement with HTA itself on its public test traces is in the note of issue 25."""

from __future__ import annotations

import json

import pytest

from labkit.trace import analyze, read_trace, step_lanes, temporal_breakdown
from labkit.trace.analyze import trace_files
from labkit.trace.timeline import overlap, step_window

MS = 1000.0  # the traces' unit is the microsecond


def _x(name, cat, start_ms, dur_ms, **args):
    e = {"ph": "X", "name": name, "cat": cat, "pid": 0, "tid": 1, "ts": start_ms * MS, "dur": dur_ms * MS}
    if args:
        e["args"] = args
    return e


def _launch(corr, at_ms):
    return _x("cudaLaunchKernel", "cuda_runtime", at_ms, 0.01, correlation=corr)


def _kernel(name, start_ms, dur_ms, corr=None, stream=7, cat="kernel"):
    args = {"stream": stream, "device": 0}
    if corr is not None:
        args["correlation"] = corr
    return {**_x(name, cat, start_ms, dur_ms), "pid": 1, "tid": stream, "args": args}


def _write(path, events, rank=0, info=True):
    data = {"traceEvents": events}
    if info:
        data["distributedInfo"] = {"rank": rank, "world_size": 2, "backend": "nccl"}
    path.write_text(json.dumps(data))
    return path


def test_a_lagging_gpu_keeps_each_kernel_in_the_step_that_launched_it(tmp_path):
    # The host runs ahead: step 0 (host 0-10 ms) launches a 6 ms kernel that runs 12-18, while the host is
    # already in step 1 (10-20), which launches one that runs 18-24. Clipped to the host windows, step 0
    # would have no GPU work and step 1 all of it; by launch, each step has its own 6 ms.
    events = [
        _x("ProfilerStep#0", "user_annotation", 0, 10),
        _x("ProfilerStep#1", "user_annotation", 10, 10),
        _launch(1, 1),
        _launch(2, 11),
        _kernel("sm90_gemm", 12, 6, corr=1),
        _kernel("sm90_gemm", 18, 6, corr=2),
    ]
    t = read_trace(_write(tmp_path / "trace.json", events))
    assert [e.step for e in t.device_events] == [0, 1]
    # step 0's device window: its host start to its kernel's end; step 1's: from there to its kernel's end
    assert step_window(t, 0) == (0, 18 * MS) and step_window(t, 1) == (18 * MS, 24 * MS)
    assert step_lanes(t, 0)["compute"] == [(12, 18)] and step_lanes(t, 1)["compute"] == [(0, 6)]
    assert step_lanes(t, 1)["idle"] == []
    (b,) = analyze([tmp_path / "trace.json"])
    assert (b.compute_ms, b.step_ms) == (6, 12)  # medians of (6, 6) and (18, 6)
    # HTA leaves the last step out: over step 0 alone, 6 ms of compute and no idle
    tb = temporal_breakdown(t)
    assert (tb.steps, tb.span_ms, tb.idle_ms, tb.compute_ms) == ([0], 6, 0, 6)
    assert temporal_breakdown(t, steps=[0, 1]).span_ms == 12


def test_copies_and_memsets_are_memory_neither_compute_nor_communication(tmp_path):
    # compute 0-4, NCCL 2-5, a copy 4-6, a memset 6-7 (and a kernel named Memcpy*, HTA's MEMORY class)
    events = [
        _x("ProfilerStep#0", "user_annotation", 0, 8),
        _kernel("sm90_gemm", 0, 4),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2, 3, stream=20),
        _kernel("Memcpy DtoD (Device -> Device)", 4, 2, cat="gpu_memcpy", stream=9),
        _kernel("Memset (Device)", 6, 1, cat="gpu_memset", stream=9),
        _kernel("Memcpy HtoD (Pinned -> Device)", 7, 0.5, stream=9),
    ]
    t = read_trace(_write(tmp_path / "trace.json", events))
    assert [e.lane for e in t.device_events] == ["compute", "comm", "memory", "memory", "memory"]
    lanes = step_lanes(t, 0)
    assert lanes["memory"] == [(4, 7.5)] and lanes["compute"] == [(0, 4)] and lanes["idle"] == [(7.5, 8)]
    tb = temporal_breakdown(t, steps=[0])
    # span 0-7.5; compute 4 (53.3 %), comm 3 (40 %), memory 3.5; overlap: compute with comm 2-4 = 2 of 3 ms,
    # the NCCL kernel's 4-5 under the copy counts for nothing (memory is neither)
    assert (tb.span_ms, tb.idle_ms, tb.compute_ms, tb.comm_ms, tb.memory_ms) == (7.5, 0, 4, 3, 3.5)
    assert tb.pct("compute") == pytest.approx(53.33, abs=0.01)
    assert tb.overlap_pct == pytest.approx(66.67, abs=0.01)
    assert overlap(t, 0)["overlap_pct"] == pytest.approx(66.67, abs=0.01)
    assert overlap(t, 0)["memory_ms"] == 3.5
    (b,) = analyze([tmp_path / "trace.json"])
    assert (b.compute_ms, b.memory_ms, b.wait_ms) == (4, 3.5, 0.5)


def test_several_streams_and_sub_microsecond_times(tmp_path):
    # two compute streams 0-5 and 3-6 (union 6), NCCL 4-8 (overlapped 4-6: 50 %); and a step of kernels a
    # fraction of a microsecond long, as Kineto's nanosecond timestamps write them (ts in us, 3 decimals)
    events = [
        _x("ProfilerStep#0", "user_annotation", 0, 9),
        _kernel("sm90_gemm", 0, 5, stream=7),
        _kernel("elementwise_kernel", 3, 3, stream=9),
        _kernel("ncclDevKernel_AllGather_RING_LL", 4, 4, stream=20),
        _x("ProfilerStep#1", "user_annotation", 9, 0.01),
        {**_kernel("tiny", 9.0001, 0.0005), "ts": 9000.1, "dur": 0.5},
    ]
    t = read_trace(_write(tmp_path / "trace.json", events))
    tb = temporal_breakdown(t, steps=[0])
    assert (tb.compute_ms, tb.comm_ms, tb.overlapped_ms, tb.idle_ms) == (6, 4, 2, 0) and tb.overlap_pct == 50
    assert step_lanes(t, 1)["compute"] == [(pytest.approx(0.0001), pytest.approx(0.0006))]


def test_a_trace_without_profiler_steps_is_read_as_one_step_and_says_so(tmp_path):
    events = [_x("aten::mm", "cpu_op", 0, 1), _kernel("sm90_gemm", 1, 2), _kernel("sm90_gemm", 4, 1)]
    path = _write(tmp_path / "bench.json", events)
    t = read_trace(path)
    assert [(s.number, s.start_us, s.end_us) for s in t.steps] == [(0, 0, 5 * MS)] and "one step" in t.note
    (b,) = analyze([path])
    assert b.note == t.note and (b.compute_ms, b.wait_ms) == (3, 2)
    tb = temporal_breakdown(t)
    assert (tb.span_ms, tb.idle_ms) == (4, 1)  # HTA's span runs from the first kernel to the last


def test_ranks_come_from_distributed_info_then_from_the_usual_file_names(tmp_path):
    events = [_x("ProfilerStep#0", "user_annotation", 0, 1)]
    a = _write(tmp_path / "host-a.json", events, rank=1)  # distributedInfo, no rank in the name
    b = _write(tmp_path / "job_rank-0.pt.trace.json", events, info=False)
    c = _write(tmp_path / "job_rank_2.json", events, info=False)
    assert [(r, h.name) for r, h, _ in trace_files([a, b, c])] == [
        (0, "job_rank-0.pt.trace.json"),
        (1, "host-a.json"),
        (2, "job_rank_2.json"),
    ]
    # distributedInfo wins over the name
    d = _write(tmp_path / "trace_rank5.json", events, rank=3)
    assert trace_files([d])[0][0] == 3
    # one file without a rank is rank 0; two of one rank, or a rankless one among several, are errors
    lone = _write(tmp_path / "lone.json", events, info=False)
    assert trace_files([lone])[0][0] == 0
    twin = _write(tmp_path / "other.json", events, rank=1)
    with pytest.raises(ValueError, match=r"host-a.json and .*other.json are both rank 1's trace"):
        trace_files([a, twin])
    with pytest.raises(ValueError, match=r"no rank in .*lone.json .* among 2 traces"):
        trace_files([lone, a])


def test_a_file_that_is_not_a_chrome_trace_is_refused_with_what_to_pass(tmp_path):
    et = tmp_path / "execution_trace.json"
    et.write_text(json.dumps({"schema": "1.0.1", "nodes": []}))  # a PyTorch execution trace, not Kineto's
    with pytest.raises(ValueError, match="is not a Chrome trace"):
        read_trace(et)


def test_the_timeline_plot_draws_a_memory_lane_where_a_trace_has_copies(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from labkit.trace import plot_timeline

    events = [_x("ProfilerStep#0", "user_annotation", 0, 4), _kernel("sm90_gemm", 0, 2)]
    plain = read_trace(_write(tmp_path / "plain.json", events))
    copy = _kernel("Memcpy HtoD", 2, 1, cat="gpu_memcpy")
    copied = read_trace(_write(tmp_path / "copied.json", [*events, copy]))
    labels = [t.get_text() for t in plot_timeline([copied]).axes[0].get_yticklabels()]
    assert labels == ["rank 0 compute", "rank 0 comm", "rank 0 memory"]
    assert [t.get_text() for t in plot_timeline([plain]).axes[0].get_yticklabels()][-1] == "rank 0 comm"
