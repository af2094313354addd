"""labkit.memory: bytes per parameter, ZeRO's worked example, the estimate's rejections, its agreement with a
measured step (labkit.measured_memory.measure) and with the tensors autograd saves, model-parallel memory
(what each pipeline stage and tensor-parallel shard holds), and on a GPU against CUDA's allocator."""

from __future__ import annotations

import pytest
import torch

from labkit import launch
from labkit.measured_memory import measure
from labkit.memory import (
    MemoryBreakdown,
    TrainingSetup,
    bytes_per_param,
    estimate,
    gpt_activation_bytes,
    stage_params,
)
from labkit.models import GPT, GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.pipeline import GPTStage, even_split
from labkit.parallel.tensor import shard_state

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


def test_estimate_takes_model_sizes_written_as_floats():
    assert estimate(params=7.5e9).total == estimate(params=7_500_000_000).total
    with pytest.raises(ValueError, match=r"params=7500000000\.5"):
        estimate(params=7.5e9 + 0.5)


# ---------------------------------------------------------------- activations


def test_estimate_uses_korthikanti_s_count_when_asked() -> None:
    # the paper's bytes (2-byte activations) for s=4, b=2, h=8, a=2, L=3: 7488, full recompute 384
    # (worked by hand in tests/test_activations.py); fp32 doubles them (the course's adaptation)
    config = GPTConfig(n_layers=3, d_model=8, n_heads=2, seq_len=4)
    paper = {"model": config, "micro_batch": 2, "activations": "korthikanti"}
    assert estimate(**paper, precision="mixed").activations == 7488
    assert estimate(**paper, precision="bf16", checkpointing=True).activations == 384
    assert estimate(**paper, precision="fp32").activations == 2 * 7488  # course adaptation


def test_estimate_selective_recomputation() -> None:
    # Korthikanti's count for s=4, b=2, h=8, a=2, L=3 (tests/test_activations.py): none 7488, selective 34*sbh
    # = 6528 per 3 layers, full 384, in 16-bit; bools keep their meaning (True: full, False: none).
    config = GPTConfig(n_layers=3, d_model=8, n_heads=2, seq_len=4)
    paper = {"model": config, "micro_batch": 2, "activations": "korthikanti", "precision": "mixed"}
    by_mode = {m: estimate(**paper, checkpointing=m).activations for m in ("none", "selective", "full")}
    assert by_mode == {"none": 7488, "selective": 6528, "full": 384}
    assert estimate(**paper, checkpointing=False) == estimate(**paper, checkpointing="none")
    assert estimate(**paper, checkpointing=True) == estimate(**paper, checkpointing="full")
    assert "selective recomputation" in estimate(**paper, checkpointing="selective").source
    # Our GPT's fused attention keeps no s*s scores (the count above matches what autograd saves), so
    # selective recomputation has nothing left to drop there.
    ours = {"model": SMALL, "micro_batch": 8, "precision": "fp32"}
    assert estimate(**ours, checkpointing="selective").peak == estimate(**ours).peak
    assert estimate(**ours, checkpointing="full").peak < estimate(**ours).peak
    # Llama-2-7B's sizes at s = 4096, one sequence, Korthikanti's count: 32 layers x sbh(34 + 5as/h),
    # 5as/h = 5 * 32 * 4096 / 4096 = 160: 194 x 2**24 x 32 bytes = 97 GiB; selective 34/194 of it, 17 GiB.
    big = {"model": GPTConfig.preset("llama2-7b"), "seq_len": 4096, "activations": "korthikanti"}
    assert estimate(**big).activations == 32 * 4096 * 4096 * 194 == 97 * 2**30
    assert estimate(**big, checkpointing="selective").activations == 17 * 2**30
    assert estimate(**big, checkpointing="full").activations == 2**30


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


def test_checkpointing_and_bf16_shrink_the_estimate() -> None:
    base = estimate(model=SMALL, precision="fp32", micro_batch=8)
    assert estimate(model=SMALL, precision="fp32", micro_batch=8, checkpointing=True).peak < base.peak
    assert estimate(model=SMALL, precision="autocast", micro_batch=8).activations < base.activations


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
        ({"params": 100, "checkpointing": "attention"}, ["checkpointing='attention'", "'selective'", "bool"]),
        ({"params": 100, "checkpointing": 1}, ["checkpointing=1", "'none', 'selective', 'full'"]),
    ],
)
def test_estimate_rejects_bad_input(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        estimate(**kwargs)
    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------- estimate vs measure

SMALL = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)


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
    lab_step, precision: str, checkpointing: bool, set_to_none: bool
) -> None:
    step, model, optimizer = lab_step(SMALL, 8, precision, checkpointing, set_to_none)
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


