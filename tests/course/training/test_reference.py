"""labkit.course.training.reference: the one data split (`rank_rows`) and the single-process reference every
data-parallel step is checked against (`reference_backward`, `reference_gradients`, `max_abs_diff`)."""

from __future__ import annotations

import pytest
import torch

from labkit.course.training.reference import max_abs_diff, rank_rows, reference_backward, reference_gradients
from labkit.models import GPT, GPTConfig, seeded_model, synthetic_batch

CONFIG = GPTConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8, vocab_size=32)


def test_the_ranks_rows_are_the_global_batch_in_order():
    x, y = synthetic_batch(CONFIG, 12, seed=2, step=3)
    rows = [rank_rows(CONFIG, 12, r, 3, step=3, seed=2) for r in range(3)]
    assert torch.equal(torch.cat([rx for rx, _ in rows]), x) and torch.equal(
        torch.cat([ry for _, ry in rows]), y
    )
    assert rows[0][0].untyped_storage().nbytes() == rows[0][0].numel() * 8  # a copy, not a view of the batch
    with pytest.raises(
        ValueError, match=r"global_batch\(10\) must divide over world_size\(4\).*global_batch=8"
    ):
        rank_rows(CONFIG, 10, 0, 4)
    with pytest.raises(ValueError, match=r"rank=4 must be in 0..3"):
        rank_rows(CONFIG, 8, 4, 4)


def test_reference_gradients_equal_accumulated_micro_batches() -> None:
    config = GPTConfig(n_layers=1, d_model=32, n_heads=2, seq_len=16, vocab_size=64)
    reference = reference_gradients(config, 8, seed=1)
    torch.manual_seed(1)
    model = GPT(config)
    x, y = rank_rows(config, 8, 0, 1, seed=1)
    batches = [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:6], y[4:6]), (x[6:], y[6:])]
    for x, y in batches:
        (model(x, y) / len(batches)).backward()
    accumulated = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert reference.flat().shape == (config.num_params(),)
    assert (accumulated - reference.flat()).abs().max().item() < 1e-6
    # by name, in the model's own order, and the loss of the whole batch
    assert list(reference.grads) == [n for n, _ in model.named_parameters()]
    x, y = synthetic_batch(config, 8, seed=1)
    torch.manual_seed(1)
    assert reference.loss == pytest.approx(GPT(config)(x, y).item(), abs=1e-6)


def test_reference_backward_replaces_the_gradients_and_max_abs_diff_compares_parameters():
    model = seeded_model(CONFIG, 0)
    first = reference_backward(model, CONFIG, 4, step=0)
    grads = [p.grad.clone() for p in model.parameters()]
    again = reference_backward(model, CONFIG, 4, step=0)  # zeroed first: not accumulated on top
    assert first.item() == again.item() and not again.requires_grad
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    other = seeded_model(CONFIG, 0)
    assert max_abs_diff(model, other) == 0.0
    with torch.no_grad():
        next(other.parameters()).add_(0.5)
    assert max_abs_diff(model, other) == pytest.approx(0.5)
