"""The capstone's driver: the seed deals different jobs from the one table of mistakes, and its GPU's memory
separates them (on real runs of the emulated cluster)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch

from labkit import Cluster, RankError, launch
from labkit.course.experiments.capstone import (
    DEALT,
    EXAM_SECRET_ENV,
    GPU_MODEL,
    dealt,
    draw,
    exam_secret,
    train,
)
from labkit.course.training import MISTAKES, TrainingJob
from labkit.course.training.job import job_name
from labkit.course.training.mistakes import planted_by_knobs
from labkit.machine.machine import Machine

CPU = Cluster.emulated(gpus_per_node=2)


def test_the_seed_deals_every_combination_and_hides_the_answer():
    dealt = Counter(draw(seed).planted for seed in range(300))
    combos = {c for k in (2, 3) for c in itertools.combinations(DEALT, k)}
    assert set(dealt) == combos  # all 20: every sitting can get a different job
    cap = draw(5)
    assert draw(5) == cap and "planted" not in repr(cap) and "clean=" not in repr(cap)
    assert draw(5, Machine.resolve("cpu", 2)) == cap  # the emulated cluster deals as on paper
    for seed in range(40):
        cap = draw(seed)
        changed = {k for k, v in dataclasses.asdict(cap.job).items() if getattr(cap.clean, k) != v}
        assert changed == {MISTAKES[m].knob for m in cap.planted}, seed  # each planted by its one knob
        assert planted_by_knobs(cap.job) == set(cap.planted) - {"oom_batch"}
        assert cap.job.global_batch == cap.clean.global_batch
    with pytest.raises(ValueError, match="data-parallel job; use 2 or more ranks"):
        draw(0, world_size=1)
    with pytest.raises(ValueError, match="eval_rank=3 is not a rank of 2"):
        TrainingJob(eval_rank=3).check(2)
    with pytest.raises(ValueError, match="micro_batch"):
        TrainingJob(global_batch=16, micro_batch=3).check(2)
    assert job_name(TrainingJob(grad_sync="per_tensor")) == "grad_sync-per_tensor"


def test_exam_mode_deals_from_the_seed_and_the_instructors_secret(tmp_path):
    """With the instructor's secret the public seed no longer tells the deal, the same pair always deals the
    same job (the grader's run deals the learner's again), and every combination can still come out."""
    path = tmp_path / "secret.txt"
    path.write_text("spring-sitting-7f3a\n")
    secret = exam_secret({EXAM_SECRET_ENV: str(path)})
    assert secret == "spring-sitting-7f3a" and exam_secret({}) is None
    assert exam_secret({EXAM_SECRET_ENV: " "}) is None
    public = [draw(seed).planted for seed in range(40)]
    exam = [draw(seed, secret=secret).planted for seed in range(40)]
    assert exam == [draw(seed, secret=secret).planted for seed in range(40)]
    assert sum(a != b for a, b in zip(public, exam)) >= 30, (public, exam)  # 1 in 20 alike by chance
    assert exam != [draw(seed, secret="another sitting").planted for seed in range(40)]
    assert len({draw(seed, secret=secret).planted for seed in range(300)}) == 20
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(ValueError, match=f"{EXAM_SECRET_ENV}='{missing}' cannot be read .*or unset it"):
        exam_secret({EXAM_SECRET_ENV: str(missing)})
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="is empty: write the secret in it"):
        exam_secret({EXAM_SECRET_ENV: str(tmp_path / "empty.txt")})


def test_on_a_simulated_node_every_seed_deals_the_two_mistakes_the_simulation_times():
    # a tokenizer in the loop is host Python, which a simulated GPU does not time, and the logged accuracy and
    # the per-tensor all-reduces are left out as on GPUs: what is left is the OOM and the straggler, both
    assert {draw(seed, simulated=True).planted for seed in range(40)} == {("oom_batch", "straggler")}
    assert dealt(simulated=True, world_size=8) == ("oom_batch", "straggler")
    sim = Machine.resolve("sim:dgx-h100", 8)
    assert dealt(sim) == ("oom_batch", "straggler") and draw(0, sim) == draw(0, world_size=8, simulated=True)
    cap = draw(0, simulated=True)
    # the GPU sizes, and the memory of tensor bytes (no caching allocator's segments to leave slack for)
    assert cap.model == GPU_MODEL and cap.memory_mib == draw(0, model=GPU_MODEL).memory_mib
    assert cap.memory_mib < draw(0, on_gpu=True).memory_mib


def test_the_script_deals_the_simulated_capstone_on_a_simulated_node(monkeypatch):
    # the script's headline asks for the deal of the machine it runs on (its whole run: the notebook's test)
    from labkit.course.experiments import capstone
    from labkit.course.experiments.script import Where

    asked = {}

    class Dealt(Exception):
        """Stops the script once it has asked for its deal, before anything launches."""

    def deal(seed, **kwargs):
        asked.update(kwargs)
        raise Dealt

    monkeypatch.setattr(capstone, "draw", deal)
    sim = Cluster.resolve("sim:dgx-h100", 2)
    where = Where(2, sim, 1, 2, torchrun=False, on_gpu=False, label=sim.label)
    with pytest.raises(Dealt):
        capstone.headline(where, capstone.Params(cluster="sim:dgx-h100"))
    assert asked == {"world_size": 2, "on_gpu": False, "simulated": True, "secret": None}  # no exam secret


def test_the_gpu_memory_fits_the_clean_job_and_its_logging_but_not_the_whole_batch(tmp_path):
    cap = draw(0)
    clean = cap.clean
    fits = [clean, dataclasses.replace(clean, accuracy="gathered"), dataclasses.replace(clean, eval_rank=0)]
    per_rank = launch(train, cap, fits, str(tmp_path), steps=1, trace_steps=1, world_size=2, cluster=CPU)
    peaks = [max(rank[i].peak_mib for rank in per_rank) for i in range(len(fits))]
    assert all(0.5 * cap.memory_mib < p < 0.95 * cap.memory_mib for p in peaks), (peaks, cap.memory_mib)
    assert peaks[1] > peaks[0]  # the gathered logits take memory too
    with pytest.raises(RankError) as info:
        launch(
            train, cap, [dataclasses.replace(clean, micro_batch=8)], str(tmp_path), world_size=2, cluster=CPU
        )
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
