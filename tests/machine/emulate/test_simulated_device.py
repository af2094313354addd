"""The simulated GPU (labkit.machine.emulate.SimulatedDevice): each operator on FakeTensors timed on a
described GPU, memory held to the card. In one process, no ranks: the launch-level tests are
test_simulated_cluster.py."""

from __future__ import annotations

import pytest
import torch

from labkit import op_time
from labkit.cluster import Cluster
from labkit.machine import _torch_compat as compat
from labkit.machine.emulate import SimulatedDevice, VirtualClock, active_budget
from labkit.memory import estimate
from labkit.models import GPT, GPTConfig, gpt_in
from labkit.planner import forward_flops_per_token

H100 = Cluster.preset("dgx-h100").gpu_spec()


def test_a_matmul_advances_the_clock_by_its_modelled_time_and_a_view_by_nothing():
    clock = VirtualClock(modelled=True)
    with compat.fake_tensor_mode():
        a = torch.empty(8192, 4096, dtype=torch.bfloat16)
        b = torch.empty(4096, 8192, dtype=torch.bfloat16)
        with SimulatedDevice(H100, clock) as dev:
            c = a @ b
            after_mm = clock.now()
            c.t()
            c.view(-1)
            torch.empty(1024, 1024)
    nbytes = 2 * (8192 * 4096 * 2 + 8192 * 8192)
    kernel = op_time.kernel_s(H100, nbytes=nbytes, matmul=(1, 8192, 8192, 4096))
    # the first kernel starts once the host has issued it
    assert after_mm == pytest.approx(op_time.DISPATCH_S + kernel, abs=1e-9)
    assert clock.now() == after_mm  # a transpose, a view and an allocation launch no kernel
    assert dev.times.ops["matmul"] == 1 and dev.times.flops == 2 * 8192 * 8192 * 4096
    assert isinstance(c, torch.Tensor) and c.shape == (8192, 8192)


def test_an_optimizers_step_count_is_read_on_the_host_and_its_device_query_costs_nothing():
    """Adam keeps each parameter's step count in a CPU tensor beside CUDA parameters and reads it with
    `.item()`; on a simulated card that count is a FakeTensor carrying its value: read, it gives the value
    and launches no kernel. A FakeTensor's device is what it was made on, no kernel either."""
    clock = VirtualClock(modelled=True)
    with compat.fake_tensor_mode():
        step = torch.tensor(3.0)
        with SimulatedDevice(H100, clock) as dev:
            step.add_(1)  # a kernel, as torch._foreach_add_ over the counts is
            after_add = clock.now()
            assert step.item() == 4.0 and str(step.device) == "cpu"
            x = torch.empty(4, 4, device="cuda")
            assert x.device == torch.device("cuda", 0)
    assert clock.now() == after_add and dev.times.ops["other"] == 1


def test_a_gpt_step_at_gpu_size_counts_the_planners_flops():
    """Every linear layer of a 4-layer, 4096-wide GPT at 2048 tokens, forward and backward: the matmul FLOPs
    the simulated device counts are three times the planner's forward FLOPs (backward is twice the forward),
    and attention's are its forward's 3.5 times (backward 2.5x), causal halved."""
    cfg = GPTConfig(n_layers=4, d_model=4096, n_heads=32, vocab_size=50304, seq_len=2048)
    tokens, s, d = 2048, 2048, 4096
    clock = VirtualClock(modelled=True)
    with compat.fake_tensor_mode():
        model = gpt_in(cfg, torch.bfloat16)
        x = torch.zeros(1, s, dtype=torch.long)
        with SimulatedDevice(H100, clock) as dev:
            dev.track(model)
            model(x, x).backward()
    block, head = forward_flops_per_token(cfg)
    attention_fwd = 4.0 * s * d / 2  # per token per block, causal
    matmuls = 3 * tokens * (cfg.n_layers * (block - 4.0 * s * d) + head)
    attention = 3.5 * tokens * cfg.n_layers * attention_fwd
    assert dev.times.flops == pytest.approx(matmuls + attention, rel=1e-6)
    assert dev.times.ops["attention"] == 2 * cfg.n_layers
    assert clock.now() == pytest.approx(dev.times.total_s, rel=1e-6)
    # the matmuls near the measured 80 % of the peak, the step at most that fast
    achieved = dev.times.flops / dev.times.total_s
    assert 0.5 * 989e12 < achieved < 0.8 * 989e12


