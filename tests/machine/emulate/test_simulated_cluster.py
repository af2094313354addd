"""A simulated machine end to end: `launch` on cluster="sim:<preset>" runs real ranks on FakeTensors, each
collective taking the preset's α-β time and each operator its modelled time on the described GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.bandwidth import bandwidth_test
from labkit.cluster import Cluster
from labkit.links import collective_time_s
from labkit.machine import timer
from labkit.op_time import DISPATCH_S, kernel_s


def _all_reduce(nbytes: int) -> tuple[float, str, str]:
    t = torch.empty(nbytes // 2, dtype=torch.bfloat16)
    dist.all_reduce(t)  # the first one: every rank has issued it
    start = timer.clock()
    dist.all_reduce(t)
    return timer.clock() - start, type(t).__name__, labkit.machine.runtime.current_cluster().label


def test_a_simulated_all_reduce_takes_the_links_alpha_beta_time_and_moves_no_data():
    node = Cluster.resolve("sim:dgx-h100", 8)
    results = labkit.launch(_all_reduce, 2**30, world_size=8, cluster=node)
    expected = collective_time_s("all_reduce", 2**30, 8, node.intra_node)  # NVLink 4, 450 GB/s
    for seconds, kind, label in results:
        assert seconds == pytest.approx(expected, abs=2e-9)  # the clock counts whole nanoseconds
        assert kind == "FakeTensor" and label == "simulated H100-SXM5-80GB"


def test_across_two_simulated_nodes_the_rings_run_over_every_rail():
    """Two DGX A100s, eight 200 Gb/s ports each: NCCL's rings spread the traffic between the nodes over the
    eight rails (200 GB/s), where one flat ring over one port (25 GB/s, the model before issue 45) was 8 times
    slower."""
    two = Cluster.resolve("sim:dgx-a100-80gb:2", 16)
    results = labkit.launch(_all_reduce, 2**28, world_size=16, cluster=two)
    rails = two.topology().rail_ring(list(range(16)))
    assert rails.bandwidth_gb_s == 8 * two.inter_node.bandwidth_gb_s == 200
    expected = collective_time_s("all_reduce", 2**28, 16, rails)
    for seconds, *_ in results:
        assert seconds == pytest.approx(expected, abs=2e-9)  # the clock counts whole nanoseconds
    assert expected < collective_time_s("all_reduce", 2**28, 16, two.inter_node) / 5


def _late_peer(n: int) -> float:
    """Rank 1 multiplies two n x n bf16 matrices before the all-reduce; rank 0 waits for it."""
    a = torch.empty(n, n, dtype=torch.bfloat16)
    dist.barrier()
    start = timer.clock()
    if dist.get_rank() == 1:
        a @ a
    dist.all_reduce(a)
    return timer.clock() - start


def test_a_rank_waits_in_simulated_time_for_a_peers_modelled_matmul():
    node = Cluster.resolve("sim:dgx-h100", 2)
    n = 8192
    waited, computed = labkit.launch(_late_peer, n, world_size=2, cluster=node)
    gpu = node.gpu_spec()
    # the host issues the matmul after the timer's reading (one dispatch), then the kernel, then the link
    matmul = DISPATCH_S + kernel_s(gpu, nbytes=3 * n * n * 2, matmul=(1, n, n, n))
    link = collective_time_s("all_reduce", n * n * 2, 2, node.intra_node)
    assert computed == pytest.approx(matmul + link, abs=5e-9)
    assert waited == pytest.approx(computed, abs=5e-9)  # rank 0 idles until rank 1 issues


def _after_a_barrier(late_ops: int, ops: int) -> float:
    """Rank 1 issues `late_ops` small operators before a barrier; then both ranks issue `ops`, host-bound,
    with no timer reading between: the device time from the barrier's end to the last one's."""
    x = torch.empty(16)
    if dist.get_rank() == 1:
        for _ in range(late_ops):
            x.add_(1)
    dist.barrier()
    start = labkit.machine.emulate.rank_clock().now()  # no synchronize: what the barrier itself leaves
    for _ in range(ops):
        x.add_(1)
    return labkit.machine.emulate.rank_clock().now() - start


def test_a_barrier_blocks_the_host_so_a_rank_that_waited_in_it_gains_no_head_start():
    """NCCL's barrier blocks the host until the device is done (WorkNCCL::synchronize with a barrier tensor):
    rank 0, which waits in it for rank 1, has issued nothing meanwhile, so its next host-bound operators take
    as long as rank 1's (before the fix, rank 0 ran them at kernel speed on host time it spent waiting)."""
    node = Cluster.resolve("sim:dgx-h100", 2)
    waited_first, late = labkit.launch(_after_a_barrier, 100, 50, world_size=2, cluster=node)
    host_bound = pytest.approx(50 * DISPATCH_S, abs=2e-9)  # a 64-byte add's kernel is shorter than a dispatch
    assert (waited_first, late) == (host_bound, host_bound)


def _sweep(sizes: list[int]) -> list[dict]:
    return bandwidth_test(sizes, iters=3, warmup=1, dtype=torch.bfloat16)


