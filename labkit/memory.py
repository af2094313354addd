"""Training memory from formulas: model states (ZeRO), activations (Korthikanti), micro-batches.

Per-rank memory of one training step = model states + activations (+ temporaries).

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1). Mixed-precision Adam keeps
fp16 parameters (2 bytes) and gradients (2 bytes) plus, in the optimizer, an fp32 master copy
of the parameters, the momentum and the variance (4 + 4 + 4 = K = 12 bytes): 2 + 2 + 12 =
**16 bytes per parameter**. This course uses the ZeRO convention ("mixed"). Other sources
quote more because they keep more copies, not because of another optimizer:

* 18 bytes: gradients kept (or accumulated) in fp32 instead of 16-bit: 2 + 4 + 12. This is
  Megatron-LM with 16-bit parameters and fp32 gradients (its distributed-optimizer docs) and
  the Hugging Face "model memory anatomy" count (6 bytes of weights, 4 of gradients, 8 of
  Adam). Available here as ``precision="mixed_fp32_grads"``.
* 20 bytes: 16-bit gradients *and* an fp32 copy of them for the optimizer (Megatron-LM with
  16-bit parameters and 16-bit gradients: 2 + 2 + 4 + 12).

Plain fp32 Adam is also 16 bytes per parameter (4 + 4 + 8): mixed precision does not shrink
the model states, it shrinks activations and speeds up the math.

ZeRO stages shard over the ``dp`` data-parallel ranks: stage 1 the optimizer states
(P_os), stage 2 also the gradients (P_os+g), stage 3 also the parameters (P_os+g+p): ZeRO's
Figure 1 and section 5.1 (P_os = 4Ψ + KΨ/N_d), 5.2 and 5.3.

Activations: ``korthikanti_activation_bytes`` is the per-layer count of Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1 and
Table 2): s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations, 1-byte dropout masks
and attention scores stored (no FlashAttention). Our lab model has no dropout and uses
``scaled_dot_product_attention`` (no s*s scores kept), so ``estimate`` counts, by default,
the tensors autograd saves in ``labkit.models.GPT`` (see ``gpt_activation_bytes``),
verified against ``measure``. Recomputation (``estimate``'s ``checkpointing``): none, selective
(the paper's section 5: the attention scores only, s*b*h*34 per layer) or full (each layer's input).

Neighbours: ``labkit.measured_memory`` measures what these formulas predict (MemTracker, FakeTensor,
the batch-size finder); ``labkit.course.experiments.oom_batch`` is lab 02's driver.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from labkit import validate
from labkit.activations import gpt_activations, korthikanti_activation_bytes
from labkit.models import GPT, GPTConfig, check_tp_size

__all__ = [
    "CHECKPOINTING",
    "OPTIMIZERS",
    "PEAK_MOMENTS",
    "PRECISIONS",
    "MemoryBreakdown",
    "TrainingSetup",
    "blocks_per_stage",
    "bytes_per_param",
    "check_model_parallel",
    "estimate",
    "gpt_activation_bytes",
    "korthikanti_activation_bytes",
    "stage_params",
]

_MIB = 2**20
_GIB = 2**30


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per category on one rank, ``total`` (their sum) and ``peak``.

    A measurement reads the categories at the moment of the peak, so ``peak == total``.
    An estimate gives each category's full size; its ``peak`` can be below ``total``
    because not everything is alive at once (see ``estimate``). ``other`` holds what fits
    no category: temporaries such as gradients of activations in backward, buffers.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    other: int = 0
    peak: int | None = None  # None: the sum of the categories
    source: str = ""
    # An estimate's moment of the peak (one of PEAK_MOMENTS); "" for a measurement, whose peak is its sum
    peak_at: str = ""

    def __post_init__(self) -> None:
        if self.peak is None:
            object.__setattr__(self, "peak", self.total)

    @property
    def total(self) -> int:
        """Sum of all categories, in bytes."""
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def as_dict(self) -> dict[str, int]:
        """Categories, total and peak in bytes, in a fixed order (for plots and tables)."""
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "other": self.other,
            "total": self.total,
            "peak": int(self.peak),  # type: ignore[arg-type]
        }

    def mib(self) -> dict[str, float]:
        """Same as ``as_dict`` in MiB (2**20 bytes)."""
        return {k: v / _MIB for k, v in self.as_dict().items()}

    def gib(self) -> dict[str, float]:
        """Same as ``as_dict`` in GiB (2**30 bytes)."""
        return {k: v / _GIB for k, v in self.as_dict().items()}

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.mib().items())
        label = f"{self.source}: " if self.source else ""
        return f"{label}{parts} (MiB)"


# When an estimate's step peaks (`MemoryBreakdown.peak_at`), and what is alive then besides the weights and
# optimizer states (and the gradients, when several micro-batches keep them through the step).
PEAK_MOMENTS = {
    "backward": "the start of backward: every activation and the loss temporaries; gradients appear as the "
    "activations are freed",
    "optimizer": "the optimizer step: every gradient; the activations are freed by then",
    "recomputation": "backward with full recomputation: the kept block inputs, one block recomputed with its "
    "temporaries, the gradients of the later blocks",
}


# precision -> (param bytes, grad bytes, fp32 master-copy bytes, bytes per optimizer state,
#               activation bytes per element)
PRECISIONS: dict[str, tuple[int, int, int, int, int]] = {
    # fp32 everywhere: 4 + 4 + 2*4 = 16 bytes/param with Adam, same as "mixed".
    "fp32": (4, 4, 0, 4, 4),
    # ZeRO's mixed precision: fp16/bf16 params and grads, fp32 master + fp32 states.
    "mixed": (2, 2, 4, 4, 2),
    # Megatron bf16 params + fp32 grads (and HF's "18 bytes"): 2 + 4 + 12.
    "mixed_fp32_grads": (2, 4, 4, 4, 2),
    # Pure bf16: model.to(torch.bfloat16) and a torch optimizer keeps bf16 states.
    "bf16": (2, 2, 0, 2, 2),
    # torch.autocast: fp32 params, grads and states; matmul inputs/outputs in bf16/fp16.
    "autocast": (4, 4, 0, 4, 2),
}

# optimizer -> number of per-parameter state tensors
OPTIMIZERS: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}

# Activation recomputation that `estimate` knows (Korthikanti et al. 2022, sections 4.1 and 5, Table 2): keep
# every activation; recompute only the attention's QK^T, softmax, dropout and product with V; recompute each
# whole layer from its input.
CHECKPOINTING = ("none", "selective", "full")


def _checkpointing_mode(checkpointing: bool | str) -> str:
    """`estimate`'s ``checkpointing`` as one of `CHECKPOINTING`: False is "none", True is "full"."""
    if isinstance(checkpointing, bool):
        return "full" if checkpointing else "none"
    if checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"checkpointing={checkpointing!r} must be a bool or one of {', '.join(map(repr, CHECKPOINTING))} "
            "(True is 'full', False is 'none'); e.g. estimate(..., checkpointing='selective') recomputes "
            "only the attention scores"
        )
    return checkpointing


