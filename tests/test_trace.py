"""The trace reader on hand-built traces (exact numbers) and on real captures."""

from __future__ import annotations

import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from torch import nn

import labkit.runtime
from labkit.trace import CommLog, capture, classify, overlap, plot_timeline, read_trace, step_lanes

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


def test_plot_timeline_draws_two_lanes_per_rank(tmp_path):
    tr = read_trace(_synthetic(tmp_path))
    fig = plot_timeline({0: tr, 1: tr}, title="synthetic", step=4)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 compute",
        "rank 0 comm",
        "rank 1 compute",
        "rank 1 comm",
    ]
    assert ax.get_title() == "synthetic"
    assert "ms" in ax.get_xlabel()


def test_capture_single_process(tmp_path):
    a = torch.randn(64, 64)
    path = capture(lambda: a @ a, steps=3, warmup=1, path=tmp_path / "one_{rank}.json")
    assert path == tmp_path / "one_0.json"
    tr = read_trace(path)
    assert len(tr.steps) == 3
    stats = overlap(tr)
    assert stats["comm_ms"] == 0.0 and stats["overlap_pct"] == 0.0
    assert 0 < stats["compute_ms"] <= stats["step_ms"]
    assert any(e.name == "aten::mm" and e.lane == "compute" for e in tr.events)


def test_capture_merges_comm_log_gzipped(tmp_path):
    a = torch.randn(64, 64)
    log = CommLog()

    def step() -> None:  # pretend the matmul is a collective, logged by hand
        t0 = time.perf_counter_ns()
        a @ a
        log.add("fake", t0, time.perf_counter_ns(), nbytes=123)

    path = capture(step, steps=2, warmup=1, path=tmp_path / "t.json.gz", comm_log=log)
    tr = read_trace(path)
    spans = [e for e in tr.events if e.category == "labkit_comm"]
    assert [(e.name, e.lane) for e in spans] == [("comm:fake", "comm")] * 2  # warmup's span left out
    for span, step_ in zip(spans, tr.steps):
        assert step_.start_us <= (span.start_us + span.end_us) / 2 <= step_.end_us
    assert overlap(tr)["comm_ms"] > 0


def test_capture_validates_arguments():
    with pytest.raises(ValueError, match="steps=0"):
        capture(lambda: None, steps=0)


def worker_capture_overlapped(trace_dir: str) -> dict:
    """Capture OverlappedDDP on this rank; report what the trace holds."""
    from labkit.parallel.data import OverlappedDDP

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    model = OverlappedDDP(net, bucket_cap_mb=1e-6)  # one bucket per parameter: 8
    x = torch.randn(16, 128)

    def step() -> None:
        model(x).sum().backward()
        model.finish_gradient_synchronization()

    path = capture(step, steps=2, warmup=1, path=Path(trace_dir) / "ddp_{rank}.json", comm_log=model.comm_log)
    tr = read_trace(path)
    spans = [e for e in tr.events if e.category == "labkit_comm"]
    # the spans sit inside the steps that issued them, so the clocks are aligned (a wrong
    # offset is days off; the 50 ms margin is for a completion callback on a busy machine)
    aligned = all(
        any(st.start_us <= s.start_us and s.end_us <= st.end_us + 50_000 for st in tr.steps) for s in spans
    )
    return {
        "path": str(path),
        "spans": len(spans),
        "gloo_events": sum(e.name.startswith("gloo:") for e in tr.events),
        "aligned": aligned,
        "stats": overlap(tr),
        "rank": dist.get_rank(),
    }


def test_capture_overlapped_ddp_two_ranks(tmp_path):
    from labkit.launcher import launch

    results = launch(worker_capture_overlapped, str(tmp_path), world_size=2, cluster="cpu", timeout_s=120)
    for rank, res in enumerate(results):
        assert res["path"].endswith(f"ddp_{rank}.json")
        assert res["spans"] == 8 * 2  # 8 buckets, 2 profiled steps
        assert res["gloo_events"] >= 8 * 2
        assert res["aligned"]
        stats = res["stats"]
        assert stats["steps"] == [1, 2]
        assert stats["comm_ms"] > 0 and stats["compute_ms"] > 0
        assert 0 <= stats["overlap_pct"] <= 100
    fig = plot_timeline([read_trace(r["path"]) for r in results])
    assert len(fig.axes[0].get_yticklabels()) == 4


def test_comm_log_records_issue_to_completion(monkeypatch):
    log = CommLog(maxlen=2)
    fut = torch.futures.Future()

    class FakeWork:
        def get_future(self):
            return fut

    logged = log.track(FakeWork(), "all_reduce x", 64, start_ns=100)
    assert len(log) == 0 and not logged.done()  # not complete yet
    fut.set_result(None)
    logged.wait()
    (span,) = log.spans()
    assert (span.name, span.start_ns, span.nbytes) == ("all_reduce x", 100, 64) and span.end_ns > 100
    with monkeypatch.context() as m:  # a GPU rank, as labkit.runtime decides it
        m.setattr(labkit.runtime, "on_gpu", lambda: True)
        assert log.track(FakeWork(), "cuda one") is None  # skipped: NCCL futures complete at enqueue
    log.add("a", 0, 1)
    log.add("b", 0, 1)
    assert [s.name for s in log.spans()] == ["a", "b"]  # maxlen keeps the newest


def test_device_timeline_reads_like_a_trace(tmp_path):
    """The emulated device timeline (virtual time): compute is the step minus its waits."""
    from labkit.emulate.clock import VirtualClock
    from labkit.trace.device import device_trace_path, write_device_trace

    clock = VirtualClock()
    clock.waits.extend([(0.080, 0.100)])  # waited 20 ms for the last bucket
    clock.collectives.extend([("all_reduce #1", 0.040, 0.060, 64), ("all_reduce #2", 0.075, 0.100, 64)])
    path = write_device_trace(device_trace_path(tmp_path / "x_rank0.json"), clock, [(3, 0.0, 0.110)])
    assert path.name == "x_rank0.device.json"
    stats = overlap(read_trace(path))
    assert stats["step_ms"] == pytest.approx(110)
    assert stats["compute_ms"] == pytest.approx(90)  # 110 ms minus the 20 ms wait
    assert stats["comm_ms"] == pytest.approx(45)
    assert stats["overlapped_ms"] == pytest.approx(25)  # 40-60 fully, 75-80 of the second


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


def test_a_multi_node_job_must_name_a_shared_trace_folder(monkeypatch, tmp_path):
    from labkit.trace.capture import _trace_path

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="a file system every node shares"):
        _trace_path(None, 3)
    assert _trace_path(tmp_path / "trace_rank{rank}.json", 3) == tmp_path / "trace_rank3.json"
    monkeypatch.setenv("WORLD_SIZE", "8")  # one node: its /tmp is fine
    assert _trace_path(None, 3).name == "trace_rank3.json"
