"""labkit.course.experiments.unprofiled_run (lab 05's driver) on real runs of the emulated cluster: each
mistake planted by its knob (`mystery_job`), trained and traced with `labkit.course.training.loop.train_jobs`;
`diagnose` names every planted mistake that shows here (and the straggler's rank, on either rank), finds
nothing in the clean job, and holds for two model sizes; the fix the diagnosis names (`fixed_job`) is faster
in virtual time and leaves nothing to find."""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit import Cluster, launch
from labkit.course.experiments.unprofiled_run import (
    MYSTERY_KINDS,
    SIMULATED_PER_TENSOR_RANKS,
    Params,
    clean_job,
    fixed_job,
    kinds_left_out,
    kinds_that_show,
    mystery_job,
    run_name,
    step_ms,
)
from labkit.course.training.loop import JobResult, train_jobs
from labkit.course.training.mistakes import MISTAKES
from labkit.machine.machine import Machine
from labkit.models import GPTConfig
from labkit.trace import diagnose

BATCH = 8  # sequences per rank and step


def _expected(kind: str) -> str:
    # compute is synchronous on the emulated cluster: a host sync costs nothing there, and diagnose rightly
    # finds nothing
    return MISTAKES[kind].diagnosed_as if kind in kinds_that_show(on_gpu=False) else "none"


def _table(found) -> str:
    return "; ".join(
        f"rank {b.rank} ({b.source}): step {b.step_ms:.1f} compute {b.compute_ms:.1f} data {b.data_ms:.1f} "
        f"wait {b.wait_ms:.1f} ms, {b.collectives:.0f} collectives"
        for b in found.breakdown
    )


def _runs(config, jobs, names, tmp_path) -> list[list[JobResult]]:
    per_rank = launch(
        train_jobs,
        config,
        jobs,
        str(tmp_path),
        names=names,
        steps=3,  # the median of three: one step that a busy machine slows does not decide it
        trace_steps=3,
        world_size=2,
        cluster=Cluster.emulated(gpus_per_node=2),
        timeout_s=120,
        deadline_s=300,
    )
    return [[rank[i] for rank in per_rank] for i in range(len(jobs))]


# A larger GPT than the lab's own (2 blocks, 64 wide), whose gallery of every mistake its solution notebook's
# test diagnoses (tests/labs/test_05_unprofiled_run.py): the thresholds hold where compute weighs more
@pytest.mark.parametrize("n_layers,d_model", [(4, 128)])
def test_diagnose_names_every_planted_mistake(n_layers, d_model, tmp_path):
    config = GPTConfig(n_layers=n_layers, d_model=d_model, n_heads=4, vocab_size=2048, seq_len=64)
    clean = clean_job(BATCH, 2)
    jobs = [clean] + [mystery_job(clean, kind, 2) for kind in MYSTERY_KINDS]
    names = ["clean", *MYSTERY_KINDS]
    for name, run in zip(names, _runs(config, jobs, names, tmp_path)):
        assert [r.rank for r in run] == [0, 1] and Path(run[0].traces) == tmp_path / name
        found = diagnose(Path(run[0].traces))
        expected = "none" if name == "clean" else _expected(name)
        assert found.kind == expected, f"{name}: diagnosed {found}; {_table(found)}"
        if expected == "straggler":
            assert found.rank == 1 and "rank 1 computes" in found.evidence
        assert len(found.breakdown) == 2 and found.breakdown[0].source == "emulated device timeline"
        # the job carries no labkit label: diagnose reads what PyTorch itself records (the DataLoader's spans)
        for trace in Path(run[0].traces).glob("*.json*"):
            assert "phase:" not in trace.read_text(), trace


def test_a_straggler_on_rank_0_and_the_fixes(tmp_path):
    config = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=2048, seq_len=64)
    clean = clean_job(BATCH, 2)
    kinds = kinds_that_show(on_gpu=False)
    assert kinds == ["straggler", "data_loading", "per_tensor_allreduce", "sync_logging"]
    planted = [mystery_job(clean, kind, 2, straggler_rank=0) for kind in kinds]
    fixed = [fixed_job(job, MISTAKES[kind].diagnosed_as) for job, kind in zip(planted, kinds)]
    names = [run_name(j, clean) for j in planted] + [f"{kind}_fixed" for kind in kinds]
    runs = _runs(config, planted + fixed, names, tmp_path)
    found = diagnose(Path(runs[0][0].traces))
    assert (found.kind, found.rank) == ("straggler", 0), str(found)
    for i, kind in enumerate(kinds):  # virtual time: the fixed job is faster than the planted one
        before, after = step_ms(runs[i]), step_ms(runs[len(kinds) + i])
        assert after < before, f"{kind}: fixed {after:.1f} ms, planted {before:.1f} ms"
        again = diagnose(Path(runs[len(kinds) + i][0].traces))
        assert again.kind == "none", f"{kind} fixed: {again}; {_table(again)}"


