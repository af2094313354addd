"""labkit.machine.rank_setup: a rank's process group and device. Torchrun's ranks get "cpu:gloo,cuda:nccl"
bound to their GPU, their warm baseline recorded and the cap above it, NCCL's flight recorder told where to
dump; a launched GPU rank the same through NCCL; a virtual-clock rank keeps freed memory instead of
page-faulting it in again.

CUDA is mocked here (torch.cuda, init_process_group and `labkit.machine.device_memory`'s baseline): what is
checked is what set-up asks of them, in which order, on any machine."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from labkit import Cluster, launch
from labkit.cluster import GPU
from labkit.links import Link
from labkit.machine import device_memory, flight_recorder, rank_setup

FLIGHT_RECORDER_VARS = (
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_BUFFER_SIZE",
)


@pytest.fixture
def one_gpu(monkeypatch, tmp_path) -> dict:
    """A mocked node with one visible GPU, no group yet; what set-up calls is written into the dict returned.
    The flight recorder's variables and its ./nccl_dumps folder are undone after the test."""
    calls: dict = {"order": []}
    monkeypatch.chdir(tmp_path)
    for key in FLIGHT_RECORDER_VARS:
        monkeypatch.setenv(key, "-")  # recorded, so that what set-up sets is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("device", i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def init(backend, **kw):
        calls["order"].append("group")
        calls.update(
            backend=backend,
            dump=flight_recorder.dump_prefix(dict(os.environ)),
            on_timeout=os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT"),
            **kw,
        )

    def baseline(dev):
        calls["order"].append("baseline")
        calls["baseline"] = dev
        return 0

    def cap(dev, gib):
        calls["order"].append("cap")
        calls["capped"] = (dev, gib)

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(device_memory, "record_baseline", baseline)
    monkeypatch.setattr(device_memory, "cap_above_baseline", cap)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    return calls


def test_torchrun_ranks_get_gloo_for_cpu_and_nccl_for_cuda_tensors(one_gpu, monkeypatch):
    # NCCL alone refuses CPU tensors (the old backend was "nccl" only); two processes on one GPU are refused
    # with the fix.
    calls = one_gpu
    assert rank_setup.init_torchrun_rank(timedelta(seconds=5)) is True
    assert calls["backend"] == "cpu:gloo,cuda:nccl" and calls["device_id"] == torch.device("cuda", 0)
    # every GPU rank records its warm baseline, capped or not; no cap without memory_gib
    assert calls["baseline"] == torch.device("cuda", 0) and "capped" not in calls
    assert calls["order"] == ["baseline", "group"]
    # memory_gib is a cap above the warm baseline (cuBLAS workspaces come from the same allocator), as launch
    calls["order"].clear()
    assert rank_setup.init_torchrun_rank(timedelta(seconds=5), memory_gib=0.5) is True
    assert calls["capped"] == (torch.device("cuda", 0), 0.5)
    assert calls["order"] == ["baseline", "cap", "group"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"has 1 visible GPU.*--nproc-per-node 1"):
        rank_setup.init_torchrun_rank(timedelta(seconds=5))


def test_torchrun_ranks_on_gpus_get_the_flight_recorder(one_gpu, monkeypatch, tmp_path):
    # The variables are set before the NCCL group is made; a user's own are kept.
    calls = one_gpu
    rank_setup.init_torchrun_rank(timedelta(seconds=5))
    assert (calls["dump"], calls["on_timeout"]) == (str(tmp_path / "nccl_dumps" / "nccl_trace_rank_"), "1")
    assert (tmp_path / "nccl_dumps").is_dir()
    for name in flight_recorder.DUMP_VARS:  # a user's own place under either name is kept
        for var in flight_recorder.DUMP_VARS:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv(name, "/shared/mine_")
        rank_setup.init_torchrun_rank(timedelta(seconds=5))
        assert calls["dump"] == "/shared/mine_", name
        assert [v for v in flight_recorder.DUMP_VARS if os.environ.get(v)] == [name]


def test_a_torchrun_rank_without_cuda_gets_gloo_and_an_existing_group_is_kept(monkeypatch):
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    assert rank_setup.init_torchrun_rank(timedelta(seconds=5)) is True and calls["backend"] == "gloo"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    calls.clear()
    assert rank_setup.init_torchrun_rank(timedelta(seconds=5)) is False and calls == {}


