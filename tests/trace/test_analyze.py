"""labkit.trace.analyze on small synthetic traces of each shape: the emulated device timeline, a GPU host
trace with kernels, and a CPU-only host trace; the breakdown is known exactly. `read_timelines` picks each
rank's device timeline. The traces are written by tests/trace/conftest.py's `traces`."""

from __future__ import annotations

import pytest

from labkit.trace import read_timelines
from labkit.trace.analyze import analyze, collective_bytes, trace_files
from labkit.trace.timeline import STEP_END_SYNC


def test_the_emulated_device_timeline_is_read_with_names_from_the_host_trace(tmp_path, traces):
    # compute 0-4 and 6-10; a 1 MiB all-reduce 4-6 the rank waited for; data loading 0-2
    traces.emulated(
        tmp_path,
        0,
        [(0, 4), (6, 10)],
        [("all_reduce #1", 4, 6, 2**20)],
        [("data", 0, 2)],
        [("aten::mm", 2, 1.5), ("aten::add", 2.2, 0.3), ("aten::item", 9, 0.5)],
    )
    (b,) = analyze(tmp_path)
    assert b.source == "emulated device timeline" and b.steps == 1
    assert (b.step_ms, b.compute_ms, b.data_ms, b.wait_ms, b.comm_ms) == (10, 6, 2, 2, 2)
    assert b.exposed_comm_ms == 2 and b.overlap_pct == 0 and b.collectives == 1 and b.comm_bytes == 2**20
    assert b.host_syncs == 1 and b.host_sync_ms == 0.5
    assert dict(b.top_ops)["aten::mm"] == pytest.approx(1.2) and dict(b.top_ops)[
        "aten::add"
    ] == pytest.approx(0.3)  # self time
    (c,) = b.step_collectives
    assert (c.waited_ms, c.compute_before_ms, c.compute_after_ms, c.nbytes) == (2, 4, 4, 2**20)


def test_host_syncs_are_carried_to_the_device_step_at_the_ranks_ratio_of_the_two_clocks(tmp_path, traces):
    # a simulated GPU: the host's wall clock (FakeTensor dispatch) spends 200 ms on a 10 ms modelled step, 20
    # of them in 40 .item() calls on an optimizer's CPU step counters, which cost a GPU nothing; read on the
    # wall clock they were twice the step (the capstone's clean job on a simulated node read 105 %)
    items = [("aten::item", 5 * i, 0.5) for i in range(40)]
    traces.emulated(tmp_path, 0, [(0, 10)], [], host_ops=items, host_step_ms=200.0)
    (b,) = analyze(tmp_path)
    assert b.host_syncs == 40 and b.host_sync_ms == pytest.approx(20 * 10 / 200)
    assert b.step_ms == 10 and b.compute_ms == 10


def test_gpu_kernels_decide_compute_and_communication(tmp_path, traces):
    # the host span "backward" covers everything, but only kernels count: compute 0-5, NCCL 3-7
    events = [
        traces.step(),
        traces.x("backward", "user_annotation", 0, 9),
        traces.x("sm80_gemm", "kernel", 0, 5, tid=7),
        traces.x("ncclDevKernel_AllReduce_Sum_f32", "kernel", 3, 4, tid=8),
        traces.x("cudaStreamSynchronize", "cuda_runtime", 7, 2),
        traces.x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 0, 1),
    ]
    traces.write(tmp_path / "trace_rank0.json", events, 0)
    (b,) = analyze([tmp_path / "trace_rank0.json"])
    assert b.source == "GPU kernels"
    assert (b.compute_ms, b.comm_ms, b.exposed_comm_ms, b.wait_ms) == (5, 4, 2, 3)
    assert b.overlap_pct == pytest.approx(50) and b.collectives == 1
    assert (b.host_sync_ms, b.data_ms) == (2, 1)