def test_an_oom_happens_where_the_memory_estimate_says_the_card_runs_out():
    """A 1.3B GPT in fp32 with Adam on an 80 GiB H100: labkit.memory.estimate says micro-batch 8 peaks at
    73.4 GiB and 9 at 80.5 GiB; the simulated card fits 8 and runs out at 9."""
    cfg = GPTConfig(n_layers=24, d_model=2048, n_heads=16, vocab_size=50304, seq_len=2048)
    card = H100.memory_gib * 2**30
    fits = estimate(model=cfg, precision="fp32", micro_batch=8)
    over = estimate(model=cfg, precision="fp32", micro_batch=9)
    assert fits.peak < card < over.peak

    def step(micro_batch: int) -> SimulatedDevice:
        with compat.fake_tensor_mode(), SimulatedDevice(H100, rank=3) as dev:
            model = GPT(cfg)
            opt = torch.optim.Adam(model.parameters())
            x = torch.zeros(micro_batch, cfg.seq_len, dtype=torch.long)
            for _ in range(2):  # the second step holds Adam's states
                model(x, x).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return dev

    assert step(8).peak == pytest.approx(fits.peak, rel=0.01)
    with pytest.raises(torch.OutOfMemoryError, match=r"H100-SXM5-80GB out of memory \(simulated\).*Rank 3"):
        step(9)


def test_the_device_is_the_ranks_memory_budget_and_a_limit_narrows_it():
    with compat.fake_tensor_mode(), SimulatedDevice(H100) as dev:
        assert active_budget() is dev
        kept = torch.zeros(256, 2**20, dtype=torch.bfloat16)  # 512 MiB
        with dev.limited(100 * 2**20), pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 128"):
            torch.zeros(64, 2**20, dtype=torch.bfloat16)  # 128 MiB over a 100 MiB limit
        assert dev.limit_bytes == 80 * 2**30
        assert dev.allocated == kept.numel() * 2
        del kept
        assert dev.allocated == 0 and dev.peak == 512 * 2**20


def test_short_kernels_wait_for_the_host_and_long_ones_hide_it():
    """The host issues one operator per DISPATCH_S, ahead of the device: a run of tiny additions is
    host-bound (one dispatch each), while the dispatches behind a long matmul cost nothing."""
    clock = VirtualClock(modelled=True)
    with compat.fake_tensor_mode():
        small = torch.empty(64)
        a = torch.empty(8192, 8192, dtype=torch.bfloat16)
        with SimulatedDevice(H100, clock) as dev:
            for _ in range(100):
                small = small + 1
            tiny = clock.now()
            a @ a  # a 1.4 ms kernel ...
            for _ in range(50):  # ... behind which the host issues these
                small = small + 1
            dev.synchronize()
    assert tiny == pytest.approx(100 * op_time.DISPATCH_S, abs=1e-7)  # the clock counts whole nanoseconds
    matmul = op_time.kernel_s(H100, nbytes=3 * 8192 * 8192 * 2, matmul=(1, 8192, 8192, 8192))
    add = op_time.kernel_s(H100, nbytes=2 * 64 * 4)
    assert clock.now() - tiny == pytest.approx(op_time.DISPATCH_S + matmul + 50 * add, abs=1e-7)
    # the device idled for the host before the matmul, nearly all of the first 100 dispatches
    assert 0.9 * 100 * op_time.DISPATCH_S < dev.times.seconds["host"] < 102 * op_time.DISPATCH_S


def test_a_simulated_device_needs_a_modelled_clock():
    with pytest.raises(ValueError, match="modelled clock"):
        SimulatedDevice(H100, VirtualClock())
    with pytest.raises(RuntimeError, match="modelled clock"):
        VirtualClock().spend(1.0)


def test_a_storage_resized_in_place_frees_and_takes_back_its_bytes():
    # FSDP2 frees a gathered parameter so (free_storage / alloc_storage), keeping the tensor
    with compat.fake_tensor_mode(), SimulatedDevice(H100) as dev:
        t = torch.zeros(64, 2**20, dtype=torch.bfloat16)  # 128 MiB
        t.untyped_storage().resize_(0)
        assert dev.allocated == 0 and dev.peak == 128 * 2**20
        t.untyped_storage().resize_(256 * 2**20)
        assert dev.allocated == 256 * 2**20 == dev.peak
        with dev.limited(0), pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 256"):
            t.untyped_storage().resize_(512 * 2**20)
        del t
        assert dev.allocated == 0


def test_a_dtensor_costs_its_local_shard_not_its_global_shape():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        with compat.fake_tensor_mode(), SimulatedDevice(H100) as dev:
            local = torch.zeros(1024, 1024)  # 4 MiB: this rank's quarter of a 4096 x 1024 parameter
            d = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=(4096, 1024), stride=(1024, 1)
            )
            e = d * 2  # one kernel over the local 4 MiB, into a new local 4 MiB
            assert isinstance(e, DTensor) and e.shape == (4096, 1024)
            assert dev.allocated == 8 * 2**20  # not the wrappers' 16 MiB each
            assert dev.times.ops["other"] == 2  # zeros and the product
    finally:
        dist.destroy_process_group()
