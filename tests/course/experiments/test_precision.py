"""labkit.course.experiments.precision: fp32 vs bf16 vs fp16 (+ GradScaler) on one process, and a forced
overflow."""

from __future__ import annotations

import pytest

from labkit.course.experiments.precision import VARIANTS, compare_precisions, forced_overflow
from labkit.models import GPTConfig

TINY = GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
BATCH = 4

# Measured on CPU (torch 2.13) at seeds 0..4, first step: bf16 2.7e-3..5.3e-3, fp16 5.3e-4..7.8e-4
# of the largest fp32 gradient. The bounds leave about 10x margin; fp16's 10 mantissa bits
# against bf16's 7 make it the closer one.
BF16_TOL = 5e-2
FP16_TOL = 1e-2


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def compared(one_thread):
    return compare_precisions(TINY, BATCH, steps=3, device="cpu")


@pytest.fixture(scope="module")
def overflow(one_thread):
    return forced_overflow(TINY, BATCH, device="cpu")


def test_gradients_close_to_fp32(compared):
    assert compared["fp32"]["grad_rel_diff"] == 0.0
    assert 0 < compared["bf16"]["grad_rel_diff"] < BF16_TOL
    assert 0 < compared["fp16"]["grad_rel_diff"] < FP16_TOL
    assert compared["fp16"]["grad_rel_diff"] < compared["bf16"]["grad_rel_diff"]
    # unscaled: fp16's gradient is the true one, not 65536 times it
    assert compared["fp16"]["grad_max_abs"] == pytest.approx(compared["fp32"]["grad_max_abs"], rel=FP16_TOL)


def test_losses_scales_and_no_skips(compared):
    for name in VARIANTS:
        run = compared[name]
        assert len(run["losses"]) == 3 and run["losses"][-1] < run["losses"][0], name
        assert run["skipped_steps"] == 0, name
    assert compared["fp16"]["scales"] == [2.0**16] * 3  # GradScaler's init_scale; growth needs 2000 steps
    assert compared["fp32"]["scales"] == [] and compared["bf16"]["scales"] == []
    assert compared["fp32"]["dtype"] == "float32" and compared["fp16"]["dtype"] == "float16"


def test_memory_activations_shrink_model_states_do_not(compared):
    fp32, bf16, fp16 = (compared[name] for name in ("fp32", "bf16", "fp16"))
    # fp16 and bf16 are both 2 bytes: the same activations (fp16 also keeps the scaled loss)
    assert fp16["activation_bytes"] == pytest.approx(bf16["activation_bytes"], rel=0.02)
    assert bf16["activation_bytes"] < 0.9 * fp32["activation_bytes"]
    assert fp16["activation_bytes"] < 0.9 * fp32["activation_bytes"]
    # autocast keeps fp32 weights, fp32 gradients and fp32 AdamW states: 16 bytes per parameter
    states = {compared[name]["model_state_bytes"] for name in VARIANTS}
    assert len(states) == 1
    assert states.pop() >= 16 * TINY.num_params()
    for name in VARIANTS:
        memory = compared[name]["breakdown"]
        assert compared[name]["peak_bytes"] == memory.peak == memory.total
        assert memory.params == 4 * TINY.num_params()
    assert fp16["peak_bytes"] < fp32["peak_bytes"] and bf16["peak_bytes"] < fp32["peak_bytes"]


def test_forced_overflow_skips_one_step_and_halves_scale(overflow):
    assert overflow["skipped"] is True
    assert overflow["params_changed"] is False  # bit-identical (torch.equal)
    assert overflow["scale_before"] == 2.0**16
    assert overflow["scale_after"] == overflow["scale_before"] * 0.5  # backoff_factor
    assert overflow["next_skipped"] is False
    assert overflow["next_params_changed"] is True
    assert overflow["next_scale"] == overflow["scale_after"]


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: compare_precisions(TINY, 0),
            r"^batch_size=0 must be a positive whole number .*e\.g\. batch_size=4",
        ),
        (lambda: compare_precisions(TINY, 4, steps=0), r"^steps=0 must be a positive whole number"),
        (lambda: compare_precisions(TINY, 4, lr=-1.0), r"^lr=-1\.0 must be a number > 0; e\.g\. lr=1e-3"),
        (lambda: compare_precisions(TINY, 4, seed=-1), r"^seed=-1 must be a whole number >= 0"),
        (lambda: compare_precisions("tiny", 4), r"^config='tiny' must be a GPTConfig"),
        (lambda: forced_overflow(TINY, 4, device="gpu0"), r"^device='gpu0' must be a torch device; e\.g\."),
        (lambda: forced_overflow(TINY, True), r"^batch_size=True must be a positive whole number"),
    ],
)
def test_arguments_are_validated(call, match):
    with pytest.raises(ValueError, match=match):
        call()
