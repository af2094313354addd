"""labkit.trace.diagnose on small synthetic traces: a straggler (and its rank), data loading, nothing, small
collectives after backward, a blocking collective mid-step, and a host sync on GPU traces. The traces are
written by tests/trace/conftest.py's `traces`."""

from __future__ import annotations

from labkit.trace.analyze import analyze
from labkit.trace.diagnose import diagnose, findings


def test_diagnose_a_straggler(tmp_path, traces):
    traces.emulated(
        tmp_path, 0, [(0, 5), (9.5, 10)], [("all_reduce #1", 4, 9.5, 1000)]
    )  # waits 4.5 ms for rank 1
    traces.emulated(tmp_path, 1, [(0, 9.5), (9.9, 10)], [("all_reduce #1", 9, 9.9, 1000)])
    d = diagnose(tmp_path)
    assert (d.kind, d.rank) == ("straggler", 1) and "rank 1 computes" in d.evidence


def test_diagnose_data_loading_and_none(tmp_path, traces):
    (tmp_path / "slow").mkdir()
    (tmp_path / "clean").mkdir()
    for r in (0, 1):
        traces.emulated(tmp_path / "slow", r, [(0, 10)], [], [("data", 0, 3)])
        traces.emulated(tmp_path / "clean", r, [(0, 9.8)], [], [("data", 0, 0.2)])
    d = diagnose(tmp_path / "slow")
    assert (d.kind, d.rank) == ("data_loading", None) and "30 %" in d.evidence
    assert diagnose(tmp_path / "clean").kind == "none"


def test_diagnose_small_collectives_and_a_sync_collective(tmp_path, traces):
    (tmp_path / "small").mkdir()
    (tmp_path / "sync").mkdir()
    many = [(f"all_reduce #{i}", 6 + 0.2 * i, 6 + 0.2 * (i + 1), 4096) for i in range(20)]
    sync = [("all_gather #1", 3, 5, 4 * 2**20)]
    for r in (0, 1):
        traces.emulated(
            tmp_path / "small", r, [(0, 6)], many
        )  # blocked 6-10 on 20 small all-reduces after backward
        traces.emulated(
            tmp_path / "sync", r, [(0, 3), (5, 10)], sync
        )  # waits mid-step, 5 ms of compute after
    assert diagnose(tmp_path / "small").kind == "small_collectives"
    d = diagnose(tmp_path / "sync")
    assert d.kind == "sync_collective" and "all_gather" in d.evidence


def test_a_sync_collective_is_judged_against_its_own_steps_compute(tmp_path, traces):
    # Three steps; the last, whose collectives diagnose reads, was slower: 4 ms of compute before the logging
    # all-gather and 12 after, where the others had 3 and 5. Against the median step's compute (8 ms) the
    # all-gather came late (4 > 0.4 x 8); against its own step's (16 ms) it is early (a quarter), as it is.
    for r in (0, 1):
        dev, host = [], []
        for n, (before, after) in enumerate([(3.0, 5.0), (3.0, 5.0), (4.0, 12.0)]):
            t0 = 30.0 * n
            dur = before + 2 + after
            dev += [traces.step(n, t0, dur), traces.x("compute", "kernel", t0, before)]
            dev += [traces.x("compute", "kernel", t0 + before + 2, after)]
            dev += [traces.x(f"comm:all_gather #{n}", "labkit_comm", t0 + before, 2, tid=2, bytes=4096)]
            host += [traces.step(n, t0, dur)]
        traces.write(tmp_path / f"trace_rank{r}.device.json", dev, r)
        traces.write(tmp_path / f"trace_rank{r}.json", host, r)
    (b0, _) = analyze(tmp_path)
    assert b0.compute_ms == 8.0 and b0.step_collectives[0].compute_before_ms == 4.0  # 0.5 of the median
    d = diagnose(tmp_path)
    assert d.kind == "sync_collective" and "all_gather" in d.evidence, str(d)


def test_diagnose_a_host_sync_on_gpu_traces(tmp_path, traces):
    for r in (0, 1):
        events = [
            traces.step(),
            traces.x("sm80_gemm", "kernel", 0, 6, tid=7),
            traces.x("aten::item", "cpu_op", 6, 3),
        ]
        traces.write(tmp_path / f"trace_rank{r}.json", events, r)
    d = diagnose(tmp_path)
    assert d.kind == "host_sync" and "30 %" in d.evidence


