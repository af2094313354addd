"""labkit.trace.timeline: the trace reader on hand-built traces, exact numbers: lanes (compute, comm, idle)
per step and their overlap, event classification, and a GPU trace read from its kernels, not the host's
spans. Real captures: test_capture.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.trace import classify, overlap, read_trace, step_lanes

MAIN, GLOO = 1, 2


def _x(name: str, ts: float, dur: float, tid=MAIN, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def _synthetic(tmp_path: Path) -> Path:
    """Two 10 ms steps; the expected numbers are worked out next to each event."""
    events = [
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": MAIN, "args": {"name": "thread 1 (python)"}},
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": GLOO, "args": {"name": "thread 2 (python)"}},
        {
            "ph": "M",
            "name": "thread_name",
            "pid": 7,
            "tid": GLOO,
            "args": {"name": "thread 2 (pt_gloo_runloop)"},
        },
        _x("PyTorch Profiler (0)", 0, 20_000, tid="PyTorch Profiler", cat="Trace"),
        _x("ProfilerStep#4", 0, 10_000, cat="user_annotation"),
        _x("ProfilerStep#5", 10_000, 10_000, cat="user_annotation"),
        # ---- step 4 ----
        _x("labkit:clock_sync", 0, 5, cat="user_annotation"),  # ignored
        _x("aten::mm", 0, 4_000),  # compute [0, 4000]
        _x("backward", 4_000, 5_000, cat="user_annotation"),  # compute [4000, 9000] ...
        _x("c10d::allreduce_", 5_000, 100),  # ... minus the issue [5000, 5100] (comm)
        _x("comm:wait", 8_000, 1_000, cat="user_annotation"),  # ... minus the wait [8000, 9000] (comm)
        _x("aten::copy_", 6_000, 500, tid=GLOO),  # on the gloo thread: comm, not compute
        _x("gloo:all_reduce", 5_200, 3_300, tid=GLOO, cat="user_annotation"),  # comm [5200, 8500]
        _x("aten::add", 9_500, 1_000),  # crosses into step 5: [9500, 10000] here, [10000, 10500] there
        _x("cudaLaunchKernel", 9_000, 300, cat="cuda_runtime"),  # ignored (no lane)
        {"ph": "i", "name": "marker", "pid": 7, "tid": MAIN, "ts": 3_000, "s": "t"},  # ignored
        # ---- step 5 ----
        _x("aten::mm", 10_000, 2_000),  # compute [10000, 12000]
        _x(
            "comm:all_reduce bucket0",
            11_000,
            4_000,
            tid="labkit comm (issue to completion)",
            cat="labkit_comm",
        ),
    ]
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 3}}))
    return path


def test_synthetic_trace_lanes_and_overlap(tmp_path):
    tr = read_trace(_synthetic(tmp_path))
    assert tr.rank == 3
    assert [(s.number, s.start_us, s.end_us) for s in tr.steps] == [(4, 0, 10_000), (5, 10_000, 20_000)]

    lanes = step_lanes(tr, 4)
    # compute: [0,5000] + [5100,8000] (backward minus issue and wait) + [9500,10000]
    assert lanes["compute"] == [(0.0, 5.0), (5.1, 8.0), (9.5, 10.0)]
    # comm: issue [5000,5100], gloo [5200,8500] united with the wait [8000,9000]
    assert lanes["comm"] == [(5.0, 5.1), (5.2, 9.0)]
    assert lanes["idle"] == [(9.0, 9.5)]

    s4 = overlap(tr, 4)
    assert s4["compute_ms"] == pytest.approx(8.4)
    assert s4["comm_ms"] == pytest.approx(3.9)
    assert s4["overlapped_ms"] == pytest.approx(2.8)  # [5200, 8000]
    assert s4["overlap_pct"] == pytest.approx(100 * 2.8 / 3.9)
    assert s4["idle_ms"] == pytest.approx(0.5)
    assert s4["step_ms"] == pytest.approx(10.0)

    s5 = overlap(tr, 5)
    assert (s5["compute_ms"], s5["comm_ms"], s5["overlapped_ms"], s5["idle_ms"]) == pytest.approx(
        (2.0, 4.0, 1.0, 5.0)
    )
    assert s5["overlap_pct"] == pytest.approx(25.0)

    both = overlap(tr)
    assert both["steps"] == [4, 5]
    assert both["compute_ms"] == pytest.approx((8.4 + 2.0) / 2)
    assert both["comm_ms"] == pytest.approx((3.9 + 4.0) / 2)
    assert both["overlap_pct"] == pytest.approx(100 * (2.8 + 1.0) / (3.9 + 4.0))

    with pytest.raises(ValueError, match=r"step=9 .* \[4, 5\]"):
        overlap(tr, 9)


def test_classify_names():
    assert classify("aten::mm", "cpu_op") == "compute"
    assert classify("forward", "user_annotation") == "compute"
    assert classify("sm90_xmma_gemm_f32", "kernel") == "compute"
    for name in ("c10d::allreduce_", "gloo:all_reduce", "nccl:all_reduce", "record_param_comms", "comm:wait"):
        assert classify(name, "cpu_op") == "comm", name
    assert classify("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel") == "comm"
    assert classify("ncclKernel_AllGather_RING_LL_Sum_int8_t", "kernel") == "comm"
    assert classify("aten::copy_", "cpu_op", "thread 9 (pt_gloo_runloop)") == "comm"
    assert classify("ProfilerStep#3", "user_annotation") is None
    assert classify("cudaLaunchKernel", "cuda_runtime") is None


def _gpu_step_trace(tmp_path, nccl_start_ms: float) -> Path:
    """One 10 ms step of a GPU trace: the host enqueues backward (0.5-9 ms) and the optimizer; on the device a
    compute kernel runs 1-6 ms and an NCCL all-reduce kernel 3 ms from `nccl_start_ms`."""

    def x(name, cat, a, d, tid=1):
        return {"ph": "X", "name": name, "cat": cat, "pid": 0, "tid": tid, "ts": a * 1e3, "dur": d * 1e3}

    events = [
        x("ProfilerStep#1", "user_annotation", 0, 10),
        x("backward", "user_annotation", 0.5, 8.5),
        x("Optimizer.step#AdamW.step", "user_annotation", 9, 1),
        x("sm90_xmma_gemm_f32", "kernel", 1, 5, 7),
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", nccl_start_ms, 3, 20),
    ]
    path = tmp_path / f"gpu_{nccl_start_ms}.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_overlap_on_a_gpu_trace_is_read_from_the_kernels(tmp_path):
    # The all-reduce runs after the compute kernel: 0 % overlap on the device, although the host's
    # `backward` span (which only enqueues) covers it. Host spans made such a step look 100 % overlapped.
    naive = overlap(read_trace(_gpu_step_trace(tmp_path, 6.0)))
    assert naive["overlap_pct"] == 0 and naive["comm_ms"] == 3 and naive["compute_ms"] == 5
    lanes = step_lanes(read_trace(_gpu_step_trace(tmp_path, 6.0)))
    assert lanes["compute"] == [(1.0, 6.0)] and lanes["comm"] == [(6.0, 9.0)]
    # started at 4 ms, 2 of its 3 ms run beside the compute kernel on another stream
    assert overlap(read_trace(_gpu_step_trace(tmp_path, 4.0)))["overlap_pct"] == pytest.approx(200 / 3)
