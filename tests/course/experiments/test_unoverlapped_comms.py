"""labkit.course.experiments.unoverlapped_comms (lab 03's driver): `train_steps` / `summarize_steps` on 2
emulated ranks: every mode reported, collectives counted (in backward or after it), every training mode equal
to one process, a broken flush caught by the reference check, traces showing overlap only for the fix; a
step's CPU time leaving out the device synchronisation."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from labkit.course.experiments.unoverlapped_comms import Mode, RankSteps, summarize_steps, train_steps
from labkit.models import GPTConfig
from labkit.parallel.data import OverlappedDDP

TINY = GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
N_TENSORS = 2 * 12 + 5  # 12 per block; tok_emb, pos_emb, ln_f (2), lm_head


class ZeroingDDP(OverlappedDDP):
    """A broken flush: all-reduces zeros instead of the gradients."""

    def flush(self, bucket):
        super().flush(bucket)
        bucket.work.wait()
        bucket.buffer.zero_()


def worker_all_modes(trace_dir: str) -> RankSteps:
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


def worker_broken() -> RankSteps:
    return train_steps(["overlapped"], TINY, 4, steps=2, warmup=0, bucket_cap_mb=0.01, ddp_class=ZeroingDDP)


@pytest.fixture(scope="module")
def all_modes(tmp_path_factory):
    from labkit.machine.launcher import launch

    trace_dir = tmp_path_factory.mktemp("traces")
    return launch(worker_all_modes, str(trace_dir), world_size=2, cluster="cpu", timeout_s=120)


def test_every_rank_reports_every_mode(all_modes):
    for rank, res in enumerate(all_modes):
        assert isinstance(res, RankSteps)
        assert res.rank == rank and res.world_size == 2 and res.device == "cpu"
        assert res.param_tensors == N_TENSORS
        assert res.params == TINY.num_params() and res.grad_bytes == 4 * TINY.num_params()
        for mode, m in res.modes.items():
            assert len(m.steps_ms) == len(m.cpu_ms) == len(m.collectives) == len(m.waited_ms) == 2, mode
            assert all(t > 0 for t in m.steps_ms), mode
        for mode in ("naive", "overlapped", "torch_ddp"):
            assert len(res.modes[mode].max_abs_diff) == 3  # checked after every step, warm-up too
        assert res.modes["compute"].max_abs_diff is None
        for mode in ("naive", "overlapped"):
            assert Path(res.traces[mode]).name == f"{mode}_rank{rank}.json"
            assert Path(res.traces[mode]).is_file()
            # on the virtual clock the device timeline of the timed steps is written beside it
            assert Path(res.device_traces[mode]).name == f"{mode}_rank{rank}.device.json"


def test_summary_counts_collectives_and_matches_single_process(all_modes):
    s = summarize_steps(all_modes)
    assert set(s) == {"compute", "comm_naive", "naive", "comm_overlapped", "overlapped", "torch_ddp"}
    assert s["compute"].collectives == 0 and s["compute"].in_backward == 0 and s["compute"].buckets is None
    assert s["naive"].collectives == s["comm_naive"].collectives == N_TENSORS
    assert s["naive"].in_backward == 0  # all after backward: the mistake
    buckets = s["overlapped"].buckets
    assert 1 < buckets < N_TENSORS and s["comm_overlapped"].buckets == buckets
    assert s["overlapped"].collectives == s["comm_overlapped"].collectives == buckets
    assert s["overlapped"].in_backward == buckets  # every bucket launched by a hook
    assert s["comm_overlapped"].in_backward == 0  # communication alone: no backward to launch from
    assert s["torch_ddp"].collectives >= 1
    assert s["torch_ddp"].in_backward == s["torch_ddp"].collectives  # DDP reduces in backward
    for mode in ("naive", "overlapped", "torch_ddp"):
        assert s[mode].max_abs_diff < 1e-5, mode
    for mode in ("compute", "comm_naive", "comm_overlapped"):
        assert s[mode].max_abs_diff is None, mode  # nothing trained data-parallel: nothing to check
    for mode, row in s.items():
        # the step time is the per-step maximum over ranks, and its median
        per_step = [max(a, b) for a, b in zip(*(r.modes[mode].steps_ms for r in all_modes))]
        assert row.steps_ms == per_step and min(per_step) <= row.step_ms <= max(per_step)
        assert row.cpu_ms > 0
        # the step's own compute: its time less the waits for collectives (virtual clock), slowest rank
        per_rank = [
            [ms - w for ms, w in zip(r.modes[mode].steps_ms, r.modes[mode].waited_ms)] for r in all_modes
        ]
        own = [max(step) for step in zip(*per_rank)]
        assert row.compute_ms == statistics.median(own) and 0 < row.compute_ms <= row.step_ms
    assert s["compute"].compute_ms == pytest.approx(s["compute"].step_ms)  # no collective: nothing waited
    # communication alone waited for its collectives
    assert s["comm_naive"].compute_ms < s["comm_naive"].step_ms
    summary = all_modes[0].modes["overlapped"].bucket_summary
    # reverse registration order: the LM head first (named under the Trainer's `Forward`, .model: the GPT)
    assert len(summary) == buckets and summary[0]["names"][0] == "model.lm_head.weight"


def test_traces_show_overlap_only_for_the_fix(all_modes):
    from labkit.trace import overlap, read_trace

    for res in all_modes:
        naive = overlap(read_trace(res.traces["naive"]))
        assert naive["comm_ms"] > 0 and naive["overlap_pct"] < 5
        assert overlap(read_trace(res.traces["overlapped"]))["comm_ms"] > 0


def test_the_reference_check_catches_wrong_gradients():
    from labkit.machine.launcher import launch

    s = summarize_steps(launch(worker_broken, world_size=2, cluster="cpu", timeout_s=120))
    assert s["overlapped"].max_abs_diff > 1e-5


def test_train_steps_validates_modes():
    with pytest.raises(ValueError, match="unknown mode"):
        train_steps(["fast"])
    with pytest.raises(ValueError, match="trace_modes"):
        train_steps(["naive"], trace_modes=["overlapped"])
    with pytest.raises(ValueError, match="no results"):
        summarize_steps([])


def test_a_step_s_cpu_time_leaves_out_the_device_synchronisation(monkeypatch):
    # On a GPU labkit.machine.timer.clock() synchronizes, and cudaDeviceSynchronize spins the CPU: mocked here
    # by a clock that burns 50 ms of CPU each time it is read and reads 50 ms later each time (a fake counter,
    # not the wall clock). The step itself does nothing.
    import time

    import torch.distributed as dist

    from labkit.course.experiments import unoverlapped_comms
    from labkit.machine import timer

    readings = itertools.count()

    def spinning_clock() -> float:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
        return 0.05 * next(readings)

    steps = []
    trainer = type("Trainer", (), {"process_group": None, "step": lambda self: steps.append(1)})()
    monkeypatch.setattr(timer, "clock", spinning_clock)
    monkeypatch.setattr(timer, "waited", lambda: None)  # off the virtual clock
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    ms, cpu_ms, t0, waited = unoverlapped_comms._timed(Mode("ddp", trains=True), trainer)
    assert steps == [1] and t0 == 0.0 and ms == pytest.approx(50.0)  # one step, between two readings
    assert cpu_ms < 20 and waited is None  # the 2 x 50 ms of spinning are outside the step's CPU time