def bytes_per_param(precision: str = "mixed", optimizer: str = "adam") -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter; ZeRO's K is the third.

    ``bytes_per_param("mixed", "adam") == (2, 2, 12)``: 16 bytes per parameter.
    """
    validate.one_of("precision", precision, PRECISIONS)
    validate.one_of("optimizer", optimizer, OPTIMIZERS)
    p, g, master, state, _ = PRECISIONS[precision]
    return p, g, master + OPTIMIZERS[optimizer] * state


def gpt_activation_bytes(
    config: GPTConfig,
    micro_batch: int,
    seq_len: int | None = None,
    precision: str = "fp32",
    checkpointing: bool = False,
) -> int:
    """Bytes autograd saves for backward in ``labkit.models.GPT`` (this course's count).

    Per block and token, with h = d_model, f = ffn_dim: the block input and the mid-block
    residual (2h, in the parameter dtype), the two LayerNorm outputs (2h), q, k, v
    (h + 2 kv_dim), the attention output (h), the fc and GELU outputs (2f), all in the
    activation dtype, plus fp32 LayerNorm statistics (4 floats) and the attention
    log-sum-exp (n_heads floats). For f = 4h that is 16h elements, 32 bytes in 16-bit:
    Korthikanti's 34 minus the two 1-byte dropout masks, and without the 5as/h term (scores,
    softmax and its dropout), which fused attention does not keep. The head keeps ln_f's
    input and output (2h) and the log-softmax (vocab; fp32 unless the model is bf16).
    Under ``torch.autocast`` the 16-bit copies of the Linear weights are saved too.
    With ``checkpointing`` each block keeps only its input, and one block at a time is
    recomputed in backward (counted once). Verified against ``measure`` (tests).
    """
    validate.positive_int("micro_batch", micro_batch)
    seq = config.seq_len if seq_len is None else seq_len
    validate.positive_int("seq_len", seq)
    validate.one_of("precision", precision, PRECISIONS)
    parts = gpt_activations(config, micro_batch, seq, precision)
    if checkpointing:
        return config.n_layers * parts.block_input + parts.per_block + parts.head
    return config.n_layers * parts.per_block + parts.head


def _shard(n: int, parts: int) -> int:
    return math.ceil(n / parts)


@dataclass(frozen=True)
class TrainingSetup:
    """How a model trains, as far as its memory goes: `estimate`'s settings, each checked when made."""

    dp: int = 1  # data-parallel ranks, over which ZeRO shards
    zero_stage: int = 0  # ZeRO: 0 off, 1 shards the optimizer states, 2 the gradients too, 3 the weights
    precision: str = "mixed"  # one of PRECISIONS: the bytes of weights, gradients, states and activations
    optimizer: str = "adam"  # one of OPTIMIZERS: the states it keeps per parameter
    micro_batch: int = 1  # sequences in one forward and backward on a rank
    seq_len: int | None = None  # tokens per sequence (None: the model's)
    # False or "none" keeps every activation; True or "full" recomputes each block from its input; "selective"
    # only the attention's scores (Korthikanti et al. 2022, section 5)
    checkpointing: bool | str = False
    keep_grads: bool = False  # gradients live through the step (accumulation, zero_grad(set_to_none=False))
    # "gpt": the tensors our GPT saves (`gpt_activation_bytes`) and the loss-gradient temporaries;
    # "korthikanti": the paper's per-layer count as published (16-bit), doubled for fp32 activations
    activations: str = "gpt"
    tp: int = 1  # tensor-parallel ranks sharing each block's matrices (Megatron, `labkit.parallel.tensor`)
    pp: int = 1  # pipeline stages sharing the blocks as `even_split` does
    micro_batches: int | None = None  # micro-batches per step under 1F1B (None: pp)
    foreach: bool = False  # torch's for-each optimizer: the square roots of all second moments at once
    sequence_parallel: bool = False  # with tp: outside attention and the MLP a rank holds 1/tp of the tokens

    def __post_init__(self) -> None:
        validate.positive_int("dp", self.dp)
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_stage={self.zero_stage!r} must be a ZeRO stage: use 0, 1, 2 or 3 (0 off, 1 optimizer "
                "states, 2 + gradients, 3 + parameters)"
            )
        validate.one_of("precision", self.precision, PRECISIONS)
        validate.one_of("optimizer", self.optimizer, OPTIMIZERS)
        validate.positive_int("micro_batch", self.micro_batch)
        if self.seq_len is not None:
            validate.positive_int("seq_len", self.seq_len)
        validate.one_of("activations", self.activations, ("gpt", "korthikanti"))
        _checkpointing_mode(self.checkpointing)
        validate.positive_int("tp", self.tp, "estimate(..., tp=4), the tensor-parallel size")
        validate.positive_int("pp", self.pp, "estimate(..., pp=2), the number of pipeline stages")
        if self.micro_batches is not None:
            validate.positive_int("micro_batches", self.micro_batches, "estimate(..., pp=4, micro_batches=8)")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} must be True or False")

    @property
    def recompute(self) -> str:
        """`checkpointing` as one of `CHECKPOINTING`."""
        return _checkpointing_mode(self.checkpointing)