def test_findings_list_every_rule_that_fires_and_diagnose_picks_one(tmp_path, traces):
    for r in (0, 1):  # data loading and small collectives at once
        many = [(f"all_reduce #{i}", 6 + 0.1 * i, 6 + 0.1 * (i + 1), 4096) for i in range(20)]
        traces.emulated(tmp_path, r, [(3, 6)], many, [("data", 0, 3)])
    kinds = [f.kind for f in findings(tmp_path)]
    assert {"data_loading", "small_collectives"} <= set(kinds)
    assert diagnose(tmp_path).kind == kinds[0]


def test_diagnose_a_straggler_on_gpu_traces_where_the_wait_is_inside_the_nccl_kernel(tmp_path, traces):
    # rank 0 computes 4 ms and enters the all-reduce, whose kernel spins until rank 1 joins at 9 ms: its
    # wait shows as 6 ms of NCCL kernel, not as idle time; rank 1's kernel (the transfer itself) takes 1 ms
    for r, compute in ((0, 4), (1, 9)):
        events = [
            traces.step(),
            traces.x("sm90_gemm", "kernel", 0, compute, tid=7),
            traces.x("ncclDevKernel_AllReduce_Sum_f32", "kernel", compute, 10 - compute, tid=8),
        ]
        traces.write(tmp_path / f"trace_rank{r}.json", events, r)
    d = diagnose(tmp_path)
    assert (d.kind, d.rank) == ("straggler", 1), str(d)
    assert "2.25x" in d.evidence and "they wait 50 %" in d.evidence


def test_on_gpu_traces_the_collectives_come_from_nccl_kernels(tmp_path, traces):
    # The same rules as on the emulated timeline, from the kernels: 20 small all-reduces after backward with
    # nothing beside them; one all-gather between forward and backward; DDP's buckets under backward
    nccl = "ncclDevKernel_AllReduce_Sum_f32"
    shapes = {
        "small": [("sm90_gemm", 0, 6)] + [(nccl, 6 + 0.2 * i, 0.2) for i in range(20)],
        "sync": [("sm90_gemm", 0, 3), ("ncclDevKernel_AllGather_RING_LL", 3, 2), ("sm90_gemm", 5, 5)],
        "buckets": [("sm90_gemm", 0, 10)] + [(nccl, 5 + 0.2 * i, 0.2) for i in range(20)],
    }
    for name, kernels in shapes.items():
        (tmp_path / name).mkdir()
        for r in (0, 1):
            events = [traces.step()] + [
                traces.x(k, "kernel", start, dur, tid=8 if k.startswith("nccl") else 7)
                for k, start, dur in kernels
            ]
            traces.write(tmp_path / name / f"trace_rank{r}.json", events, r)
    small = diagnose(tmp_path / "small")
    assert small.kind == "small_collectives" and "20 collectives per step" in small.evidence, str(small)
    sync = diagnose(tmp_path / "sync")
    assert sync.kind == "sync_collective" and "AllGather" in sync.evidence, str(sync)
    assert diagnose(tmp_path / "buckets").kind == "none"


def test_on_cpu_host_traces_small_collectives_go_by_exposure_not_by_size(tmp_path, traces):
    # torchrun over gloo, no device timeline: 20 transfers of any size on gloo's thread after backward, with
    # nothing computed beside them, are the mistake; the same 20 under backward's compute are DDP's buckets
    for name, start in (("after", 6.0), ("under", 1.0)):
        (tmp_path / name).mkdir()
        for r in (0, 1):
            events = [traces.step(), traces.x("aten::mm", "cpu_op", 0, 6)]
            events += [
                traces.x("gloo:all_reduce", "user_annotation", start + 0.2 * i, 0.2, tid=5) for i in range(20)
            ]
            traces.write(tmp_path / name / f"trace_rank{r}.json", events, r)
    (after,) = {b.source for b in analyze(tmp_path / "after")}
    assert after == "CPU host trace"
    d = diagnose(tmp_path / "after")
    assert d.kind == "small_collectives" and "20 collectives per step" in d.evidence, str(d)
    assert diagnose(tmp_path / "under").kind != "small_collectives"