def test_the_jobs_plant_one_mistake_each_and_the_diagnosis_fixes_only_its_own():
    clean = clean_job(BATCH, 2)
    assert clean.global_batch == 2 * BATCH and run_name(clean, clean) == "clean"
    for kind in MYSTERY_KINDS:
        job = mystery_job(clean, kind, 2)
        assert [m for m in MYSTERY_KINDS if MISTAKES[m].planted_in(job)] == [kind]
        assert run_name(job, clean) == ("straggler_rank1" if kind == "straggler" else kind)
        assert fixed_job(job, "none") == job  # nothing named, nothing changed
        others = [
            k for k in MYSTERY_KINDS if k != kind and MISTAKES[k].diagnosed_as != MISTAKES[kind].diagnosed_as
        ]
        assert all(
            fixed_job(job, MISTAKES[k].diagnosed_as) == job for k in others
        )  # a wrong fix changes nothing
        fixed = fixed_job(job, MISTAKES[kind].diagnosed_as)
        assert not any(MISTAKES[m].planted_in(fixed) for m in MYSTERY_KINDS)
        assert run_name(fixed, clean) == ("clean" if fixed == clean else "fixed")
    # a host sync is the step's last wait in this job's timed steps: it cannot show on either cluster (and
    # tests/course/test_forecast.py ties the GPU list to lab 05's forecast)
    assert "host_sync" not in kinds_that_show(on_gpu=True) + kinds_that_show(on_gpu=False)
    # the machine answers what shows there; each mistake left out says why, for the notebook to print
    for machine in (Machine.resolve("cpu", 2), Machine.resolve("sim:dgx-h100", 2)):
        left_out = kinds_left_out(machine)
        assert sorted(kinds_that_show(machine) + list(left_out)) == sorted(MYSTERY_KINDS)
        assert all(why for why in left_out.values())
    assert list(kinds_left_out(Machine.resolve("cpu", 2))) == ["host_sync"]
    assert kinds_that_show(Machine.resolve("cpu", 2)) == kinds_that_show(on_gpu=False)
    with pytest.raises(ValueError, match="kind='slow_disk' is not one of lab 05's mistakes"):
        mystery_job(clean, "slow_disk", 2)
    with pytest.raises(ValueError, match=r"straggler_rank=2 must be a rank of the job, 0\.\.1"):
        mystery_job(clean, "straggler", 2, straggler_rank=2)


def test_on_a_simulated_node_per_tensor_all_reduces_are_drawn_from_the_ranks_where_their_fix_shows(tmp_path):
    """On simulated DGX H100 ranks the fix's buckets run in labkit's Python OverlappedDDP, whose bucket copies
    cost host dispatches: fixing per-tensor all-reduces takes the step to <= 0.8x (the course's bar) from
    SIMULATED_PER_TENSOR_RANKS ranks, not on fewer; kinds_that_show draws it from there on (virtual time). On
    those ranks the simulated traces name the mistake (many small collectives) and, once fixed, nothing. The
    data-parallel ranks are alike (no straggler planted): one process stands for them (`launch(alike=True)`;
    on 8 ranks the same step times to the nanosecond and the same diagnoses as 8 processes)."""
    p = Params()
    ratio = {}
    for n in (SIMULATED_PER_TENSOR_RANKS - 2, SIMULATED_PER_TENSOR_RANKS):
        planted = mystery_job(clean_job(p.micro_batch, n), "per_tensor_allreduce", n)
        fixed = fixed_job(planted, "small_collectives")
        per_rank = launch(train_jobs, p.config(), [planted, fixed], str(tmp_path / str(n)), names=["b", "a"],
                          steps=1, trace_steps=1, world_size=n, cluster="sim:dgx-h100", timeout_s=120,
                          alike=True)
        before, after = ([rank[i] for rank in per_rank] for i in range(2))
        ratio[n] = step_ms(after) / step_ms(before)
        shows = "per_tensor_allreduce" in kinds_that_show(Machine.resolve("sim:dgx-h100", n))
        assert shows == (ratio[n] <= 0.8), ratio
        if shows:
            assert diagnose(tmp_path / str(n) / "b").kind == "small_collectives"
            assert diagnose(tmp_path / str(n) / "a").kind == "none"
    assert ratio[SIMULATED_PER_TENSOR_RANKS] <= 0.8 < ratio[SIMULATED_PER_TENSOR_RANKS - 2], ratio
    assert kinds_that_show(simulated=True, world_size=2) == ["straggler"]
    with pytest.raises(ValueError, match="needs world_size"):
        kinds_that_show(simulated=True)
