"""labkit.machine.emulate.budget: `MemoryBudget`, an emulated GPU's memory: a CUDA-like OOM naming the rank,
views counted once, tensors made earlier tracked, and with the caching-allocator model
(`labkit.machine.emulate.allocator`) reserved memory and its fragmentation OOM."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import labkit
from labkit import Cluster, Link, launch
from labkit.machine.emulate import CachingAllocator, MemoryBudget

MiB = 2**20


def test_budget_raises_a_cuda_like_oom_and_frees():
    budget = MemoryBudget(4 * 2**20, rank=3)
    with budget:
        a = torch.zeros(2**19)  # 2 MiB
        assert labkit.memory_allocated() == 2 * 2**20
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.zeros(2**20)  # 4 MiB more
        msg = str(info.value)
        assert "Tried to allocate 4.00 MiB" in msg and "Rank 3" in msg and "4.00 MiB" in msg
        assert "2.00 MiB is free" in msg
        del a
        assert labkit.memory_allocated() == 0
        b = torch.zeros(2**19) + 1  # two 2 MiB tensors alive at once at most
        del b
        assert labkit.max_memory_allocated() == 4 * 2**20


def test_budget_counts_views_once_and_tracks_existing_tensors():
    model = nn.Linear(256, 256)  # made before the budget starts
    with MemoryBudget(2**30) as budget:
        budget.track(model)
        params = sum(p.numel() * 4 for p in model.parameters())
        assert budget.allocated == params
        x = torch.zeros(1024)
        _ = x.view(32, 32), x[:10]
        assert budget.allocated == params + 4096


def _oom_training(batch: int) -> int:
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    x = torch.randn(batch, 512)
    model(x).sum().backward()
    return batch


def test_budget_through_launch_names_the_rank():
    small = Cluster.emulated(  # 16 MiB per rank; params + grads take 8
        gpus_per_node=2, intra_node=Link(1.0, 10.0), inter_node=Link(0.1, 100.0), memory_gib=16 / 1024
    )
    assert launch(_oom_training, 8, world_size=2, cluster=small) == [8, 8]
    with pytest.raises(labkit.RankError) as info:
        launch(_oom_training, 4096, world_size=2, cluster=small)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert "out of memory" in str(info.value)


def test_budget_without_allocator_reports_reserved_as_allocated():
    with MemoryBudget(2**30) as budget:
        x = torch.empty(1000)
        assert budget.reserved == budget.allocated == 4000 and budget.peak_reserved == 4000
        del x


def test_budget_with_the_caching_allocator_raises_its_fragmentation_oom():
    # The same program fits a plain 40 MiB budget (20 MiB live + 8 MiB), not the caching allocator.
    def program() -> None:
        live = [torch.empty(4 * MiB, dtype=torch.uint8) for _ in range(10)]
        del live[::2]
        torch.empty(8 * MiB, dtype=torch.uint8)

    with MemoryBudget(40 * MiB):
        program()
    with MemoryBudget(40 * MiB, rank=1, allocator="caching") as budget:
        try:
            program()
            msg = ""
        except torch.OutOfMemoryError as error:  # not pytest.raises: its traceback keeps the tensors
            msg = str(error)
        assert "Rank 1's emulated GPU has a total capacity of 40.00 MiB" in msg
        assert "expandable_segments:True" in msg and "(emulated caching allocator)" in msg
        assert budget.allocated == 0 and budget.allocator.allocated == 0  # the tensors died with the frame
        assert budget.reserved == budget.peak_reserved == 40 * MiB  # the segments stay cached


def test_budget_with_an_allocator_frees_reserves_and_resets():
    with MemoryBudget(64 * MiB, allocator="expandable") as budget:
        assert budget.allocator.expandable_segments
        x = torch.empty(3 * MiB, dtype=torch.uint8)
        assert (budget.allocated, budget.reserved) == (3 * MiB, 20 * MiB)  # one 20 MiB page
        assert budget.reserved >= budget.allocated
        del x
        assert (budget.allocated, budget.allocator.allocated, budget.reserved) == (0, 0, 20 * MiB)
        budget.reset_peak()
        assert (budget.peak, budget.peak_reserved) == (0, 20 * MiB)
    mine = CachingAllocator(16 * MiB)
    with MemoryBudget(16 * MiB, allocator=mine) as budget:
        y = torch.empty(256)
        assert (mine.allocated, mine.reserved) == (1024, 2 * MiB)
        del y
    with pytest.raises(
        ValueError, match=r"allocator.capacity_bytes=16777216 must equal limit_bytes=33554432"
    ):
        MemoryBudget(32 * MiB, allocator=mine)
    with pytest.raises(
        ValueError, match=r"MemoryBudget allocator='cuda' must be one of 'caching', 'expandable'"
    ):
        MemoryBudget(32 * MiB, allocator="cuda")


def test_a_storage_resized_in_place_frees_and_takes_back_its_bytes():
    # FSDP2 frees a gathered parameter so (free_storage / alloc_storage), keeping the tensor; with the caching
    # allocator's model too, whose segment the resize must give back and take again
    for allocator in (None, "caching"):
        with MemoryBudget(512 * 2**20, allocator=allocator) as budget:
            t = torch.zeros(32, 2**20, dtype=torch.float32)  # 128 MiB
            t.untyped_storage().resize_(0)
            assert budget.allocated == 0 and budget.peak == 128 * 2**20, allocator
            t.untyped_storage().resize_(256 * 2**20)
            assert budget.allocated == 256 * 2**20 == budget.peak, allocator
            with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
                t.untyped_storage().resize_(1024 * 2**20)
            del t
            assert budget.allocated == 0, allocator


def test_a_dtensor_costs_its_local_shard_not_its_global_shape():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        with MemoryBudget(64 * 2**20) as budget:
            local = torch.zeros(1024, 1024)  # 4 MiB: this rank's quarter of a 4096 x 1024 parameter
            d = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=(4096, 1024), stride=(1024, 1)
            )
            budget.track(d)
            e = d * 2
            assert isinstance(e, DTensor) and e.shape == (4096, 1024)
            assert budget.allocated == 8 * 2**20  # two local 4 MiB shards, not two 16 MiB wholes
    finally:
        dist.destroy_process_group()
