"""labkit.models: parameter counts, presets, determinism, loss at init, synthetic data, the seeded model every
rank and reference starts from, and the tensor-parallel sizes a config allows."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.models import GPT, PRESETS, GPTConfig, check_tp_size, seeded_model, synthetic_batch

CONFIGS = [
    GPTConfig(),
    GPTConfig(tie_embeddings=True),
    GPTConfig(n_layers=1, d_model=48, n_heads=3, vocab_size=100, seq_len=16, mlp_ratio=2),
    GPTConfig(n_layers=3, d_model=64, n_heads=8, n_kv_heads=2, ffn_hidden=96, tie_embeddings=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_num_params_matches_built_model(config: GPTConfig) -> None:
    model = GPT(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_split_points_for_later_labs() -> None:
    model = GPT(GPTConfig(n_layers=3))
    assert len(model.blocks) == 3
    for name in ("tok_emb", "pos_emb", "blocks", "ln_f", "lm_head"):
        assert hasattr(model, name)
    assert model.lm_head.bias is None


def test_tied_embeddings_share_one_tensor() -> None:
    tied = GPT(GPTConfig(tie_embeddings=True))
    untied = GPT(GPTConfig())
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight


# Published parameter counts: GPT-2 family from the released checkpoints, GPT-3 from
# Brown et al. 2020, Llama 2 from the released checkpoints (Touvron et al. 2023).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "gpt3-175b": 175_000_000_000,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_counts(name: str) -> None:
    config = GPTConfig.preset(name)
    # The brief asks for 5 %; all presets are within 0.5 %, so hold them to 1 %.
    assert abs(config.num_params() / PUBLISHED[name] - 1) < 0.01
    assert set(PRESETS) == set(PUBLISHED)


def test_gpt2_preset_is_exact() -> None:
    assert GPTConfig.preset("gpt2").num_params() == 124_439_808


def test_preset_returns_a_copy() -> None:
    config = GPTConfig.preset("gpt2")
    config.n_layers = 1
    assert GPTConfig.preset("gpt2").n_layers == 12


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(ValueError, match="llama2-7b") as info:
        GPTConfig.preset("gpt5")
    assert "gpt5" in str(info.value) and "gpt2" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"d_model": 65, "n_heads": 4}, ["65", "4", "divisible"]),
        ({"n_layers": 0}, ["n_layers", "0", "positive"]),
        ({"vocab_size": -3}, ["vocab_size", "-3"]),
        ({"seq_len": 2.5}, ["seq_len", "2.5"]),
        ({"n_heads": 4, "n_kv_heads": 3}, ["n_kv_heads", "3", "4"]),
        ({"ffn_hidden": 0}, ["ffn_hidden", "None"]),
        ({"tie_embeddings": 1}, ["tie_embeddings"]),
    ],
)
def test_bad_config_raises_with_values(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        GPTConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_init_is_deterministic_by_seed() -> None:
    config = GPTConfig()
    torch.manual_seed(0)
    a = GPT(config).state_dict()
    torch.manual_seed(0)
    b = GPT(config).state_dict()
    torch.manual_seed(1)
    c = GPT(config).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_init_std_follows_gpt2() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=2, d_model=128))
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)
    assert torch.count_nonzero(model.blocks[0].mlp.fc.bias) == 0


@pytest.mark.parametrize("config", CONFIGS[:2] + CONFIGS[3:], ids=str)
def test_loss_at_init_is_about_ln_vocab(config: GPTConfig) -> None:
    torch.manual_seed(0)
    model = GPT(config)
    x, y = synthetic_batch(config, 4)
    logits = model(x)
    loss = model(x, y)
    assert logits.shape == (4, config.seq_len, config.vocab_size)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert loss.item() == pytest.approx(math.log(config.vocab_size), abs=0.1)


def test_checkpointing_gives_the_same_loss_and_gradients() -> None:
    config = GPTConfig(n_layers=2)
    x, y = synthetic_batch(config, 2)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(config, checkpointing=checkpointing)
        model(x, y).backward()
        grads.append([p.grad for p in model.parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1)


def test_forward_rejects_bad_shapes() -> None:
    config = GPTConfig(seq_len=8)
    model = GPT(config)
    with pytest.raises(ValueError, match="9"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long))


def test_synthetic_batch_is_deterministic_and_shifted() -> None:
    config = GPTConfig(vocab_size=50, seq_len=16)
    rng_before = torch.get_rng_state()
    x, y = synthetic_batch(config, 6, seed=3, step=7)
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    assert x.dtype == y.dtype == torch.int64
    assert x.shape == y.shape == (6, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 50 and int(x.min()) >= 0
    x2, y2 = synthetic_batch(config, 6, seed=3, step=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, synthetic_batch(config, 6, seed=3, step=8)[0])
    assert not torch.equal(x, synthetic_batch(config, 6, seed=4, step=7)[0])
    # the learnable rule: a constant stride per row
    stride = (y - x) % 50
    assert torch.equal(stride, stride[:, :1].expand_as(stride))


def test_synthetic_batch_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        synthetic_batch(GPTConfig(), 0)
    with pytest.raises(ValueError, match="seed"):
        synthetic_batch(GPTConfig(), 2, seed=-1)


def test_loss_falls_on_synthetic_data() -> None:
    config = GPTConfig()
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(60):
        x, y = synthetic_batch(config, 8, step=step)
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0]


MHA = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8)
GQA = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8, n_kv_heads=2)


def test_check_tp_size_names_the_sizes_that_work():
    assert check_tp_size(MHA, 4) == 4 and check_tp_size(GQA, 2) == 2
    with pytest.raises(
        ValueError,
        match=r"tensor parallel size 3 does not divide n_heads=4 .*"
        r"use a tp that divides 4 \(1, 2, 4\)",
    ):
        check_tp_size(MHA, 3)
    with pytest.raises(ValueError, match=r"size 4 does not divide n_kv_heads=2 .*divides 2 \(1, 2\)"):
        check_tp_size(GQA, 4)
    odd_ffn = GPTConfig(n_layers=1, d_model=32, n_heads=4, vocab_size=64, seq_len=8, ffn_hidden=30)
    with pytest.raises(ValueError, match=r"size 4 does not divide ffn_dim=30 .*divides 30 \(1, 2\)"):
        check_tp_size(odd_ffn, 4)
    with pytest.raises(ValueError, match=r"tp=0 must be a positive whole number"):
        check_tp_size(MHA, 0)


def test_a_seeded_model_is_the_same_wherever_it_is_made():
    config = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8)
    a, b = seeded_model(config, 3), seeded_model(config, 3, "cpu")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, seeded_model(config, 4).lm_head.weight)
    torch.manual_seed(3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), GPT(config).parameters()))
    assert seeded_model(config, 0, checkpointing=True).checkpointing


def test_a_llama_block_has_its_published_shape_and_trains():
    """GPTConfig(block="llama"): RMSNorm, rotary positions, SwiGLU, no biases, no position table; Llama 3 8B's
    shape gives its published 8.03 billion parameters (Dubey et al. 2024, table 3: 32 layers, d 4096,
    ffn 14336, 32 heads, 8 k/v heads, vocabulary 128,256)."""
    llama3_8b = GPTConfig(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256,
        seq_len=8192, block="llama",
    )
    assert llama3_8b.num_params() == 8_030_261_248
    small = GPTConfig(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16, block="llama"
    )
    model = GPT(small)
    assert model.pos_emb is None and sum(p.numel() for p in model.parameters()) == small.num_params()
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert type(model.blocks[0].ln_1).__name__ == "RMSNorm"
    x, y = synthetic_batch(small, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(x, y).item()
    for _ in range(30):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < first / 2


def test_rotary_positions_make_attention_scores_depend_on_the_distance_only():
    """Su et al. 2021: <R(p) q, R(n) k> depends on p - n alone, and the rotation keeps every vector's norm."""
    from labkit.models import rotary

    torch.manual_seed(0)
    q, k = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    seq = torch.stack([q] * 12).view(1, 1, 12, 64), torch.stack([k] * 12).view(1, 1, 12, 64)
    rq, rk = (rotary(t, theta=10_000.0)[0, 0] for t in seq)
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(12))
    # the angles are made in fp32, as in Llama: equal to fp32 rounding
    assert torch.dot(rq[5], rk[2]).item() == pytest.approx(torch.dot(rq[9], rk[6]).item(), rel=1e-6)
    assert torch.dot(rq[5], rk[2]).item() != pytest.approx(torch.dot(rq[5], rk[3]).item(), rel=1e-3)


def test_an_unknown_block_is_refused():
    with pytest.raises(ValueError, match="block"):
        GPTConfig(block="mamba")