def test_captures_own_wait_at_the_end_of_a_step_is_not_a_host_sync(tmp_path, traces):
    # capture synchronises after each step so that its kernels end inside ProfilerStep#N: that
    # cudaDeviceSynchronize, inside labkit's span, is not the job's; the job's own .item() still counts
    events = [
        traces.step(),
        traces.x("sm80_gemm", "kernel", 0, 8, tid=7),
        traces.x("aten::item", "cpu_op", 2, 1),
        traces.x(STEP_END_SYNC, "user_annotation", 8, 2),
        traces.x("cudaDeviceSynchronize", "cuda_runtime", 8, 1.9),
        traces.x("cudaDeviceSynchronize", "cuda_runtime", 8, 1.9, tid=2),  # another thread's is not inside
    ]
    traces.write(tmp_path / "trace_rank0.json", events, 0)
    (b,) = analyze([tmp_path / "trace_rank0.json"])
    assert b.source == "GPU kernels"
    assert b.host_syncs == 2 and b.host_sync_ms == pytest.approx(1 + 1.9)


def test_a_cpu_host_trace_alone_uses_its_lanes(tmp_path, traces):
    # the main thread computes 0-6 and then blocks in c10d::allreduce_ while gloo's thread moves the data
    events = [
        traces.step(),
        traces.x("aten::mm", "cpu_op", 0, 6),
        traces.x("c10d::allreduce_", "cpu_op", 6, 3),
        traces.x("gloo:all_reduce", "cpu_op", 6, 3, tid=5),
    ]
    traces.write(tmp_path / "trace_rank0.json", events, 0)
    (b,) = analyze(tmp_path)
    assert b.source == "CPU host trace"
    assert (b.compute_ms, b.comm_ms, b.exposed_comm_ms, b.wait_ms, b.collectives) == (6, 3, 3, 4, 1)


def test_trace_files_pairs_ranks_and_refuses_nothing_to_read(tmp_path, traces):
    traces.emulated(tmp_path, 1, [(0, 10)], [])
    traces.emulated(tmp_path, 0, [(0, 10)], [])
    pairs = trace_files(tmp_path)
    assert [r for r, _, _ in pairs] == [0, 1] and all(h and d for _, h, d in pairs)
    assert trace_files([tmp_path / "trace_rank1.json"])[0][2].name == "trace_rank1.device.json"
    with pytest.raises(ValueError, match="not a directory of traces"):
        trace_files(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trace files"):
        trace_files(tmp_path / "empty")


def test_read_timelines_gives_each_ranks_device_timeline_in_rank_order(tmp_path, traces):
    traces.emulated(tmp_path, 1, [(0, 10)], [("all_reduce #1", 2, 3, 64)])
    traces.emulated(tmp_path, 0, [(0, 10)], [])
    first, second = read_timelines(tmp_path)
    assert (first.rank, second.rank) == (0, 1)
    assert [e.name for e in second.events if e.category == "labkit_comm"] == ["comm:all_reduce #1"]
    assert [t.rank for t in read_timelines([tmp_path / "trace_rank1.json"])] == [1]


def test_an_nccl_kernels_size_comes_from_the_arguments_kineto_copies_onto_it(tmp_path, traces):
    # Kineto writes the launching record_param_comms' sizes on the NCCL kernel (as in HTA's test trace
    # tests/data/nccl_parser_config/nccl_data.json.gz: "In msg nelems" 6637568, "dtype" "Float")
    reduce = {"In msg nelems": 6637568, "Out msg nelems": 6637568, "dtype": "Float"}
    gather = {"In msg nelems": 1024, "Out msg nelems": 2048, "dtype": "BFloat16"}
    events = [
        traces.step(),
        traces.x("sm90_gemm", "kernel", 0, 5, tid=7),
        traces.x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 5, 2, tid=8, **reduce),
        traces.x("ncclDevKernel_AllGather_RING_LL", "kernel", 7, 1, tid=8, **gather),
    ]
    traces.write(tmp_path / "trace_rank0.json", events, 0)
    (b,) = analyze([tmp_path / "trace_rank0.json"])
    assert [c.nbytes for c in b.step_collectives] == [6637568 * 4, 2048 * 2]  # an all-gather's whole output
    assert b.comm_bytes == 6637568 * 4 + 4096
    # a kernel without them (an older Kineto) has no size; a dtype not known gives none, not a guess
    assert collective_bytes({"In msg nelems": 8, "dtype": "ComplexFloat"}) is None
    assert collective_bytes(None) is None and collective_bytes({"bytes": 12}) == 12
