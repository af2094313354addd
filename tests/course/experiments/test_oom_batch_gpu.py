"""Lab 02 on a GPU, predicted without one: its steps replayed through labkit's model of CUDA's caching
allocator (`labkit.machine.emulate.allocator`), whose reserved bytes are what a GPU's memory cap
(`set_per_process_memory_fraction`) limits.

On a card the allocator reserves segments (2 MiB for blocks up to 1 MiB, 20 MiB for blocks up to 10 MiB), so
a step of lab 02's small model reserves 16-18 MiB more than it allocates. The emulated budget counts tensor
bytes only, so the emulated default (28 MiB) cannot say whether a step fits on a card; this test can. It
pins that the emulated default would run out on a GPU and that lab 02's GPU sizes show the OOM and its fix
there: the step as written does not fit, the accumulation exercise and the fixed step the lab picks
(`fixed_micro_batch`, as `oom_batch.headline` does) do, and the fix still accumulates."""

from __future__ import annotations

from dataclasses import replace

from labkit import Cluster, launch
from labkit.course.experiments.oom_batch import Params, dp_train, fixed_micro_batch
from labkit.machine.emulate import MemoryBudget
from labkit.machine.machine import LARGE_SEGMENT_BYTES, Machine

MiB = 2**20


def _replay(config, per_rank: int, runs: list[tuple[str, int, bool]]) -> list[tuple[float, float]]:
    """(allocated, reserved) peak MiB of each run (precision, micro-batch, checkpointing) of one rank's
    data-parallel step, every tensor malloc'ed from the caching-allocator model of a roomy card."""
    out = []
    for precision, micro, checkpointing in runs:
        with MemoryBudget(2**30, allocator="caching") as budget:
            dp_train(config, per_rank, micro, precision=precision, checkpointing=checkpointing)
            out.append((budget.peak / MiB, budget.peak_reserved / MiB))
    return out


def test_lab_02s_gpu_sizes_show_the_oom_and_its_fix_on_a_card_and_the_emulated_default_would_not():
    p = Params().resolve(on_gpu=True)
    assert (p.memory_mib, p.global_batch) == (64.0, 128)
    per_rank = p.global_batch // p.world_size
    card = Machine(replace(Cluster.preset("dgx-h100"), kind="gpu"), p.world_size)  # a cap on reserved bytes
    micro, _ = fixed_micro_batch(p, card)
    assert micro < per_rank  # the fix still accumulates
    emulated = Params().resolve(on_gpu=False)
    assert (emulated.memory_mib, emulated.global_batch) == (28, 64)  # the CPU defaults stay
    runs = [("fp32", per_rank, False), ("fp32", p.micro_batch, False), ("autocast", micro, True)]
    (written, _), (_, exercise), (_, fixed) = launch(
        _replay, p.config(), per_rank, runs, world_size=1, cluster=Cluster.emulated(gpus_per_node=1)
    )[0]
    assert written > p.memory_mib  # as written: out of memory on the card
    assert exercise <= p.memory_mib and fixed <= p.memory_mib  # reserved, what the cap limits
    # with a large segment (20 MiB) to spare for one CUDA-only tensor of a few MiB: at 48 MiB the H200 ran out
    # ("Tried to allocate 20.00 MiB"), the fixed step reserving 42 of them
    assert fixed + LARGE_SEGMENT_BYTES / MiB <= p.memory_mib
    # What the replay found, pinned: at the emulated default of 28 MiB the exercise's step (fp32, micro-batch
    # 4) allocates less than 28 MiB but reserves more, so on a card it would run out
    ((allocated, reserved),) = launch(
        _replay,
        emulated.config(),
        emulated.global_batch // emulated.world_size,
        [("fp32", emulated.micro_batch, False)],
        world_size=1,
        cluster=Cluster.emulated(gpus_per_node=1),
    )[0]
    assert allocated <= emulated.memory_mib < reserved
