"""labkit.trace.analyze / diagnose on small synthetic traces of each shape: the emulated device timeline,
a GPU host trace with kernels, and a CPU-only host trace; the breakdown is known exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.trace.analyze import analyze, trace_files
from labkit.trace.diagnose import diagnose

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


def _emulated(tmp: Path, rank: int, compute, colls, phases=(), host_ops=()) -> None:
    """A host trace plus its device timeline, one 10 ms step."""
    dev = [_step()] + [_x("compute", "kernel", a, b - a) for a, b in compute]
    dev += [_x(f"comm:{n}", "labkit_comm", a, b - a, tid=2, bytes=nb) for n, a, b, nb in colls]
    dev += [_x(f"phase:{n}", "labkit_phase", a, b - a, tid=3) for n, a, b in phases]
    _write(tmp / f"trace_rank{rank}.device.json", dev, rank)
    host = [_step()] + [_x(n, "cpu_op", a, d) for n, a, d in host_ops]
    _write(tmp / f"trace_rank{rank}.json", host, rank)


def test_the_emulated_device_timeline_is_read_with_names_from_the_host_trace(tmp_path):
    # compute 0-4 and 6-10; a 1 MiB all-reduce 4-6 the rank waited for; data loading 0-2
    _emulated(
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


def test_gpu_kernels_decide_compute_and_communication(tmp_path):
    # the host span "backward" covers everything, but only kernels count: compute 0-5, NCCL 3-7
    events = [
        _step(),
        _x("backward", "user_annotation", 0, 9),
        _x("sm80_gemm", "kernel", 0, 5, tid=7),
        _x("ncclDevKernel_AllReduce_Sum_f32", "kernel", 3, 4, tid=8),
        _x("cudaStreamSynchronize", "cuda_runtime", 7, 2),
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 0, 1),
    ]
    _write(tmp_path / "trace_rank0.json", events, 0)
    (b,) = analyze([tmp_path / "trace_rank0.json"])
    assert b.source == "GPU kernels"
    assert (b.compute_ms, b.comm_ms, b.exposed_comm_ms, b.wait_ms) == (5, 4, 2, 3)
    assert b.overlap_pct == pytest.approx(50) and b.collectives == 1
    assert (b.host_sync_ms, b.data_ms) == (2, 1)


def test_a_cpu_host_trace_alone_uses_its_lanes(tmp_path):
    # the main thread computes 0-6 and then blocks in c10d::allreduce_ while gloo's thread moves the data
    events = [
        _step(),
        _x("aten::mm", "cpu_op", 0, 6),
        _x("c10d::allreduce_", "cpu_op", 6, 3),
        _x("gloo:all_reduce", "cpu_op", 6, 3, tid=5),
    ]
    _write(tmp_path / "trace_rank0.json", events, 0)
    (b,) = analyze(tmp_path)
    assert b.source == "CPU host trace"
    assert (b.compute_ms, b.comm_ms, b.exposed_comm_ms, b.wait_ms, b.collectives) == (6, 3, 3, 4, 1)


def test_trace_files_pairs_ranks_and_refuses_nothing_to_read(tmp_path):
    _emulated(tmp_path, 1, [(0, 10)], [])
    _emulated(tmp_path, 0, [(0, 10)], [])
    pairs = trace_files(tmp_path)
    assert [r for r, _, _ in pairs] == [0, 1] and all(h and d for _, h, d in pairs)
    assert trace_files([tmp_path / "trace_rank1.json"])[0][2].name == "trace_rank1.device.json"
    with pytest.raises(ValueError, match="not a directory of traces"):
        trace_files(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trace files"):
        trace_files(tmp_path / "empty")


# ------------------------------------------------------------------------ diagnose


def test_diagnose_a_straggler(tmp_path):
    _emulated(tmp_path, 0, [(0, 5), (9.5, 10)], [("all_reduce #1", 4, 9.5, 1000)])  # waits 4.5 ms for rank 1
    _emulated(tmp_path, 1, [(0, 9.5), (9.9, 10)], [("all_reduce #1", 9, 9.9, 1000)])
    d = diagnose(tmp_path)
    assert (d.kind, d.rank) == ("straggler", 1) and "rank 1 computes" in d.evidence


def test_diagnose_data_loading_and_none(tmp_path):
    (tmp_path / "slow").mkdir()
    (tmp_path / "clean").mkdir()
    for r in (0, 1):
        _emulated(tmp_path / "slow", r, [(0, 10)], [], [("data", 0, 3)])
        _emulated(tmp_path / "clean", r, [(0, 9.8)], [], [("data", 0, 0.2)])
    d = diagnose(tmp_path / "slow")
    assert (d.kind, d.rank) == ("data_loading", None) and "30 %" in d.evidence
    assert diagnose(tmp_path / "clean").kind == "none"


def test_diagnose_small_collectives_and_a_sync_collective(tmp_path):
    (tmp_path / "small").mkdir()
    (tmp_path / "sync").mkdir()
    many = [(f"all_reduce #{i}", 6 + 0.2 * i, 6 + 0.2 * (i + 1), 4096) for i in range(20)]
    sync = [("all_gather #1", 3, 5, 4 * 2**20)]
    for r in (0, 1):
        _emulated(
            tmp_path / "small", r, [(0, 6)], many
        )  # blocked 6-10 on 20 small all-reduces after backward
        _emulated(tmp_path / "sync", r, [(0, 3), (5, 10)], sync)  # waits mid-step, 5 ms of compute after
    assert diagnose(tmp_path / "small").kind == "small_collectives"
    d = diagnose(tmp_path / "sync")
    assert d.kind == "sync_collective" and "all_gather" in d.evidence


def test_diagnose_a_host_sync_on_gpu_traces(tmp_path):
    for r in (0, 1):
        events = [_step(), _x("sm80_gemm", "kernel", 0, 6, tid=7), _x("aten::item", "cpu_op", 6, 3)]
        _write(tmp_path / f"trace_rank{r}.json", events, r)
    d = diagnose(tmp_path)
    assert d.kind == "host_sync" and "30 %" in d.evidence
