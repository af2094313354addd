"""A small GPT-style decoder and synthetic data shared by all labs.

The model is deliberately plain (nanoGPT-like) so that later labs can take it apart:

    tok_emb + pos_emb  ->  blocks[0..L-1]  ->  ln_f  ->  lm_head
    (embedding stage)      (transformer)       (head stage)

Each block is pre-LayerNorm (GPT-2, Radford et al. 2019):

    x = x + attn.proj(SDPA(split(attn.qkv(ln_1(x)))))
    x = x + mlp.proj(GELU(mlp.fc(ln_2(x))))

``attn.qkv`` is one fused Linear whose output columns are laid out as
``[q (d_model) | k (kv_dim) | v (kv_dim)]`` (kv_dim = d_model unless ``n_kv_heads`` is set),
and ``mlp.fc`` / ``mlp.proj`` are the two MLP matrices, so tensor parallelism can split
``qkv`` and ``fc`` by columns and the two ``proj`` by rows (Megatron-LM, Shoeybi et al. 2019).

``GPTConfig(block="llama")`` makes the block the models people train now (Llama: Touvron et al. 2023;
Llama 3: Dubey et al. 2024): RMSNorm instead of LayerNorm, rotary positions on q and k instead of a
learned position table, a SwiGLU MLP, no biases, the same parameter names:

    x = x + attn.proj(SDPA(rotary(split(attn.qkv(ln_1(x))))))
    x = x + mlp.proj(silu(gate) * up),  [gate | up] = mlp.fc(ln_2(x))

``mlp.fc`` holds the gate and up matrices fused ([gate (f) | up (f)]), as ``qkv`` holds q, k and v.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields, replace
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit import validate

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "BLOCKS",
    "GPT",
    "PRESETS",
    "ROPE_THETA",
    "GPTConfig",
    "causal_attention",
    "check_tp_size",
    "gpt_in",
    "on_device",
    "rotary",
    "seeded_model",
    "swiglu",
    "synthetic_batch",
]


@dataclass
class GPTConfig:
    """Shape of a GPT-style decoder.

    ``ffn_hidden`` overrides the MLP width (default ``mlp_ratio * d_model``; a llama block's SwiGLU has
    three matrices of that width); ``n_kv_heads`` enables grouped-query attention (default: ``n_heads``,
    plain multi-head); ``block`` picks the block ("gpt2" or "llama", module docstring).
    Both exist so that published Llama sizes get roughly the right parameter count.
    """

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    vocab_size: int = 256
    seq_len: int = 64
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    ffn_hidden: int | None = None
    n_kv_heads: int | None = None
    block: str = "gpt2"  # "gpt2" (LayerNorm, GELU, learned positions) or "llama" (module docstring)

    def __post_init__(self) -> None:
        validate.one_of("GPTConfig.block", self.block, BLOCKS)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "block":
                continue
            if f.name == "tie_embeddings":
                if not isinstance(value, bool):
                    raise ValueError(f"GPTConfig.tie_embeddings={value!r} must be True or False")
                continue
            if value is None and f.name in ("ffn_hidden", "n_kv_heads"):
                continue
            hint = "None" if f.default is None else f.default
            validate.positive_int(f"GPTConfig.{f.name}", value, f"{f.name}={hint}")
        if self.d_model % self.n_heads != 0:
            lower = self.d_model // self.n_heads * self.n_heads
            raise ValueError(
                f"GPTConfig: d_model({self.d_model}) is not divisible by n_heads({self.n_heads}); "
                f"each head needs d_model / n_heads channels. Use d_model={lower or self.n_heads} "
                f"or {lower + self.n_heads}, or a n_heads that divides {self.d_model}."
            )
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"GPTConfig: n_heads({self.n_heads}) is not divisible by n_kv_heads({self.n_kv_heads}); "
                f"grouped-query attention shares each k/v head among n_heads / n_kv_heads query heads. "
                f"Use a n_kv_heads that divides {self.n_heads}, or None for plain multi-head attention."
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head (d_model / n_heads)."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (n_heads unless grouped-query attention is used)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP."""
        return self.ffn_hidden if self.ffn_hidden is not None else self.mlp_ratio * self.d_model

    def num_params(self) -> int:
        """Exact number of parameters of ``GPT(self)`` (tied weights counted once)."""
        d, f, v = self.d_model, self.ffn_dim, self.vocab_size
        qkv_out = d + 2 * self.kv_heads * self.head_dim
        if self.block == "llama":
            # RMSNorm weights, qkv, proj, SwiGLU's three matrices; no biases, no position table
            llama_block = 2 * d + d * qkv_out + d * d + 3 * d * f
            head = d + (0 if self.tie_embeddings else v * d)
            return v * d + self.n_layers * llama_block + head
        per_block = (
            2 * d  # ln_1 weight + bias
            + d * qkv_out
            + qkv_out  # attn.qkv
            + d * d
            + d  # attn.proj
            + 2 * d  # ln_2
            + d * f
            + f  # mlp.fc
            + f * d
            + d  # mlp.proj
        )
        embeddings = v * d + self.seq_len * d
        head = 2 * d + (0 if self.tie_embeddings else v * d)  # ln_f + lm_head (no bias)
        return embeddings + self.n_layers * per_block + head

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        """A published model size, for estimates only (never build these on a laptop).

        Known names: see ``PRESETS``. GPT-2 and GPT-3 match our architecture (GPT-2's count,
        124,439,808, is exact). Llama 2 differs: SwiGLU MLP, RMSNorm, rotary positions, no
        biases. Its SwiGLU MLP has three d x f matrices (f = 11008 for 7B); our GELU MLP has
        two, so the Llama presets use ``ffn_hidden = 3 f / 2`` to hold the same number of
        weights, and 70B uses grouped-query attention (8 k/v heads). Their ``num_params()``
        is then within 0.5 % of the published counts (the learned position table and biases
        are the difference).
        """
        if name not in PRESETS:
            raise ValueError(
                f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}. "
                f"For another size build GPTConfig(n_layers=..., d_model=..., ...) directly."
            )
        return replace(PRESETS[name])