LLAMA = GPTConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, seq_len=64, block="llama", ffn_hidden=160)


@pytest.mark.parametrize(
    "precision, checkpointing", [("fp32", False), ("fp32", True), ("bf16", False), ("autocast", False)]
)
def test_a_llama_blocks_estimate_is_within_10_percent_of_measured_peak(
    lab_step, precision: str, checkpointing: bool
) -> None:
    """RMSNorm, rotary and SwiGLU save more than LayerNorm and GELU (labkit.activations._llama_block_bytes):
    1.07, 1.00, 0.93 and 1.01 of the measured peak when written (0.68-0.79 counted as a GPT-2 block)."""
    step, model, optimizer = lab_step(LLAMA, 8, precision, checkpointing, True)
    measured = measure(step, model, optimizer)
    estimated = estimate(model=LLAMA, precision=precision, micro_batch=8, checkpointing=checkpointing)
    assert abs(estimated.peak / measured.peak - 1) < 0.10
    assert measured.params == LLAMA.num_params() * (2 if precision == "bf16" else 4)


def test_estimate_accepts_a_model_or_its_config() -> None:
    from_config = estimate(model=SMALL, micro_batch=2)
    from_model = estimate(model=GPT(SMALL), micro_batch=2)
    assert from_config == from_model
    plain = estimate(model=torch.nn.Linear(10, 10), precision="fp32")
    assert plain.params == 110 * 4 and plain.activations == 0


def test_memory_breakdown_helpers() -> None:
    result = MemoryBreakdown(params=2**20, grads=2**20, optimizer=2**21, activations=2**22)
    assert result.total == result.peak == 8 * 2**20
    assert result.mib()["total"] == 8.0
    assert result.gib()["activations"] == 2**22 / 2**30
    assert "total 8.0" in str(result)


# ---------------------------------------------------------------- model parallelism


PLANNED = GPTConfig(n_layers=8, d_model=128, n_heads=8, vocab_size=1024, seq_len=64)  # lab 01's model
TINY = GPTConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=8)


def test_model_parallel_memory_counts_what_each_rank_holds():
    model = seeded_model(TINY)
    for pp in (1, 2, 4):
        sizes = even_split(TINY, pp)
        starts = [sum(sizes[:k]) for k in range(pp + 1)]
        for s in range(pp):
            held = sum(p.numel() for p in GPTStage(model, starts[s], starts[s + 1]).parameters())
            assert stage_params(TINY, 1, pp, s) == held
    # tp > 1: the estimate's count is what the tensor-parallel slicing rule keeps on a rank
    for config in (
        TINY,
        GPTConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=8),
    ):
        full = dict(seeded_model(config).named_parameters())
        for tp in (2, 4) if config.kv_heads % 4 == 0 else (2,):
            kept = sum(t.numel() for t in shard_state(full, config, 0, tp).values())
            assert stage_params(config, tp) == kept, (config, tp)
    one = estimate(model=PLANNED, precision="fp32", micro_batch=4)
    assert estimate(model=PLANNED, precision="fp32", micro_batch=4, tp=1, pp=1) == one
    tp2 = estimate(model=PLANNED, precision="fp32", micro_batch=4, tp=2)
    assert tp2.params < one.params and tp2.activations < one.activations and "tp=2" in tp2.source
    # 1F1B: stage 0 holds p micro-batches of its L/p blocks, about one micro-batch of the whole model's blocks
    pp4 = estimate(model=PLANNED, precision="fp32", micro_batch=4, pp=4, micro_batches=8)
    assert "stage 0" in pp4.source and pp4.params < one.params
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide n_heads=8"):
        estimate(model=PLANNED, tp=3)
    with pytest.raises(ValueError, match="pp=9 pipeline stages for 8 blocks"):
        estimate(model=PLANNED, pp=9)


# ---------------------------------------------------------------- on a GPU