def test_the_simulated_bandwidth_sweep_follows_the_alpha_beta_model_exactly():
    node = Cluster.resolve("sim:dgx-h100", 8)
    sizes = [2**10, 2**20, 2**26, 2**30]
    rows = labkit.launch(_sweep, sizes, world_size=8, cluster=node)[0]
    for row in rows:
        modelled = collective_time_s("all_reduce", row["size_bytes"], 8, node.intra_node)
        assert row["time_ms"] == pytest.approx(modelled * 1e3, rel=1e-6)
    # towards the link: 1 GiB's bus bandwidth 442.6 GB/s, NVLink 4's 450 less the ring's 14 steps of 5 us
    # latency (70 us of 4.24 ms); 1 KiB's far below it
    assert rows[-1]["busbw_GBps"] == pytest.approx(450 * (1 - 70e-6 / (rows[-1]["time_ms"] / 1e3)), rel=1e-6)
    assert rows[0]["busbw_GBps"] < 1


def test_simulated_machines_are_named_and_checked():
    with pytest.raises(ValueError, match="sim:<preset>"):
        Cluster.resolve("sim:dgx-h1000", 2)
    with pytest.raises(ValueError, match="sim:dgx-h100:2"):
        Cluster.resolve("sim:dgx-h100:1", 9)
    assert Cluster.resolve("sim:dgx-h100", 9).nodes == 2  # without a count, as many nodes as the ranks need
    with pytest.raises(ValueError, match="only a described machine"):
        Cluster.emulated(gpus_per_node=2).simulated()
    node = Cluster.resolve("sim:dgx-h200", 8)
    assert node.is_simulated and node.is_emulated and node.clock == "simulated"
    assert node.describe().startswith("Simulated cluster")


def _data_parallel_step() -> tuple[str, float, float]:
    from labkit.models import GPT, GPTConfig
    from labkit.parallel.data import OverlappedDDP, make_ddp

    try:
        make_ddp(torch.nn.Linear(4, 4))
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    config = GPTConfig(n_layers=4, d_model=2048, n_heads=16, vocab_size=50304, seq_len=2048)
    model = OverlappedDDP(GPT(config))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.zeros(1, 2048, dtype=torch.long)
    steps_s, waited_s = [], 0.0
    for _ in range(3):  # the first step also makes the gradients and Adam's state
        dist.barrier()
        start, waited = timer.clock(), timer.waited()
        model(x, x).backward()
        model.finish_gradient_synchronization()
        waited_s = timer.waited() - waited
        opt.step()
        opt.zero_grad(set_to_none=False)
        steps_s.append(timer.clock() - start)
    return refused, steps_s, waited_s


def test_torch_ddp_is_refused_with_the_python_equivalent_and_overlapped_ddp_runs():
    """DDP's C++ constructor reads parameter storage, which FakeTensors lack: make_ddp says so and names
    OverlappedDDP, which runs there, its bucketed all-reduces mostly under the backward pass. After the first,
    every step takes the same modelled time, up to float rounding (why labs time one step there:
    SIMULATED_SIZES)."""
    results = labkit.launch(_data_parallel_step, world_size=4, cluster="sim:dgx-h100")
    for refused, steps_s, waited_s in results:
        assert "cannot run on a simulated machine" in refused and "OverlappedDDP" in refused
        assert 0 < waited_s < 0.5 * steps_s[-1]
        assert steps_s[1] == pytest.approx(steps_s[2], rel=1e-12) and steps_s[0] > steps_s[1], steps_s


def _too_much(gib: int) -> None:
    torch.empty(gib * 2**30, dtype=torch.uint8)


def test_a_rank_that_outgrows_the_simulated_card_fails_with_the_cards_oom():
    oom = r"H100-SXM5-80GB out of memory \(simulated\).*Tried to allocate 81"
    with pytest.raises(labkit.RankError, match=oom):
        labkit.launch(_too_much, 81, world_size=2, cluster="sim:dgx-h100")
    assert labkit.launch(_too_much, 79, world_size=2, cluster="sim:dgx-h100") == [None, None]


def _left_by_a_dropped_wrapper() -> int:
    from labkit.course.training.overlapped import CourseOverlappedDDP
    from labkit.measured_memory import free_memory

    device = labkit.device()
    before = labkit.memory_allocated(device)
    model = CourseOverlappedDDP(torch.nn.Linear(1024, 1024, device=device), bucket_cap_mb=1.0)
    model(torch.randn(8, 1024, device=device)).sum().backward()
    model.finish_gradient_synchronization()
    del model
    free_memory()  # what a cycle holds is gone too
    return labkit.memory_allocated(device) - before


def test_a_dropped_overlapped_ddp_frees_its_model_on_fake_tensors():
    """The course's OverlappedDDP's gradient hooks hold it weakly: with bound methods (the teaching class's)
    the parameters, their gradients and the buckets stayed allocated on a simulated machine (12.6 MB for this
    layer, 10.7 MiB per training job in lab 02), because the garbage collector does not free a cycle through a
    FakeTensor's hooks."""
    assert labkit.launch(_left_by_a_dropped_wrapper, world_size=2, cluster="sim:dgx-h100") == [0, 0]
