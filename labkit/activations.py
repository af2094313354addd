"""Activation memory formulas: Korthikanti et al.'s per-layer count and what our GPT saves.

`korthikanti_activation_bytes` is the paper's Table 2 (16-bit, dropout, stored attention scores,
with tensor parallelism); `gpt_activations` gives the pieces of what `labkit.models.GPT` keeps for
backward (per block, head, loss temporaries), which `labkit.memory.estimate` assembles into a
rank's peak and `labkit.measured_memory` checks against the allocator. Precisions are the names of
`labkit.memory.PRECISIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit import validate
from labkit.models import GPTConfig

__all__ = ["GPTActivations", "gpt_activations", "korthikanti_activation_bytes"]


def korthikanti_activation_bytes(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_heads: int,
    n_layers: int = 1,
    recompute: str = "none",
    tp: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """Activation bytes of ``n_layers`` transformer layers, Korthikanti et al. 2022, Table 2.

    16-bit activations, dropout masks of 1 byte, ``tp``-way tensor parallelism (t = 1: none), without
    or with ``sequence_parallel`` (the 10 that do not shrink with t shrink too):

    * ``"none"``: s*b*h*(10 + 24/t + 5*a*s/(h*t)) per layer (section 4.1: 34 + 5as/h at t = 1);
      with sequence parallelism s*b*h*(34/t + 5*a*s/(h*t)),
    * ``"selective"`` (attention scores recomputed): s*b*h*(10 + 24/t) per layer (34/t with it),
    * ``"full"`` (only each layer's input kept): 2*s*b*h per layer (2/t with it).

    Embeddings, the output layer and the loss are not included, as in the paper's table.
    """
    for name, value in [
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("d_model", d_model),
        ("n_heads", n_heads),
        ("n_layers", n_layers),
    ]:
        validate.positive_int(name, value)
    validate.positive_int("tp", tp)
    s, b, h, a, t = seq_len, micro_batch, d_model, n_heads, tp
    whole = 1 if not sequence_parallel else t  # what tensor parallelism alone leaves whole on every rank
    if recompute == "none":
        # s*b*h*(34 + 5as/h) at t = 1
        per_layer = 10 * s * b * h // whole + (24 * s * b * h + 5 * a * s * s * b) // t
    elif recompute == "selective":
        per_layer = 10 * s * b * h // whole + 24 * s * b * h // t
    elif recompute == "full":
        per_layer = 2 * s * b * h // whole
    else:
        validate.one_of("recompute", recompute, ("none", "selective", "full"))
    return n_layers * per_layer


@dataclass(frozen=True)
class GPTActivations:
    """Pieces of ``GPT``'s saved activations, in bytes (see ``gpt_activation_bytes``)."""

    per_block: int  # everything one block saves (its input included)
    block_input: int  # what a checkpointed block keeps: its input
    head: int  # ln_f input and output, log-softmax, autocast's 16-bit lm_head weight
    loss_temps: int  # gradients of the log-probabilities and of the logits in backward
    block_temps: int  # gradient of the MLP hidden layer, the largest in a block's backward
    first_block_share: float  # share of the parameters in embeddings + first block


def _llama_block_bytes(config: GPTConfig, act: int, resid: int, tp: int, sp: int = 1) -> int:
    """Bytes per token a llama block saves (`labkit.models`: RMSNorm, rotary, SwiGLU), counted as autograd
    keeps them: each RMSNorm (torch's composite: x * rsqrt(mean(x^2) + eps) * weight) its input, its
    normalised input (for the weight's gradient) and an fp32 rstd, and the matmul after it its output; q/k/v
    (their views keep the whole qkv output), rotary's rotated halves of q and k and the rotated q and k
    (SDPA's inputs; with grouped-query attention k and v repeated to n_heads), the attention output;
    SwiGLU's [gate | up] (its views keep it whole), silu(gate) and the product."""
    h, f = config.d_model, config.ffn_dim
    kv_dim = config.kv_heads * config.head_dim
    norms = 2 * ((2 * h * resid + 4) // sp + h * act)  # sp: 1/tp of the tokens with sequence parallelism
    k_v = 2 * h if kv_dim != h else kv_dim  # SDPA's k and v: repeated to n_heads, or k rotated (v is a view)
    attention = (h + 2 * kv_dim) + (h + kv_dim) + h + k_v + h
    mlp = 4 * f
    return norms + (attention + mlp) * act // tp + config.n_heads // tp * 4


def gpt_activations(
    config: GPTConfig,
    micro_batch: int,
    seq_len: int,
    precision: str,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> GPTActivations:
    """The pieces of what `labkit.models.GPT` saves for backward (see `memory.gpt_activation_bytes`).
    `sequence_parallel` (`labkit.parallel.sequence`): the residual stream, the norms' inputs and statistics
    and each block's input hold 1/tp of the tokens; the norms' outputs are saved as the all-gathered
    matmul inputs, whole (Megatron-LM saves its share and gathers it again in backward; this GPT does not)."""
    h, f, v = config.d_model, config.ffn_dim, config.vocab_size
    kv_dim = config.kv_heads * config.head_dim
    act = 4 if precision == "fp32" else 2  # bytes of an element entering / leaving the matmuls
    resid = 4 if precision in ("fp32", "autocast") else 2  # residual stream (parameter dtype)
    softmax = 2 if precision == "bf16" else 4  # cross-entropy runs in fp32 unless all is bf16
    tokens = seq_len * micro_batch

    qkv = h + 2 * kv_dim
    if kv_dim != h:
        qkv += 2 * h  # GQA: the k, v repeated to n_heads are saved by attention as well
    # Tensor parallelism (Megatron, no sequence parallelism) splits what lies between f and g over
    # the tp ranks: q/k/v, the attention output, fc and GELU; the residual stream and the LayerNorm
    # outputs stay whole on every rank (Korthikanti et al. 2022, section 4.2.1: 10 + 24/t).
    sp = tp if sequence_parallel else 1  # outside f and g: 1/tp of the tokens with sequence parallelism
    per_block = tokens * (
        2 * h * resid // sp  # block input (saved by ln_1) and mid-block residual (saved by ln_2)
        + 2 * h * act
        + (qkv + h + 2 * f) * act // tp  # ln outputs, q/k/v, attention output, fc, GELU
        + 4 * 4 // sp + config.n_heads // tp * 4  # fp32 LayerNorm mean/rstd (2 x 2), attention logsumexp
    )
    if config.block == "llama":
        per_block = tokens * _llama_block_bytes(config, act, resid, tp, sp)
    head = tokens * (h * resid + h * act + 2 * 4 + v * softmax)
    if precision == "autocast":
        # autocast saves the 16-bit copies of the Linear weights it made for the matmuls.
        per_block += 2 * (h * (h + 2 * kv_dim) + h * h + 2 * h * f) // tp
        head += 2 * v * h
    one_block = replace(config, n_layers=2).num_params() - replace(config, n_layers=1).num_params()
    embeddings = (v + (config.seq_len if config.block == "gpt2" else 0)) * h
    return GPTActivations(
        per_block=per_block,
        block_input=tokens * h * resid // sp,
        head=head,
        loss_temps=2 * tokens * v * softmax,
        block_temps=tokens * f * act // tp,
        first_block_share=(one_block + embeddings) / config.num_params(),
    )
