"""labkit.machine.machine: one value for where a lab runs, asked instead of the machine's kind."""

from __future__ import annotations

from dataclasses import replace

import pytest

from labkit.cluster import Cluster
from labkit.course.experiments.oom_batch import Params
from labkit.machine.machine import LARGE_SEGMENT_BYTES, Machine


def _gpu() -> Machine:
    """A GPU node as described, made a "gpu" cluster: what Cluster.detect gives on a DGX H100."""
    return Machine(replace(Cluster.preset("dgx-h100"), kind="gpu"), 8)


def test_the_emulated_cluster_computes_values_counts_bytes_and_keeps_no_segment_spare():
    m = Machine.resolve("cpu", 2)
    assert (m.kind, m.label, m.ranks) == ("emulated", "emulated", 2)
    assert m.computes_values and m.for_values() is m and m.values_note() == ""
    assert m.torch_ddp and m.times_noisy and not m.judged_by_verdict and not m.gpu_sized
    assert not m.caps_reserved and m.allocator_headroom_bytes == 0 and not m.optimizer_foreach
    assert m.limited(28).memory_gib == 28 / 1024 and m.counting().memory_gib == 1024
    assert m.grad_sync_extra_bytes(100) == 0
    assert m.records() == {"emulated": True, "machine": "emulated", "where": "emulated"}


def test_a_simulated_machine_checks_values_on_the_emulated_cluster_and_counts_overlapped_ddps_buckets():
    m = Machine.resolve("sim:dgx-h100", 2)
    assert m.kind == "simulated" and m.label == "simulated H100-SXM5-80GB" and m.gpu_name == "H100-SXM5-80GB"
    values = m.for_values()
    assert values.kind == "emulated" and values.ranks == 2 and values.computes_values
    assert not m.computes_values and "emulated cluster" in m.values_note()
    assert not m.torch_ddp and "OverlappedDDP" in m.ddp_name and m.grad_sync_extra_bytes(100) == 100
    assert m.optimizer_foreach and m.judged_by_verdict and not m.times_noisy and m.gpu_sized
    assert not m.caps_reserved and m.allocator_headroom_bytes == LARGE_SEGMENT_BYTES  # it stands for a card
    assert m.counting().memory_gib == 1024  # a card too large to fill: it counts


def test_a_gpu_caps_reserved_segments_takes_for_each_adam_and_keeps_a_large_segment_spare():
    m = _gpu()
    assert m.caps_reserved and m.allocator_headroom_bytes == 20 * 2**20 and m.optimizer_foreach
    assert m.torch_ddp and m.computes_values and m.judged_by_verdict and m.counting().memory_gib is None
    assert m.records()["emulated"] is False and m.records()["machine"] == "gpu"


def test_lab_02s_fixed_step_keeps_a_large_segment_spare_on_a_card_but_not_on_the_emulated_cluster():
    from labkit.course.experiments.oom_batch import fixed_micro_batch

    p = Params().resolve(on_gpu=True)  # 64 MiB, 64 sequences per rank
    on_card, _ = fixed_micro_batch(p, _gpu())
    emulated, _ = fixed_micro_batch(p, Machine.resolve("cpu", 2))
    assert on_card == 32 < emulated == 64  # estimate 49.4 MiB at 64: fits 64 MiB of bytes, not 64 - 20


def test_a_lab_resolves_its_machine_once_for_its_ranks():
    m = Params(cluster="cpu", world_size=3, global_batch=96).machine()
    assert m.ranks == 3 and m.cluster.world_size >= 3 and m.kind == "emulated"
    with pytest.raises(ValueError, match="world_size"):
        Machine.resolve("sim:dgx-h100:1", 9)  # one node of 8