BLOCKS = ("gpt2", "llama")
# Rotary positions' base (Su et al. 2021, "RoFormer"): 500,000 in Llama 3 (Dubey et al. 2024, section 3.2)
ROPE_THETA = 500_000.0


# Published sizes. Sources: GPT-2 (Radford et al. 2019, Table 2 and the released
# checkpoints), GPT-3 (Brown et al. 2020, Table 2.1), Llama 2 (Touvron et al. 2023, and the
# released configs: 7B ffn 11008, 13B ffn 13824, 70B ffn 28672 with 8 k/v heads).
PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(
        n_layers=12, d_model=768, n_heads=12, vocab_size=50257, seq_len=1024, tie_embeddings=True
    ),
    "gpt2-xl": GPTConfig(
        n_layers=48, d_model=1600, n_heads=25, vocab_size=50257, seq_len=1024, tie_embeddings=True
    ),
    "llama2-7b": GPTConfig(
        n_layers=32, d_model=4096, n_heads=32, vocab_size=32000, seq_len=4096, ffn_hidden=3 * 11008 // 2
    ),
    "llama2-13b": GPTConfig(
        n_layers=40, d_model=5120, n_heads=40, vocab_size=32000, seq_len=4096, ffn_hidden=3 * 13824 // 2
    ),
    "llama2-70b": GPTConfig(
        n_layers=80,
        d_model=8192,
        n_heads=64,
        vocab_size=32000,
        seq_len=4096,
        ffn_hidden=3 * 28672 // 2,
        n_kv_heads=8,
    ),
    "gpt3-175b": GPTConfig(
        n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, seq_len=2048, tie_embeddings=True
    ),
}


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention with a fused qkv projection; rotary positions and
    no biases in a llama block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.rope = config.block == "llama"
        kv_dim = self.kv_heads * self.head_dim
        bias = config.block == "gpt2"
        self.qkv = nn.Linear(config.d_model, config.d_model + 2 * kv_dim, bias=bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = causal_attention(self.qkv(x), self.n_heads, self.kv_heads, self.head_dim, rope=self.rope)
        return self.proj(y)


def rotary(x: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) of `x` (batch, heads, seq, head_dim): each pair of channels
    (i, i + head_dim/2) of position p rotated by the angle p / theta^(2i / head_dim), the half-split layout
    of GPT-NeoX and Hugging Face's Llama. Made from the shape: nothing to learn, the same on every rank."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = (torch.cat([t, t], dim=-1).to(x.dtype) for t in (angles.cos(), angles.sin()))
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def causal_attention(
    qkv: torch.Tensor, n_heads: int, kv_heads: int, head_dim: int, *, rope: bool = False
) -> torch.Tensor:
    """Causal attention of a fused projection laid out [q | k | v] (batch, seq, (n_heads + 2 kv_heads) x
    head_dim); returns (batch, seq, n_heads x head_dim); `rope`: q and k take rotary positions first.
    Shared by the GPT and its tensor-parallel shards."""
    b, s, _ = qkv.shape
    q_dim, kv_dim = n_heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    q = q.view(b, s, n_heads, head_dim).transpose(1, 2)
    k = k.view(b, s, kv_heads, head_dim).transpose(1, 2)
    v = v.view(b, s, kv_heads, head_dim).transpose(1, 2)
    if rope:
        q, k = rotary(q), rotary(k)
    if kv_heads != n_heads:
        # Grouped-query attention (Ainslie et al. 2023): each k/v head serves a group of
        # query heads. repeat_interleave keeps this working on every torch >= 2.4.
        group = n_heads // kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).contiguous().view(b, s, q_dim)


class MLP(nn.Module):
    """Linear - GELU - Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ffn_dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.ffn_dim, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020, "GLU Variants Improve Transformer"): proj(silu(gate) * up), the gate and up
    matrices fused in `fc` as [gate | up]. No biases."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 2 * config.ffn_dim, bias=False)
        self.proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(swiglu(self.fc(x)))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [gate | up] tensor (its last dimension halved). Shared with the tp shards."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _norm(config: GPTConfig) -> nn.Module:
    return nn.RMSNorm(config.d_model, eps=1e-5) if config.block == "llama" else nn.LayerNorm(config.d_model)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). GPT-2's (LayerNorm, GELU) or
    Llama's (RMSNorm, rotary, SwiGLU) by `config.block`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = _norm(config)
        self.mlp = SwiGLU(config) if config.block == "llama" else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-style decoder: ``tok_emb``, ``pos_emb`` (None in a llama model), ``blocks``, ``ln_f``, ``lm_head``.

    ``forward(idx)`` returns logits (batch, seq, vocab); ``forward(idx, targets)`` returns the
    mean cross-entropy loss (a scalar, by ``criterion``; ``labkit.parallel.vocab`` splits logits and
    loss over ranks). Weights come from torch's global RNG, so
    ``torch.manual_seed(s); GPT(config)`` is deterministic.

    Set ``checkpointing=True`` (argument or attribute) for full activation recomputation
    per block: only each block's input is kept during forward, the rest is recomputed
    in backward (Chen et al. 2016; Korthikanti et al. 2022 "full recomputation").
    """

    def __init__(self, config: GPTConfig, *, checkpointing: bool = False) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"GPT(config) needs a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.checkpointing = checkpointing
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        # A llama block's positions are rotary, inside attention: no table
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model) if config.block == "gpt2" else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = _norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # The loss as a module: vocabulary parallelism swaps in one for logits split over ranks
        self.criterion: nn.Module = nn.CrossEntropyLoss()
        if config.tie_embeddings:
            # Input and output embeddings share one matrix (Press & Wolf 2017; GPT-2).
            self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 initialisation (Radford et al. 2019, section 2.3, as in its released code):
        # N(0, 0.02) for all matrices and embeddings, zero biases, and the projections that
        # write into the residual stream scaled by 1/sqrt(2 * n_layers) so the residual's
        # variance does not grow with depth.
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith(("attn.proj", "mlp.proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding) and module is not self.tok_emb:
                nn.init.normal_(module.weight, mean=0.0, std=std)
        # tok_emb last: when tied, this is also lm_head's weight.
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=std)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The blocks' input: token embeddings, plus the learned positions' in a GPT-2 model."""
        x = self.tok_emb(idx)
        if self.pos_emb is None:
            return x
        return x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq), got {tuple(idx.shape)}")
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"sequence length {seq} > config.seq_len({self.config.seq_len}); "
                f"crop the input or build the model with seq_len >= {seq}"
            )
        x = self.embed(idx)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        if targets.shape != idx.shape:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}; "
                f"targets are the next tokens, one per input token"
            )
        return self.criterion(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_tp_size(config: GPTConfig, tp: int) -> int:
    """`tp` if tensor parallelism of that size can split `config` (whole heads and k/v heads, an
    even share of the MLP width on every rank), else ValueError naming the sizes that can."""
    validate.positive_int("tp", tp, "tp=2")
    allowed = _divisors(math.gcd(config.n_heads, config.kv_heads, config.ffn_dim))
    for name, value, why in (
        ("n_heads", config.n_heads, "each rank keeps whole attention heads"),
        ("n_kv_heads", config.kv_heads, "each rank keeps whole key/value heads"),
        ("ffn_dim", config.ffn_dim, "each rank keeps an equal share of the MLP width"),
    ):
        if value % tp:
            raise ValueError(
                f"tensor parallel size {tp} does not divide {name}={value} ({why}): "
                f"use a tp that divides {value} ({allowed})"
            )
    return tp


def seeded_model(
    config: GPTConfig, seed: int = 0, device: torch.device | str = "cpu", *, checkpointing: bool = False
) -> GPT:
    """`GPT(config)` with the weights `torch.manual_seed(seed)` gives, on `device`: every rank (and a
    single-process reference) that makes it with the same seed starts from the same weights."""
    torch.manual_seed(seed)
    return on_device(GPT(config, checkpointing=checkpointing), device)


def gpt_in(config: GPTConfig, dtype: torch.dtype, *, checkpointing: bool = False) -> GPT:
    """`GPT(config)` with its parameters made in `dtype` (a 16-bit model, trained without autocast). Made so
    rather than cast: `module.to(dtype)` swaps each parameter, which FakeTensors refuse."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return GPT(config, checkpointing=checkpointing)
    finally:
        torch.set_default_dtype(previous)


def on_device(module: M, device: torch.device | str) -> M:
    """`module` (made on the CPU) on `device`: moved to another device, left as it is for the CPU. A
    simulated machine's parameters are FakeTensors, which `module.to()` cannot swap in place ("Couldn't
    swap"), even for the device they are on."""
    return module if torch.device(device).type == "cpu" else module.to(device)


def synthetic_batch(
    config: GPTConfig,
    batch_size: int,
    *,
    seed: int = 0,
    step: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch ``(x, y)`` of int64 tokens, each of shape (batch_size, seq_len).

    Every row is an arithmetic sequence modulo the vocabulary,
    ``t_i = (start + stride * i) % vocab_size``, with a random start and a random stride in
    1..8 per row, and ``y`` is ``x`` shifted by one token. The model can learn the rule from
    the context (find the stride, add it), so the loss falls visibly from ln(vocab_size).
    The same (seed, step) always gives the same batch; a local ``torch.Generator`` is used,
    never the global RNG. Give each data-parallel rank its own ``seed``.
    """
    validate.positive_int("batch_size", batch_size, "synthetic_batch(config, 8)")
    for name, value in (("seed", seed), ("step", step)):
        validate.non_negative_int(name, value, f"{name}=0")
    # torch's CPU generator (mt19937) only uses the low 32 bits of a seed, so seed*K + step
    # would repeat batches; hash the pair to 32 bits instead (collision chance 2**-32).
    digest = hashlib.blake2b(f"labkit.synthetic_batch:{seed}:{step}".encode(), digest_size=4)
    generator = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little"))
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 9, (batch_size, 1), generator=generator)
    positions = torch.arange(config.seq_len + 1).unsqueeze(0)
    tokens = (start + stride * positions) % config.vocab_size
    x = tokens[:, :-1].contiguous()
    y = tokens[:, 1:].contiguous()
    return x.to(device), y.to(device)