def test_a_launched_gpu_rank_records_its_baseline_then_the_cap_then_joins_nccl(one_gpu):
    calls = one_gpu
    gpu = Cluster(
        kind="gpu",
        nodes=1,
        gpus_per_node=1,
        intra_node=Link(1.0, 0.0, "none"),
        inter_node=Link(50.0, 5.0, "InfiniBand (assumed)"),
        gpus=(GPU(0, "NVIDIA H200", 139.8),),
        memory_gib=0.25,
    )
    rank_setup.init_launched_rank(gpu, 0, 1, dist.HashStore(), timedelta(seconds=5))
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 0)
    assert (calls["rank"], calls["world_size"]) == (0, 1)
    assert calls["order"] == ["baseline", "cap", "group"]
    assert calls["capped"] == (torch.device("cuda", 0), 0.25)


def _faults_of_reused_tensors() -> int:
    import resource

    def step() -> None:  # like activations: 16 MiB of tensors, all freed at the end
        held = [torch.ones(2**20) for _ in range(4)]
        del held

    for _ in range(10):  # warm up: the first allocations fault their pages in
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_SELF"), reason="needs getrusage")
def test_a_virtual_rank_reuses_freed_memory_instead_of_page_faulting_it_in_again():
    # Page faults are CPU time on the rank's clock; glibc's default returns large blocks to
    # the kernel on free (1,024 faults per 4 MiB). On a virtual-clock rank they stay cached.
    virtual = launch(_faults_of_reused_tensors, world_size=1, cluster=Cluster.emulated(gpus_per_node=1))[0]
    # (glibc's default, clock="wall", measured 0 or ~40,000 here, by its dynamic mmap threshold)
    assert virtual < 100, virtual


def _faults_of_fresh_tensors(warm: bool) -> tuple[bool, int]:
    import resource

    from labkit.machine import runtime

    warmed = runtime.warm_heap(64) if warm else False
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    held = [torch.ones(2**20) for _ in range(8)]  # 32 MiB this rank has not used yet, held together
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    del held
    return warmed, faults


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="needs getrusage per thread")
def test_a_warmed_heap_serves_fresh_tensors_without_page_faults():
    # Fresh memory faults its pages in on first touch (8,192 for 32 MiB), on the rank's clock: a rank that
    # happens to touch more of it looks slower. warm_heap pages the heap in once, before anything is measured.
    cpu = Cluster.emulated(gpus_per_node=1)
    cold = launch(_faults_of_fresh_tensors, False, world_size=1, cluster=cpu)[0]
    warm = launch(_faults_of_fresh_tensors, True, world_size=1, cluster=cpu)[0]
    assert cold == (False, cold[1]) and cold[1] > 4000, cold
    assert warm[0] and warm[1] < 500, warm
    # off the virtual clock (the wall clock, a GPU) it does nothing
    wall = launch(
        _faults_of_fresh_tensors, True, world_size=1, cluster=Cluster.emulated(gpus_per_node=1, clock="wall")
    )
    assert wall[0] == (False, wall[0][1])


def test_a_simulated_rank_does_not_warm_its_heap(monkeypatch):
    """A simulated machine's clock counts each operator's modelled time, never the host's page faults: paging
    256 MiB in on each of its ranks would only cost CPU (3 % of a profile of lab 05's simulated script)."""
    from labkit.machine import runtime

    monkeypatch.setenv(runtime.CLUSTER_ENV, Cluster.preset("dgx-h100").simulated().to_json())
    assert runtime.on_virtual_clock() and runtime.on_simulated()
    assert runtime.warm_heap(1) is False


def test_a_simulated_rank_keeps_its_own_core(monkeypatch):
    """Ranks compared by CPU time share one core (`runtime.share_one_core`); a simulated machine's clock
    counts modelled operator times, not CPU time, so its ranks keep a core each and the run takes half the
    wall time on two cores."""
    from labkit.machine import runtime

    monkeypatch.setenv(runtime.CLUSTER_ENV, Cluster.preset("dgx-h100").simulated().to_json())
    assert runtime.on_virtual_clock() and runtime.on_simulated() and not runtime.clock_counts_cpu_time()
    assert runtime.share_one_core() is False
    monkeypatch.setenv(runtime.CLUSTER_ENV, Cluster.emulated(gpus_per_node=2).to_json())
    assert runtime.clock_counts_cpu_time()  # the emulated cluster's virtual clock: the ranks' CPU time


def _collection_after_start() -> tuple[int, int]:
    import gc

    torch.zeros(4).add_(1)  # this rank's own objects are still collected
    return gc.get_freeze_count(), gc.collect()


def test_a_launched_rank_leaves_what_it_imported_out_of_the_collectors_passes():
    frozen, _ = launch(_collection_after_start, world_size=1, cluster=Cluster.emulated(gpus_per_node=1))[0]
    assert frozen > 10_000  # torch's modules and their objects
