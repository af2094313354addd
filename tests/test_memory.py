"""labkit.memory (ZeRO and Korthikanti formulas), labkit.measured_memory (measurement, FakeTensor estimate,
batch finder), labkit.batch and lab 02's driver labkit.experiments.oom_batch."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

import labkit
from labkit.batch import accumulation_steps, choose_micro_batch
from labkit.experiments.oom_batch import (
    DPResult,
    dp_train,
    max_micro_batch,
    rank_micro_batches,
    reference_gradients,
)
from labkit.measured_memory import BatchSearch, estimate_fake, find_max_batch, measure
from labkit.memory import (
    MemoryBreakdown,
    bytes_per_param,
    estimate,
    gpt_activation_bytes,
    korthikanti_activation_bytes,
)
from labkit.models import GPT, GPTConfig, synthetic_batch
from labkit.parallel.data import accumulate_with_no_sync, accumulate_without_no_sync

GB = 1e9  # the ZeRO paper's unit


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------- bytes per parameter


@pytest.mark.parametrize(
    "precision, optimizer, expected",
    [
        ("mixed", "adam", (2, 2, 12)),  # ZeRO: 16 bytes, the course's convention
        ("fp32", "adam", (4, 4, 8)),  # also 16 bytes
        ("mixed_fp32_grads", "adamw", (2, 4, 12)),  # the "18 bytes" of Megatron / HF
        ("bf16", "adam", (2, 2, 4)),
        ("autocast", "adam", (4, 4, 8)),
        ("fp32", "sgd", (4, 4, 0)),
        ("fp32", "sgd_momentum", (4, 4, 4)),
        ("mixed", "sgd", (2, 2, 4)),  # the fp32 master copy stays
    ],
)
def test_bytes_per_param(precision: str, optimizer: str, expected: tuple[int, int, int]) -> None:
    assert bytes_per_param(precision, optimizer) == expected


# ---------------------------------------------------------------- ZeRO worked example


def test_zero_paper_worked_example() -> None:
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam).
    psi, nd = 7_500_000_000, 64
    per_stage = [estimate(params=psi, dp=nd, zero_stage=stage).total for stage in range(4)]
    # (2 + 2 + K) Psi = 120 GB; 2Psi + 2Psi + K Psi/Nd = 31.4 GB;
    # 2Psi + (2 + K) Psi/Nd = 16.6 GB; (2 + 2 + K) Psi/Nd = 1.9 GB.
    assert [round(b / GB, 1) for b in per_stage] == [120.0, 31.4, 16.6, 1.9]
    assert per_stage == [120 * GB, 31.40625 * GB, 16.640625 * GB, 1.875 * GB]
    only = estimate(params=psi, dp=nd, zero_stage=2)
    assert (only.params, only.grads, only.optimizer) == (2 * psi, 2 * psi // nd, 12 * psi // nd)
    assert only.activations == 0 and only.peak == only.total


def test_zero_shards_round_up() -> None:
    result = estimate(params=10, dp=4, zero_stage=3, precision="fp32")
    assert (result.params, result.grads, result.optimizer) == (3 * 4, 3 * 4, 3 * 8)


# ---------------------------------------------------------------- Korthikanti formula


def test_korthikanti_formula_by_hand() -> None:
    # s=4, b=2, h=8, a=2, L=3:  s*b*h = 64
    # none:      per layer 34*64 + 5*a*s*s*b = 2176 + 5*2*16*2 = 2176 + 320 = 2496; x3 = 7488
    # selective: 34*64 = 2176 per layer; x3 = 6528
    # full:      2*64 = 128 per layer; x3 = 384
    args = {"seq_len": 4, "micro_batch": 2, "d_model": 8, "n_heads": 2, "n_layers": 3}
    assert korthikanti_activation_bytes(**args) == 7488
    assert korthikanti_activation_bytes(**args, recompute="selective") == 6528
    assert korthikanti_activation_bytes(**args, recompute="full") == 384
    config = GPTConfig(n_layers=3, d_model=8, n_heads=2, seq_len=4)
    paper = {"model": config, "micro_batch": 2, "activations": "korthikanti"}
    assert estimate(**paper, precision="mixed").activations == 7488
    assert estimate(**paper, precision="bf16", checkpointing=True).activations == 384
    assert estimate(**paper, precision="fp32").activations == 2 * 7488  # course adaptation


def test_korthikanti_gpt3_layer() -> None:
    # One GPT-3 175B layer, s=2048, b=1: sbh(34 + 5as/h) = 2048*12288*(34 + 5*96*2048/12288).
    expected = 2048 * 12288 * (34 + 80)
    assert korthikanti_activation_bytes(2048, 1, 12288, 96) == expected


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"params": 100, "zero_stage": 4}, ["zero_stage=4", "0, 1, 2 or 3"]),
        ({"params": 100, "dp": 0}, ["dp=0", "positive"]),
        ({"params": 100, "precision": "fp8"}, ["'fp8'", "mixed"]),
        ({"params": 100, "optimizer": "lion"}, ["'lion'", "adam"]),
        ({"params": -5}, ["params=-5"]),
        ({}, ["exactly one"]),
        ({"params": 10, "model": GPTConfig()}, ["exactly one"]),
        ({"model": GPTConfig(), "micro_batch": 0}, ["micro_batch=0"]),
        ({"model": GPTConfig(), "seq_len": -1}, ["seq_len=-1"]),
        ({"model": GPTConfig(), "activations": "exact"}, ["'exact'", "korthikanti"]),
    ],
)
def test_estimate_rejects_bad_input(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        estimate(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_korthikanti_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="recompute"):
        korthikanti_activation_bytes(4, 2, 8, 2, recompute="some")
    with pytest.raises(ValueError, match="seq_len=0"):
        korthikanti_activation_bytes(0, 2, 8, 2)


# ---------------------------------------------------------------- estimate vs measure

SMALL = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)


def _lab_step(
    config: GPTConfig,
    micro_batch: int,
    precision: str,
    checkpointing: bool,
    set_to_none: bool,
    accumulate: int = 1,
):
    torch.manual_seed(0)
    model = GPT(config, checkpointing=checkpointing)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        for i in range(accumulate):
            x, y = synthetic_batch(config, micro_batch, step=i)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
                loss = model(x, y) / accumulate
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)

    return step, model, optimizer


@pytest.mark.parametrize(
    "precision, checkpointing, set_to_none",
    [
        ("fp32", False, True),
        ("fp32", False, False),
        ("fp32", True, True),
        ("bf16", False, True),
        ("autocast", False, True),
        ("autocast", True, False),
    ],
)
def test_estimate_within_10_percent_of_measured_peak(
    precision: str, checkpointing: bool, set_to_none: bool
) -> None:
    step, model, optimizer = _lab_step(SMALL, 8, precision, checkpointing, set_to_none)
    measured = measure(step, model, optimizer)
    estimated = estimate(
        model=SMALL,
        precision=precision,
        micro_batch=8,
        checkpointing=checkpointing,
        keep_grads=not set_to_none,
    )
    assert abs(estimated.peak / measured.peak - 1) < 0.10
    # measured categories are exact where the count is simple
    n = SMALL.num_params()
    bytes_per = 2 if precision == "bf16" else 4
    assert measured.params == n * bytes_per
    # Adam: two states per parameter plus one 4-byte step counter per tensor
    n_tensors = len(list(model.parameters()))
    assert measured.optimizer == 2 * n * bytes_per + 4 * n_tensors


def test_activation_count_matches_tensors_saved_for_backward() -> None:
    # Sum the storages autograd saves (parameters excluded) and compare with the count.
    config = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=96, n_kv_heads=2)
    torch.manual_seed(0)
    model = GPT(config)
    x, y = synthetic_batch(config, 3)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations = sum(n for ptr, n in saved.items() if ptr not in params)
    counted = gpt_activation_bytes(config, 3, precision="fp32")
    # not counted: the int64 token ids, targets and positions, and the loss's total weight
    assert 0 <= activations - counted <= 2 * x.numel() * 8 + config.seq_len * 8 + 16


def test_measure_supports_gradient_accumulation() -> None:
    single = measure(*_lab_step(SMALL, 4, "fp32", False, True))
    accumulated = measure(*_lab_step(SMALL, 4, "fp32", False, True, accumulate=3))
    # the second micro-batch runs while the first one's gradients exist
    assert accumulated.peak > single.peak
    estimated = estimate(model=SMALL, precision="fp32", micro_batch=4, keep_grads=True)
    assert abs(estimated.peak / accumulated.peak - 1) < 0.10


def test_estimate_fake_matches_real_measurement() -> None:
    step, model, optimizer = _lab_step(SMALL, 8, "fp32", False, True)
    real = measure(step, model, optimizer)
    fake = estimate_fake(SMALL, 8)
    assert abs(fake.peak / real.peak - 1) < 0.01
    assert fake.params == real.params and fake.optimizer == real.optimizer


def test_estimate_fake_runs_a_model_too_large_for_the_machine() -> None:
    config = GPTConfig.preset("llama2-7b")
    fake = estimate_fake(config, 1, precision="bf16")
    estimated = estimate(model=config, precision="bf16", micro_batch=1)
    assert fake.peak > 50 * 2**30  # far beyond this machine's memory
    assert abs(estimated.peak / fake.peak - 1) < 0.05


def test_estimate_fake_rejects_unsupported_precision() -> None:
    with pytest.raises(ValueError, match="'mixed'"):
        estimate_fake(SMALL, 1, precision="mixed")
    with pytest.raises(ValueError, match="seq_len"):
        estimate_fake(SMALL, 1, seq_len=SMALL.seq_len + 1)


def test_estimate_accepts_a_model_or_its_config() -> None:
    from_config = estimate(model=SMALL, micro_batch=2)
    from_model = estimate(model=GPT(SMALL), micro_batch=2)
    assert from_config == from_model
    plain = estimate(model=torch.nn.Linear(10, 10), precision="fp32")
    assert plain.params == 110 * 4 and plain.activations == 0


def test_checkpointing_and_bf16_shrink_the_estimate() -> None:
    base = estimate(model=SMALL, precision="fp32", micro_batch=8)
    assert estimate(model=SMALL, precision="fp32", micro_batch=8, checkpointing=True).peak < base.peak
    assert estimate(model=SMALL, precision="autocast", micro_batch=8).activations < base.activations


def test_memory_breakdown_helpers() -> None:
    result = MemoryBreakdown(params=2**20, grads=2**20, optimizer=2**21, activations=2**22)
    assert result.total == result.peak == 8 * 2**20
    assert result.mib()["total"] == 8.0
    assert result.gib()["activations"] == 2**22 / 2**30
    assert "total 8.0" in str(result)


# ---------------------------------------------------------------- batch-size finder


def _oom_above(threshold: int):
    calls: list[int] = []

    def step(micro_batch: int) -> None:
        calls.append(micro_batch)
        if micro_batch > threshold:
            raise torch.OutOfMemoryError(f"micro_batch {micro_batch} > {threshold}")

    return step, calls


def test_find_max_batch_doubles_then_bisects() -> None:
    step, calls = _oom_above(37)
    result = find_max_batch(step, limit=1024)
    assert isinstance(result, BatchSearch)
    assert result.batch == 37
    assert len(result.trials) == len(calls) <= 2 * math.log2(37) + 2
    assert [b for b, _ in result.trials] == calls
    assert all(fits == (b <= 37) for b, fits in result.trials)
    assert [b for b, _ in result.trials[:7]] == [1, 2, 4, 8, 16, 32, 64]
    assert not result.hit_limit


@pytest.mark.parametrize(
    "threshold, start, limit, expected",
    [
        (1, 1, 64, 1),
        (0, 1, 64, 0),  # nothing fits
        (5, 8, 64, 5),  # start too large: bisect below it
        (1000, 1, 48, 48),  # everything fits up to the limit
        (64, 1, 64, 64),
    ],
)
def test_find_max_batch_edges(threshold: int, start: int, limit: int, expected: int) -> None:
    step, _ = _oom_above(threshold)
    result = find_max_batch(step, start=start, limit=limit)
    assert result.batch == expected
    assert result.hit_limit == (expected == limit)


def test_find_max_batch_frees_the_failed_step() -> None:
    refs: list[weakref.ref] = []

    def step(micro_batch: int) -> None:
        activations = torch.empty(micro_batch, 1024)
        cycle: dict = {"activations": activations}
        cycle["self"] = cycle  # only gc.collect() can free this
        refs.append(weakref.ref(activations))
        del activations
        if micro_batch > 10:
            raise torch.OutOfMemoryError("emulated")

    result = find_max_batch(step, limit=64)
    assert result.batch == 10
    assert all(ref() is None for ref in refs)


def test_find_max_batch_lets_other_errors_through() -> None:
    def step(micro_batch: int) -> None:
        raise RuntimeError("a bug, not an OOM")

    with pytest.raises(RuntimeError, match="a bug"):
        find_max_batch(step)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"start": 0}, "start=0"),
        ({"limit": -1}, "limit=-1"),
        ({"start": 8, "limit": 4}, "start\\(8\\) > limit\\(4\\)"),
    ],
)
def test_find_max_batch_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        find_max_batch(lambda b: None, **kwargs)


# ---------------------------------------------------------------- measure leaves nothing behind


def test_measure_leaves_no_parameters_alive() -> None:
    # MemTracker's ModTracker puts backward hooks whose closures hold autograd nodes: a cycle
    # through C++ that leaked every tracked step's parameters and gradients (torch 2.13).
    import gc

    step, model, optimizer = _lab_step(SMALL, 2, "fp32", False, True)
    refs = [weakref.ref(p) for p in model.parameters()]
    measure(step, model, optimizer)
    del step, model, optimizer
    gc.collect()
    assert [r for r in refs if r() is not None] == []


# ---------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize(
    "global_batch, micro_batch, world_size, steps",
    [(64, 4, 2, 8), (64, 32, 2, 1), (12, 3, 4, 1), (48, 2, 3, 8), (1, 1, 1, 1)],
)
def test_accumulation_steps(global_batch: int, micro_batch: int, world_size: int, steps: int) -> None:
    assert accumulation_steps(global_batch, micro_batch, world_size) == steps
    assert micro_batch * steps * world_size == global_batch


@pytest.mark.parametrize(
    "args, words",
    [
        (
            (64, 6, 2),
            [
                "global_batch(64)",
                "micro_batch(6)",
                "world_size(2) = 12",
                "divides global_batch / world_size = 32",
                "1, 2, 4, 8, 16, 32",
            ],
        ),
        ((65, 4, 2), ["global_batch(65)", "use global_batch=64 or 72"]),
        ((64, 64, 2), ["micro_batch(64) x world_size(2) = 128 > global_batch(64)", "1, 2, 4, 8, 16, 32"]),
        ((-8, 2, 2), ["global_batch=-8", "positive"]),
        ((64, 0, 2), ["micro_batch=0", "positive"]),
        ((64, 4, 0), ["world_size=0", "positive"]),
        ((64, 4.0, 2), ["micro_batch=4.0"]),
        ((64, True, 2), ["micro_batch=True"]),
    ],
)
def test_accumulation_steps_rejects_bad_sizes(args: tuple, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        accumulation_steps(*args)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "global_batch, world_size, max_fit, expected",
    [(64, 2, 30, 16), (64, 2, 6, 4), (64, 2, 32, 32), (64, 2, 1000, 32), (48, 2, 5, 4), (64, 2, 1, 1)],
)
def test_choose_micro_batch(global_batch: int, world_size: int, max_fit: int, expected: int) -> None:
    micro = choose_micro_batch(global_batch, world_size, max_fit)
    assert micro == expected
    accumulation_steps(global_batch, micro, world_size)  # divides


def test_choose_micro_batch_rejects_nothing_fits_and_uneven_batches() -> None:
    with pytest.raises(ValueError, match="max_fit=0.*not even a micro-batch of 1"):
        choose_micro_batch(64, 2, 0)
    with pytest.raises(ValueError, match="global_batch\\(63\\)"):
        choose_micro_batch(63, 2, 8)


def test_rank_micro_batches_cover_the_global_batch_in_order() -> None:
    config = GPTConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8, vocab_size=32)
    x, y = synthetic_batch(config, 24, seed=3, step=1)
    rows = [rank_micro_batches(config, 24, 4, rank, 3, step=1, seed=3) for rank in range(3)]
    assert all(len(r) == 2 and r[0][0].shape == (4, 8) for r in rows)
    assert torch.equal(torch.cat([mx for r in rows for mx, _ in r]), x)
    assert torch.equal(torch.cat([my for r in rows for _, my in r]), y)
    with pytest.raises(ValueError, match="rank=3"):
        rank_micro_batches(config, 24, 4, 3, 3)


def test_reference_gradients_equal_accumulated_micro_batches() -> None:
    config = GPTConfig(n_layers=1, d_model=32, n_heads=2, seq_len=16, vocab_size=64)
    reference = reference_gradients(config, 8, seed=1)
    torch.manual_seed(1)
    model = GPT(config)
    batches = rank_micro_batches(config, 8, 2, 0, 1, seed=1)
    for x, y in batches:
        (model(x, y) / len(batches)).backward()
    accumulated = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert reference.shape == (config.num_params(),)
    assert (accumulated - reference).abs().max().item() < 1e-6


def test_dp_train_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="labkit.launch"):
        dp_train(SMALL, 8, 4)


def _dp_worker(config: GPTConfig, global_batch: int, micro_batch: int) -> dict:
    # 0.1 MB buckets: this 0.45 MB model gets several once DDP has rebuilt them after step 1
    with_sync = dp_train(
        config,
        global_batch,
        micro_batch,
        accumulate=accumulate_with_no_sync,
        return_grads=True,
        breakdown=True,
        bucket_cap_mb=0.1,
    )
    without = dp_train(
        config,
        global_batch,
        micro_batch,
        accumulate=accumulate_without_no_sync,
        return_grads=True,
        bucket_cap_mb=0.1,
    )
    single = dp_train(config, global_batch, global_batch // 2)  # as first written: one micro-step
    budget = labkit.emulate.active_budget()
    search = max_micro_batch(config, precision="autocast", checkpointing=True, limit=64)
    return {
        "with": with_sync,
        "without": without,
        "single": single,
        "search": search,
        "left": budget.allocated,
    }


def test_dp_train_accumulation_matches_the_big_batch_and_counts_allreduces() -> None:
    config = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=128)
    cluster = labkit.Cluster.emulated(gpus_per_node=2, memory_gib=8 / 1024)
    global_batch, micro = 16, 2
    out = labkit.launch(_dp_worker, config, global_batch, micro, world_size=2, cluster=cluster, timeout_s=120)
    reference = reference_gradients(config, global_batch)
    steps = accumulation_steps(global_batch, micro, 2)
    for rank, result in enumerate(out):
        good, naive = result["with"], result["without"]
        assert isinstance(good, DPResult) and good.rank == rank and good.accumulation_steps == steps
        # the same gradient as the big batch, with or without no_sync
        assert (good.grads - reference).abs().max().item() < 1e-5
        assert (naive.grads - reference).abs().max().item() < 1e-5
        # one pass over the buckets per optimizer step with no_sync; one per micro-step without
        assert good.buckets > 1
        assert good.allreduce_calls == good.buckets
        assert naive.allreduce_calls == steps * naive.buckets
        assert naive.allreduce_bytes == steps * good.allreduce_bytes
        # DDP adds no memory to the estimate (gradients live in its buckets)
        est = estimate(model=config, precision="fp32", micro_batch=micro, keep_grads=True)
        assert abs(est.peak / good.peak_bytes - 1) < 0.10
        assert good.peak_source == "emulated budget" and good.breakdown is not None
        assert good.breakdown.peak == pytest.approx(good.peak_bytes, rel=0.02)
        assert naive.peak_bytes == pytest.approx(good.peak_bytes, rel=0.01)
        # the whole share in one micro-step needs more memory; the search leaves nothing behind
        assert result["single"].peak_bytes > good.peak_bytes
        assert result["search"].batch >= 1 and result["left"] < 2**20


def test_estimate_takes_model_sizes_written_as_floats():
    assert estimate(params=7.5e9).total == estimate(params=7_500_000_000).total
    with pytest.raises(ValueError, match="params=7500000000.5"):
        estimate(params=7.5e9 + 0.5)


def test_a_gpu_budget_is_set_above_the_warm_baseline_and_peaks_are_net_of_it(monkeypatch):
    # Mocked CUDA: after the warm-up the process holds 80 MiB reserved, 66 MiB allocated (context buffers and two
    # cuBLAS workspaces). A 48 MiB budget from zero would OOM on those; the cap goes above them instead.
    import types

    from labkit import runtime

    MiB = 2**20
    calls = {}
    monkeypatch.setenv("LABKIT_GPU_BASELINE_BYTES", "0")  # undone after the test, whatever the cap sets
    monkeypatch.setattr(runtime, "_warm_up_cuda", lambda dev: calls.setdefault("warm", dev))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=1024 * MiB)
    )
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 80 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 66 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: 100 * MiB)
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, dev=None: calls.update(fraction=fraction),
    )
    assert runtime.cap_above_baseline(0, 48 / 1024) == 66 * MiB
    assert calls["warm"] == torch.device("cuda", 0) and calls["fraction"] == pytest.approx((80 + 48) / 1024)
    monkeypatch.setattr(runtime, "on_gpu", lambda: True)
    monkeypatch.setattr(runtime, "device", lambda: torch.device("cuda", 0))
    peak, source = runtime.peak_bytes()
    assert peak == 34 * MiB and source == "torch.cuda.max_memory_allocated, net of the warm baseline"
    assert runtime.memory_allocated(torch.device("cuda", 0)) == 0  # the baseline itself is not the lab's