def estimate(
    params: int | None = None,
    model: GPTConfig | nn.Module | None = None,
    *,
    setup: TrainingSetup | None = None,
    **settings: Any,
) -> MemoryBreakdown:
    """Per-rank training memory from formulas (no tensors are built): the parts, and when they peak.

    Give ``params`` (a count) or ``model`` (a ``GPTConfig``, a ``GPT`` or any module; only a GPT gives
    activations), and how it trains: a `TrainingSetup`, or its fields as keywords
    (``estimate(model=config, dp=8, zero_stage=3)``). The parts are the weights, gradients and optimizer
    states (ZeRO, the module docstring) and one micro-batch's activations and temporaries.

    ``total`` sums them. ``peak`` is when they coexist: gradients appear during backward as activations are
    freed, so unless ``keep_grads`` the peak is weights + optimizer states + the largest of: the activations
    and temporaries at the start of backward; with checkpointing, the kept block inputs + one recomputed
    block + the gradients of later blocks; the gradients at the optimizer step (with ``foreach``, also the
    for-each temporaries). ZeRO-3 adds its working set to backward (``_zero3_gathered``). Under 1F1B stage s
    holds min(m, pp - s) micro-batches in flight (Narayanan et al. 2021, section 2.2); the result is the
    stage with the highest peak (its ``source`` names it). On the lab models this matched ``measure``
    within 1 % without and 4 % with checkpointing, and FSDP2 within 1 % (tests). Not counted: communication
    buckets, allocator overheads, the for-loop Adam's temporaries, and torch.distributed.pipelining's
    receive buffers.
    """
    if (params is None) == (model is None):
        raise ValueError(
            f"estimate needs exactly one of params (got {params!r}) and model "
            f"(got {type(model).__name__}); e.g. estimate(params=7_500_000_000) or "
            f"estimate(model=GPTConfig.preset('gpt2'))"
        )
    setup = _setup(setup, settings)
    n, config = _count_params(params, model)
    tp, pp = setup.tp, setup.pp
    if config is None:
        return _estimate_stage(_shard(n, tp * pp), None, 1, 0, setup, f"tp={tp}, pp={pp}")
    check_model_parallel(config, tp, pp)
    blocks = blocks_per_stage(config, pp)
    results = []
    for s in sorted({0, pp - 1}):
        in_flight = min(setup.micro_batches or pp, pp - s)
        where = f"tp={tp}, pp={pp}" + (
            f", stage {s} ({blocks[s]} blocks, {in_flight} in flight)" if pp > 1 else ""
        )
        results.append(
            _estimate_stage(stage_params(config, tp, pp, s), config, blocks[s], s, setup, where, in_flight,
                            s == pp - 1)
        )
    return max(results, key=lambda b: b.peak)


