"""labkit.trace.capture: a bounded profiler run per rank (one process, and OverlappedDDP on 2 emulated
ranks), the CommLog's spans merged on the profiler's clock, the path rules of a multi-node job, kineto's
start/stop lines dropped; and on a GPU, a trace whose kernels are read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import launch
from labkit.trace import CommLog, capture, overlap, plot_timeline, read_trace
from labkit.trace.capture import _trace_path, _without_kineto_log


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
    # the spans start inside the steps that issued them, so the clocks are aligned (a wrong offset is days
    # off); a step's buckets all complete (finish_gradient_synchronization waits for them and for their spans)
    # before the next step issues its first: no margin for a slow completion callback is needed
    step_of = [
        next((k for k, st in enumerate(tr.steps) if st.start_us <= s.start_us <= st.end_us), None)
        for s in spans
    ]
    aligned = None not in step_of and all(
        s.start_us <= s.end_us
        and all(s.end_us <= t.start_us for t, k in zip(spans, step_of) if k == step_of[i] + 1)
        for i, s in enumerate(spans)
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


def test_a_multi_node_job_must_name_a_shared_trace_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="a file system every node shares"):
        _trace_path(None, 3)
    assert _trace_path(tmp_path / "trace_rank{rank}.json", 3) == tmp_path / "trace_rank3.json"
    monkeypatch.setenv("WORLD_SIZE", "8")  # one node: its /tmp is fine
    assert _trace_path(None, 3).name == "trace_rank3.json"


def test_capture_drops_kineto_start_stop_lines(capfd):
    with _without_kineto_log():
        os.write(2, b"USDT:2026-01-01 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "a real warning" in err


def _traced_steps(path: str) -> str:
    from labkit.machine import runtime
    from labkit.models import GPTConfig, seeded_model, synthetic_batch
    from labkit.parallel.data import make_ddp

    config = GPTConfig(n_layers=2, d_model=256, n_heads=8, vocab_size=8192, seq_len=256)
    dev = runtime.device()
    model = make_ddp(seeded_model(config, 0, dev))
    x, y = synthetic_batch(config, 8, device=dev)

    def step() -> None:
        model(x, y).backward()

    return str(capture(step, steps=2, warmup=1, path=Path(path) / "trace_rank{rank}.json"))


@pytest.mark.gpu
def test_a_cuda_trace_is_read_from_its_kernels(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from labkit.trace import analyze

    (path,) = launch(_traced_steps, str(tmp_path), world_size=1, cluster="gpu", timeout_s=300)
    (b,) = analyze([path])
    assert b.source == "GPU kernels" and b.compute_ms > 0 and b.step_ms > 0
    assert 0 <= overlap(read_trace(path))["overlap_pct"] <= 100