def _estimate_vs_allocator(micro_batch: int) -> dict:
    """One rank: the peak of a training step net of what the process held before it, against the estimate."""
    from labkit.models import seeded_model

    config = GPTConfig(n_layers=4, d_model=256, n_heads=8, vocab_size=8192, seq_len=256)
    dev = torch.device("cuda", torch.cuda.current_device())
    model = seeded_model(config, 0, dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(config, micro_batch, device=dev)
    model(x, y).backward()  # warm-up: cuBLAS workspaces, Adam's states, the allocator's first segments
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    baseline = (
        torch.cuda.memory_allocated(dev)
        - sum(p.numel() * p.element_size() for p in model.parameters())
        - sum(
            v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
        )
    )
    torch.cuda.reset_peak_memory_stats(dev)
    model(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - baseline
    want = estimate(model=config, micro_batch=micro_batch, precision="fp32", optimizer="adam").peak
    return {"peak": peak, "estimate": want, "baseline": baseline}


@pytest.mark.gpu
def test_the_memory_estimate_is_within_10_percent_of_cuda_net_of_the_baseline():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    (r,) = launch(_estimate_vs_allocator, 8, world_size=1, cluster="gpu", timeout_s=300)
    assert abs(r["peak"] - r["estimate"]) <= 0.1 * r["estimate"], r


@pytest.mark.parametrize(
    "options, moment",
    [
        ({"seq_len": 4096}, "backward"),  # activations outweigh the gradients
        ({"seq_len": 512}, "optimizer"),  # the gradients outweigh the activations
        ({"seq_len": 4096, "checkpointing": True}, "recomputation"),
        ({"seq_len": 512, "checkpointing": True, "keep_grads": True}, "backward"),
    ],
)
def test_an_estimate_says_when_its_step_peaks(options, moment):
    """`peak_at` names the moment `peak` is taken at (labkit.memory.PEAK_MOMENTS), so a picture of what is
    alive then needs no guess from the numbers; a measurement has none."""
    from labkit.memory import PEAK_MOMENTS

    b = estimate(model=GPTConfig.preset("llama2-7b"), dp=8, zero_stage=1, micro_batch=1, **options)
    assert b.peak_at == moment and moment in PEAK_MOMENTS
    if moment == "optimizer":
        assert b.peak == b.params + b.optimizer + b.grads
    if moment == "backward" and "checkpointing" not in options:
        assert b.peak == b.params + b.optimizer + b.activations + b.other


def test_for_each_adam_holds_one_more_copy_of_its_states_in_its_step_which_the_estimate_counts() -> None:
    """torch's for-each Adam (the default for CUDA tensors) takes sqrt(exp_avg_sq) of every parameter into new
    tensors at once (`_multi_tensor_adam`): where the optimizer step is the step's peak (one sequence, few
    activations) it holds one fp32 copy of the parameters beside them (the for-loop Adam, torch's default on
    CPU tensors, one or two copies of the largest tensor at a time), and `estimate(..., foreach=True)` counts
    it; without it the estimate falls short by that copy."""
    from labkit.machine.emulate import MemoryBudget

    config = GPTConfig(n_layers=2, d_model=128, n_heads=4, vocab_size=64, seq_len=4)
    peaks = {}
    for foreach in (False, True):
        with MemoryBudget(2**30) as budget:
            model = seeded_model(config, 0)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
            x, y = synthetic_batch(config, 1)
            for _ in range(2):  # the first step makes Adam's states
                model(x, y).backward()
                budget.reset_peak()
                opt.step()
                opt.zero_grad(set_to_none=False)
            peaks[foreach] = budget.peak
    n = config.num_params()
    assert peaks[True] > peaks[False] + 2 * n  # measured: 8.27 MB against 7.15 for 413,696 parameters
    on_cuda = estimate(model=config, precision="fp32", micro_batch=1, keep_grads=True, foreach=True)
    assert on_cuda.peak_at == "optimizer"
    assert on_cuda.peak == pytest.approx(peaks[True], rel=0.02)  # 16 + 4 bytes per parameter
    loop = estimate(model=config, precision="fp32", micro_batch=1, keep_grads=True)
    assert on_cuda.peak == on_cuda.params + on_cuda.grads + on_cuda.optimizer + 4 * n
    assert loop.peak / peaks[True] < 0.85  # the estimate without the term misses it


def test_a_setup_gives_the_same_estimate_as_its_fields_as_keywords():
    config = GPTConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    setup = TrainingSetup(dp=4, zero_stage=3, precision="fp32", micro_batch=2, tp=2, checkpointing="full")
    keywords = estimate(
        model=config, dp=4, zero_stage=3, precision="fp32", micro_batch=2, tp=2, checkpointing=True
    )
    assert estimate(model=config, setup=setup) == keywords


def test_estimate_names_a_setting_it_does_not_have_and_refuses_a_setup_with_keywords():
    with pytest.raises(ValueError, match=r"got dpp, which TrainingSetup does not have; its fields: .*dp"):
        estimate(params=1000, dpp=2)
    with pytest.raises(ValueError, match="a setup or its fields as keywords, not both"):
        estimate(params=1000, setup=TrainingSetup(), dp=2)
    with pytest.raises(ValueError, match="zero_stage=4 must be a ZeRO stage"):
        TrainingSetup(zero_stage=4)