def _setup(setup: TrainingSetup | None, settings: dict[str, Any]) -> TrainingSetup:
    """`estimate`'s setup: the one given, or one made of its keywords (not both)."""
    if setup is not None and settings:
        raise ValueError(
            f"estimate takes a setup or its fields as keywords, not both (got setup and {sorted(settings)}); "
            "e.g. estimate(model=config, setup=dataclasses.replace(setup, dp=8))"
        )
    if setup is not None:
        return setup
    fields = {f.name for f in dataclasses.fields(TrainingSetup)}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ValueError(
            f"estimate got {', '.join(unknown)}, which TrainingSetup does not have; its fields: "
            f"{', '.join(sorted(fields))}"
        )
    return TrainingSetup(**settings)


def check_model_parallel(config: GPTConfig, tp: int, pp: int) -> None:
    """Refuse a tp that does not split the heads and the MLP evenly, or more stages than blocks."""
    check_tp_size(config, tp)
    if pp > config.n_layers:
        raise ValueError(
            f"pp={pp} pipeline stages for {config.n_layers} blocks: every stage needs a block; "
            f"use pp <= {config.n_layers}"
        )


def blocks_per_stage(config: GPTConfig, pp: int) -> list[int]:
    """Blocks on each of `pp` stages, shared as `labkit.parallel.pipeline.even_split` does (the first stages
    take the remainder)."""
    return [config.n_layers // pp + (1 if s < config.n_layers % pp else 0) for s in range(pp)]


def stage_params(config: GPTConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters one rank holds: stage `stage` of `pp` (blocks shared as `even_split`), matrices over
    `tp`."""
    d, v = config.d_model, config.vocab_size
    n = blocks_per_stage(config, pp)[stage] * _block_params(config, tp)
    if stage == 0:
        n += _embedding_params(config)
    if stage == pp - 1:
        # A tied head shares the embedding's matrix only when both are on one rank; a pipeline's
        # last stage keeps its own copy (Megatron-LM does the same and all-reduces the two gradients).
        final_norm = 2 * d if config.block == "gpt2" else d  # LayerNorm's weight and bias; RMSNorm's weight
        n += final_norm + (0 if config.tie_embeddings and pp == 1 else v * d)
    return n


def _embedding_params(config: GPTConfig) -> int:
    """The token table, and the learned position table of a GPT-2 block's model (a llama's are rotary)."""
    positions = config.seq_len if config.block == "gpt2" else 0
    return (config.vocab_size + positions) * config.d_model


def _zero3_gathered(
    config: GPTConfig, tp: int, blocks: int, n: int, has_head: bool, p_bytes: int, g_bytes: int
) -> int:
    """ZeRO-3's working set early in backward, whole on every rank beside the shards: the parameters of the
    block being computed and of the next one, gathered ahead (FSDP2 prefetches one unit), and the root's own
    (embedding, head, final norm), which FSDP2 does not reshard after forward (`fully_shard`'s docstring);
    the gradients of the two blocks, unsharded until their reduce-scatters, and the head's, the first the
    root's backward makes (the embedding's comes at the end, when the blocks are resharded)."""
    block = _block_params(config, tp) if blocks else 0
    params = 2 * block + (n - blocks * block)
    head = config.vocab_size * config.d_model if has_head else 0
    return params * p_bytes + (2 * block + head) * g_bytes


def _block_params(config: GPTConfig, tp: int) -> int:
    """One block's parameters on one of `tp` ranks."""
    d, f = config.d_model, config.ffn_dim
    qkv = d + 2 * config.kv_heads * config.head_dim
    if config.block == "llama":
        # no biases; SwiGLU's gate, up and down matrices split; RMSNorm weights whole on every rank
        return 2 * d + (d * qkv + d * d + 3 * d * f) // tp
    # Column-parallel qkv and fc split weight and bias; row-parallel projections split the weight
    # and keep the bias whole (added after the all-reduce); LayerNorms are whole on every rank.
    return 4 * d + (d * qkv + qkv + d * d + d * f + f + f * d) // tp + 2 * d


def _estimate_stage(n: int, config: GPTConfig | None, blocks: int, stage: int, k: TrainingSetup, where: str,
                    in_flight: int = 1, has_head: bool = True) -> MemoryBreakdown:
    """`estimate` for one rank holding `n` parameters and, with a config, `blocks` blocks of it."""
    p_bytes, g_bytes, k_bytes = bytes_per_param(k.precision, k.optimizer)
    # ZeRO (Rajbhandari et al. 2020, Figure 1): each stage shards one more kind of state.
    param_mem = (_shard(n, k.dp) if k.zero_stage >= 3 else n) * p_bytes
    grad_mem = (_shard(n, k.dp) if k.zero_stage >= 2 else n) * g_bytes
    opt_mem = (_shard(n, k.dp) if k.zero_stage >= 1 else n) * k_bytes
    live_grads = 0 if k.keep_grads else grad_mem  # gradients that appear during the step
    state_bytes = PRECISIONS[k.precision][3]
    # for-each Adam: sqrt(exp_avg_sq) of every parameter at once, in the state's dtype (estimate's docstring)
    foreach_mem = (opt_mem // k_bytes) * state_bytes if k.foreach and OPTIMIZERS[k.optimizer] == 2 else 0

    act_mem = other = 0
    # the optimizer step holds all gradients (and the for-each temporaries)
    transient, moment = live_grads + foreach_mem, "optimizer"
    if config is not None:
        seq = config.seq_len if k.seq_len is None else k.seq_len
        act_mem, other, peak_of_backward, backward_moment = _activations(
            config, k.micro_batch, seq, k.precision, k.recompute, k.activations, live_grads, k.tp, blocks,
            in_flight, has_head, stage, n, k.sequence_parallel,
        )
        if k.zero_stage >= 3 and k.dp > 1:
            peak_of_backward += _zero3_gathered(config, k.tp, blocks, n, has_head, p_bytes, g_bytes)
        if peak_of_backward >= transient:
            transient, moment = peak_of_backward, backward_moment
    peak = param_mem + opt_mem + (grad_mem if k.keep_grads else 0) + transient
    parallel = "" if where == "tp=1, pp=1" else f", {where}"
    setting = f"{k.precision}, {k.optimizer}, dp={k.dp}, ZeRO-{k.zero_stage}, {k.activations}"
    if k.sequence_parallel:
        setting += ", sequence parallel"
    if k.recompute != "none":
        setting += f", {k.recompute} recomputation"
    source = f"estimate ({setting}{parallel})"
    return MemoryBreakdown(param_mem, grad_mem, opt_mem, act_mem, other, peak, source, moment)


def _count_params(params: int | None, model: GPTConfig | nn.Module | None) -> tuple[int, GPTConfig | None]:
    """(parameter count, the GPT config when there is one) of estimate's `params` or `model`."""
    if isinstance(model, GPTConfig):
        return model.num_params(), model
    if isinstance(model, GPT):
        return model.config.num_params(), model.config
    if isinstance(model, nn.Module):
        return sum(p.numel() for p in model.parameters()), None
    if model is not None:
        raise ValueError(f"model must be a GPTConfig or an nn.Module, got {type(model).__name__}")
    if isinstance(params, float) and params.is_integer():
        params = int(params)  # people write model sizes as 7.5e9
    return validate.non_negative_int(
        "params", params, "estimate(params=7.5e9), a whole number of parameters"
    ), None


def _activations(
    config: GPTConfig,
    micro_batch: int,
    seq: int,
    precision: str,
    checkpointing: str,
    activations: str,
    live_grads: int,
    tp: int = 1,
    blocks: int | None = None,
    in_flight: int = 1,
    has_head: bool = True,
    stage: int = 0,
    n: int | None = None,
    sequence_parallel: bool = False,
) -> tuple[int, int, int, str]:
    """(activation bytes, other temporaries, bytes of both at backward's peak, that moment: "backward" or
    "recomputation") for `estimate`: `blocks` blocks (all of them by default) with `in_flight` micro-batches,
    the head if `has_head`."""
    blocks = config.n_layers if blocks is None else blocks
    if activations == "korthikanti":
        act = in_flight * korthikanti_activation_bytes(
            seq,
            micro_batch,
            config.d_model,
            config.n_heads,
            blocks,
            recompute=checkpointing,
            tp=tp,
            sequence_parallel=sequence_parallel,
        )
        if PRECISIONS[precision][4] == 4:
            act *= 2  # course adaptation: fp32 activations are twice the 16-bit bytes
        return act, 0, act, "backward"
    parts = gpt_activations(config, micro_batch, seq, precision, tp, sequence_parallel)
    head = parts.head if has_head else 0
    other = parts.loss_temps if has_head else 0
    # Selective recomputation drops the s*s scores; fused attention keeps none, so nothing changes here.
    if checkpointing != "full":
        act = in_flight * blocks * parts.per_block + head
        return act, other, act + other, "backward"
    kept = in_flight * blocks * parts.block_input
    # Start of backward: kept inputs + head + loss temporaries. Later, the first block is
    # recomputed and differentiated while the gradients of all later blocks and of the head exist.
    share = parts.first_block_share
    if (tp, blocks) != (1, config.n_layers) and n:
        share = (
            _block_params(config, tp)
            + (_embedding_params(config) if stage == 0 else 0)
        ) / n
    later_grads = round(live_grads * (1 - share))
    start, recomputing = kept + head + other, kept + parts.per_block + parts.block_temps + later_grads
    moment = "backward" if start >= recomputing else "recomputation"
    return kept + parts.per_block + head, other, max(start, recomputing), moment
