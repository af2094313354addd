"""labkit.experiments.unoverlapped_comms.train_steps / summarize_steps on 2 CPU ranks, and capture's quiet profiler start."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

from labkit.experiments.unoverlapped_comms import summarize_steps, train_steps
from labkit.models import GPTConfig
from labkit.parallel.data import OverlappedDDP

TINY = GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
N_TENSORS = 2 * 12 + 5  # 12 per block; tok_emb, pos_emb, ln_f (2), lm_head


class ZeroingDDP(OverlappedDDP):
    """A broken flush: all-reduces zeros instead of the gradients."""

    def _flush(self, bucket):
        super()._flush(bucket)
        bucket.work.wait()
        bucket.buffer.zero_()


def worker_all_modes(trace_dir: str) -> dict:
    return train_steps(
        ["compute", "comm_naive", "naive", "comm_overlapped", "overlapped", "torch_ddp"],
        TINY,
        4,
        steps=2,
        warmup=1,
        bucket_cap_mb=0.01,
        trace_modes=["naive", "overlapped"],
        trace_dir=trace_dir,
        trace_steps=1,
    )


def worker_broken() -> dict:
    return train_steps(["overlapped"], TINY, 4, steps=2, warmup=0, bucket_cap_mb=0.01, ddp_class=ZeroingDDP)


@pytest.fixture(scope="module")
def all_modes(tmp_path_factory):
    from labkit.launcher import launch

    trace_dir = tmp_path_factory.mktemp("traces")
    return launch(worker_all_modes, str(trace_dir), world_size=2, cluster="cpu", timeout_s=120)


def test_every_rank_reports_every_mode(all_modes):
    for rank, res in enumerate(all_modes):
        assert res["rank"] == rank and res["world_size"] == 2 and res["device"] == "cpu"
        assert res["param_tensors"] == N_TENSORS
        assert res["params"] == TINY.num_params() and res["grad_bytes"] == 4 * TINY.num_params()
        for mode, m in res["modes"].items():
            assert len(m["ms"]) == len(m["cpu_ms"]) == len(m["collectives"]) == 2, mode
            assert all(t > 0 for t in m["ms"]), mode
        for mode in ("naive", "overlapped", "torch_ddp"):
            assert len(res["modes"][mode]["max_abs_diff"]) == 3  # checked after every step, warm-up too
        assert res["modes"]["compute"]["max_abs_diff"] is None
        for mode in ("naive", "overlapped"):
            assert Path(res["traces"][mode]).name == f"{mode}_rank{rank}.json"
            assert Path(res["traces"][mode]).is_file()


def test_summary_counts_collectives_and_matches_single_process(all_modes):
    s = summarize_steps(all_modes)
    assert s["compute"]["collectives"] == 0 and s["compute"]["in_backward"] is None
    assert s["naive"]["collectives"] == s["comm_naive"]["collectives"] == N_TENSORS
    assert s["naive"]["in_backward"] == 0  # all after backward: the mistake
    buckets = s["overlapped"]["buckets"]
    assert 1 < buckets < N_TENSORS
    assert s["overlapped"]["collectives"] == s["comm_overlapped"]["collectives"] == buckets
    assert s["overlapped"]["in_backward"] == buckets  # every bucket launched by a hook
    assert s["torch_ddp"]["collectives"] >= 1
    assert s["torch_ddp"]["in_backward"] == s["torch_ddp"]["collectives"]  # DDP reduces in backward
    for mode in ("naive", "overlapped", "torch_ddp"):
        assert s[mode]["max_abs_diff"] < 1e-5, mode
    for mode, row in s.items():
        # the step time is the per-step maximum over ranks, and its median
        per_step = [max(a, b) for a, b in zip(*(r["modes"][mode]["ms"] for r in all_modes))]
        assert row["ms_steps"] == per_step and min(per_step) <= row["ms"] <= max(per_step)
        assert row["cpu_ms"] > 0
        # the step's own compute: its time less the waits for collectives (virtual clock), slowest rank
        per_rank = [
            [ms - w for ms, w in zip(r["modes"][mode]["ms"], r["modes"][mode]["waited_ms"])]
            for r in all_modes
        ]
        own = [max(step) for step in zip(*per_rank)]
        assert row["compute_ms"] == statistics.median(own) and 0 < row["compute_ms"] <= row["ms"]
    assert s["compute"]["compute_ms"] == pytest.approx(s["compute"]["ms"])  # no collective: nothing waited
    assert (
        s["comm_naive"]["compute_ms"] < s["comm_naive"]["ms"]
    )  # communication alone waited for its collectives
    summary = all_modes[0]["modes"]["overlapped"]["bucket_summary"]
    assert len(summary) == buckets and summary[0]["names"][0] == "lm_head.weight"


def test_traces_show_overlap_only_for_the_fix(all_modes):
    from labkit.trace import overlap, read_trace

    for res in all_modes:
        naive = overlap(read_trace(res["traces"]["naive"]))
        assert naive["comm_ms"] > 0 and naive["overlap_pct"] < 5
        assert overlap(read_trace(res["traces"]["overlapped"]))["comm_ms"] > 0


def test_the_reference_check_catches_wrong_gradients():
    from labkit.launcher import launch

    s = summarize_steps(launch(worker_broken, world_size=2, cluster="cpu", timeout_s=120))
    assert s["overlapped"]["max_abs_diff"] > 1e-5


def test_train_steps_validates_modes():
    with pytest.raises(ValueError, match="unknown mode"):
        train_steps(["fast"])
    with pytest.raises(ValueError, match="trace_modes"):
        train_steps(["naive"], trace_modes=["overlapped"])
    with pytest.raises(ValueError, match="no results"):
        summarize_steps([])


def test_capture_drops_kineto_start_stop_lines(capfd):
    from labkit.trace.capture import _without_kineto_log

    with _without_kineto_log():
        os.write(2, b"USDT:2026-01-01 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "a real warning" in err


def test_a_step_s_cpu_time_leaves_out_the_device_synchronisation(monkeypatch):
    # On a GPU runtime.clock() synchronizes, and cudaDeviceSynchronize spins the CPU: mocked here by a clock
    # that burns 50 ms of CPU each time it is read. The step itself does (almost) nothing.
    import time

    import torch.distributed as dist

    from labkit import runtime
    from labkit.experiments import unoverlapped_comms

    def spinning_clock() -> float:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
        return time.perf_counter()

    monkeypatch.setattr(runtime, "clock", spinning_clock)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    run = type("Run", (), {"group": None})()
    ms, cpu_ms, _, waited = unoverlapped_comms._timed(run, lambda r, x, y: None, None, None)
    assert cpu_ms < 20 <= ms and waited is None
