"""The capstone on a GPU, predicted without one: its jobs' steps replayed through labkit's model of CUDA's
caching allocator (`labkit.machine.emulate.allocator`), whose reserved bytes are what a GPU's memory cap
limits.

Pinned: at the emulated sizes a card would run out on the clean job (28 MiB reserved against 22) and could not
tell the planted OOM (30) from it; at the GPU sizes (`GPU_MODEL`, `SEGMENT_SLACK_MIB` more memory) the clean
job fits with room to spare, and the whole per-rank batch in one micro-batch does not, by its allocated bytes
alone. (The logging mistake, whose gathered logits would need more, is not dealt on GPUs.)"""

from __future__ import annotations

import dataclasses

from labkit import Cluster, launch
from labkit.course.experiments.capstone import GPU_MODEL, MODEL, dealt, draw
from labkit.course.training.mistakes import MISTAKES
from labkit.course.training.trainer import Trainer
from labkit.machine.emulate import MemoryBudget

MiB = 2**20


def _replay(model, jobs) -> list[tuple[float, float]]:
    """(allocated, reserved) peak MiB of two steps of each job on this rank, every tensor malloc'ed from the
    caching-allocator model of a roomy card."""
    out = []
    for job in jobs:
        with MemoryBudget(2**30, allocator="caching") as budget:
            trainer = Trainer(dataclasses.replace(job, tokenize="ahead"), model, steps=2)
            trainer.step()  # Adam's states, DDP's rebuilt buckets
            trainer.step()
            out.append((budget.peak / MiB, budget.peak_reserved / MiB))
            del trainer
    return out


def _peaks(on_gpu: bool):
    cap = draw(0, on_gpu=on_gpu)
    clean = cap.clean
    jobs = [clean, MISTAKES["oom_batch"].plant(clean, 2, None)]
    return cap, launch(_replay, cap.model, jobs, world_size=2, cluster=Cluster.emulated())[0]


def test_on_a_card_the_capstones_gpu_sizes_fit_the_clean_job_and_not_the_planted_oom():
    cap, [(_, clean), (oom_allocated, _)] = _peaks(on_gpu=True)
    assert cap.model == GPU_MODEL and "sync_logging" not in dealt(on_gpu=True)
    assert "sync_logging" not in cap.planted
    assert clean <= 0.85 * cap.memory_mib  # reserved, what the cap limits, with room to spare
    assert oom_allocated > 1.1 * cap.memory_mib  # out of memory whatever the allocator rounds


def test_at_the_emulated_sizes_a_card_would_run_out_on_the_clean_job():
    cap, [(allocated, clean), (_, oom)] = _peaks(on_gpu=False)
    assert cap.model == MODEL
    assert allocated <= cap.memory_mib < clean  # fits the emulated budget (tensor bytes), not a card
    assert oom - clean <= 2  # and the planted OOM reserves about as much: no cap tells them apart
