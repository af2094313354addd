"""labkit.layer_profile: what each layer of a GPT costs inside a whole training step (embedding and head
included) and what it saves for backward; the model is left as it was found."""

from __future__ import annotations

import pytest
import torch

from labkit import layer_profile
from labkit.layer_profile import profile_layers
from labkit.machine import runtime
from labkit.models import GPT, GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.pipeline import layer_names

pytestmark = pytest.mark.usefixtures("one_thread")


def test_profile_layers_measures_every_layer_embedding_and_head_included():
    config = GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=4096, seq_len=16)  # a large vocabulary
    model = GPT(config)
    x, y = synthetic_batch(config, 4)
    prof = profile_layers(model, x, y, repeats=2)
    assert [p.name for p in prof] == ["embedding", "block 0", "block 1", "head"]
    assert all(
        p.forward_ms >= 0 and p.backward_ms >= 0 and p.ms == p.forward_ms + p.backward_ms for p in prof
    )
    logits_bytes = 4 * 16 * 4096 * 4  # batch x seq x vocab fp32: saved for the loss's backward
    assert prof[-1].activation_bytes >= logits_bytes > prof[1].activation_bytes
    assert all(p.grad is None for p in model.parameters())  # leaves the model as it found it
    with pytest.raises(TypeError, match=r"labkit\.models\.GPT"):
        profile_layers(torch.nn.Linear(2, 2), x, y)


def test_profile_layers_names_every_layer_and_the_heavy_head():
    config = GPTConfig(n_layers=3, d_model=16, n_heads=2, vocab_size=2048, seq_len=16)
    prof = profile_layers(seeded_model(config), *synthetic_batch(config, 2), repeats=2)
    assert [p.name for p in prof] == layer_names(config)
    assert all(p.forward_ms > 0 and p.backward_ms > 0 for p in prof)
    # the head keeps its 2 x 16 x 2048 logits for the loss: far more than a block saves
    assert prof[-1].activation_bytes > 2 * 16 * 2048 * 4 > prof[1].activation_bytes


def test_the_layers_are_timed_on_the_ranks_timer(monkeypatch):
    # labkit.machine.timer.clock (here a fake counter a millisecond per reading): every layer is timed,
    # none is 0
    ticks = iter(range(10**6))
    monkeypatch.setattr(layer_profile.timer, "clock", lambda: next(ticks) * 1e-3)
    monkeypatch.delenv(runtime.CLUSTER_ENV, raising=False)
    config = GPTConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=64, seq_len=8)
    prof = profile_layers(seeded_model(config), *synthetic_batch(config, 2), repeats=1)
    assert [p.name for p in prof] == layer_names(config)
    assert all(p.forward_ms >= 1.0 - 1e-9 and p.backward_ms >= 1.0 - 1e-9 for p in prof)
    # whole readings apart: each time is a difference of the timer's own readings
    assert all(abs(t - round(t)) < 1e-6 for p in prof for t in (p.forward_ms, p.backward_ms))


def test_saved_activations_grow_with_the_micro_batch_and_leave_the_weights_out():
    """A linear layer saves its weight for backward too, but a step adds only activations: counted in, the
    weights made lab 04's memory prediction miss on a lopsided split (issue 44). What is counted scales with
    the micro-batch, exactly, in every block and the head."""
    config = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=8192, seq_len=64)
    model = seeded_model(config)
    one = profile_layers(model, *synthetic_batch(config, 1), repeats=1)
    two = profile_layers(model, *synthetic_batch(config, 2), repeats=1)
    for a, b in zip(one[1:], two[1:]):  # the embedding saves its index tensors, the positions' fixed
        assert b.activation_bytes == pytest.approx(2 * a.activation_bytes, rel=1e-4), a.name
