"""Training memory: formulas, measurement, FakeTensor estimates and a batch-size finder.

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
(P_os), stage 2 also the gradients (P_os+g), stage 3 also the parameters (P_os+g+p).

Activations: ``korthikanti_activation_bytes`` is the per-layer count of Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1 and
Table 2): s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations, 1-byte dropout masks
and attention scores stored (no FlashAttention). Our lab model has no dropout and uses
``scaled_dot_product_attention`` (no s*s scores kept), so ``estimate`` counts, by default,
the tensors autograd saves in ``labkit.models.GPT`` (see ``gpt_activation_bytes``),
verified against ``measure``.

Fixes for a batch that does not fit (lab 02): ``accumulation_steps`` and
``choose_micro_batch`` split a global batch into micro-batches; ``dp_train`` runs data-parallel
steps with gradient accumulation under DDP on a launched rank (counting all-reduces, measuring
the peak); ``max_micro_batch`` runs ``find_max_batch`` on a rank; ``reference_gradients`` is the
single-process big-batch gradient they are checked against.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from labkit.emulate import reset_peak_memory_stats
from labkit.models import GPT, GPTConfig, synthetic_batch

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "BatchSearch",
    "DPResult",
    "MemoryBreakdown",
    "accumulate_with_no_sync",
    "accumulate_without_no_sync",
    "accumulation_steps",
    "bytes_per_param",
    "choose_micro_batch",
    "dp_train",
    "estimate",
    "estimate_fake",
    "find_max_batch",
    "gpt_activation_bytes",
    "korthikanti_activation_bytes",
    "max_micro_batch",
    "measure",
    "rank_micro_batches",
    "reference_gradients",
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


def _check_choice(name: str, value: Any, choices: dict[str, Any]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(choices)}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (1 or more)")


def bytes_per_param(precision: str = "mixed", optimizer: str = "adam") -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter; ZeRO's K is the third.

    ``bytes_per_param("mixed", "adam") == (2, 2, 12)``: 16 bytes per parameter.
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    p, g, master, state, _ = PRECISIONS[precision]
    return p, g, master + OPTIMIZERS[optimizer] * state


def korthikanti_activation_bytes(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_heads: int,
    n_layers: int = 1,
    recompute: str = "none",
) -> int:
    """Activation bytes of ``n_layers`` transformer layers, Korthikanti et al. 2022, Table 2.

    No tensor/sequence parallelism, 16-bit activations, dropout masks of 1 byte:

    * ``"none"``: s*b*h*(34 + 5*a*s/h) per layer (section 4.1),
    * ``"selective"`` (attention scores recomputed): 34*s*b*h per layer,
    * ``"full"`` (only each layer's input kept): 2*s*b*h per layer.

    Embeddings, the output layer and the loss are not included, as in the paper's table.
    """
    for name, value in [("seq_len", seq_len), ("micro_batch", micro_batch),
                        ("d_model", d_model), ("n_heads", n_heads), ("n_layers", n_layers)]:
        _check_positive(name, value)
    s, b, h, a = seq_len, micro_batch, d_model, n_heads
    if recompute == "none":
        per_layer = 34 * s * b * h + 5 * a * s * s * b  # = s*b*h*(34 + 5as/h), kept exact
    elif recompute == "selective":
        per_layer = 34 * s * b * h
    elif recompute == "full":
        per_layer = 2 * s * b * h
    else:
        raise ValueError(f"recompute={recompute!r}; choose 'none', 'selective' or 'full'")
    return n_layers * per_layer


@dataclass(frozen=True)
class _GPTActivations:
    """Pieces of ``GPT``'s saved activations, in bytes (see ``gpt_activation_bytes``)."""

    per_block: int  # everything one block saves (its input included)
    block_input: int  # what a checkpointed block keeps: its input
    head: int  # ln_f input and output, log-softmax, autocast's 16-bit lm_head weight
    loss_temps: int  # gradients of the log-probabilities and of the logits in backward
    block_temps: int  # gradient of the MLP hidden layer, the largest in a block's backward
    first_block_share: float  # share of the parameters in embeddings + first block


def _gpt_activations(config: GPTConfig, micro_batch: int, seq_len: int, precision: str) -> _GPTActivations:
    h, f, v = config.d_model, config.ffn_dim, config.vocab_size
    kv_dim = config.kv_heads * config.head_dim
    act = PRECISIONS[precision][4]  # bytes of an element entering / leaving the matmuls
    resid = 4 if precision in ("fp32", "autocast") else 2  # residual stream (parameter dtype)
    softmax = 2 if precision == "bf16" else 4  # cross-entropy runs in fp32 unless all is bf16
    tokens = seq_len * micro_batch

    qkv = h + 2 * kv_dim
    if kv_dim != h:
        qkv += 2 * h  # GQA: the k, v repeated to n_heads are saved by attention as well
    per_block = tokens * (
        2 * h * resid  # block input (saved by ln_1) and mid-block residual (saved by ln_2)
        + (2 * h + qkv + h + 2 * f) * act  # ln outputs, q/k/v, attention output, fc, GELU
        + (4 + config.n_heads) * 4  # fp32 LayerNorm mean/rstd (2 x 2) and attention logsumexp
    )
    head = tokens * (h * resid + h * act + 2 * 4 + v * softmax)
    if precision == "autocast":
        # autocast saves the 16-bit copies of the Linear weights it made for the matmuls.
        per_block += 2 * (h * (h + 2 * kv_dim) + h * h + 2 * h * f)
        head += 2 * v * h
    one_block = replace(config, n_layers=2).num_params() - replace(config, n_layers=1).num_params()
    embeddings = (v + config.seq_len) * h
    return _GPTActivations(
        per_block=per_block,
        block_input=tokens * h * resid,
        head=head,
        loss_temps=2 * tokens * v * softmax,
        block_temps=tokens * f * act,
        first_block_share=(one_block + embeddings) / config.num_params(),
    )


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
    _check_positive("micro_batch", micro_batch)
    seq = config.seq_len if seq_len is None else seq_len
    _check_positive("seq_len", seq)
    _check_choice("precision", precision, PRECISIONS)
    parts = _gpt_activations(config, micro_batch, seq, precision)
    if checkpointing:
        return config.n_layers * parts.block_input + parts.per_block + parts.head
    return config.n_layers * parts.per_block + parts.head


def _shard(n: int, parts: int) -> int:
    return math.ceil(n / parts)


def estimate(
    params: int | None = None,
    model: GPTConfig | nn.Module | None = None,
    *,
    dp: int = 1,
    zero_stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
    micro_batch: int = 1,
    seq_len: int | None = None,
    checkpointing: bool = False,
    keep_grads: bool = False,
    activations: str = "gpt",
) -> MemoryBreakdown:
    """Per-rank training memory from formulas (no tensors are built).

    Give ``params`` (a count) or ``model`` (a ``GPTConfig``, a ``GPT`` or any module; only a
    GPT gives activations). Model states follow ZeRO (module docstring, ``bytes_per_param``):
    stage 1 shards the optimizer states, 2 also the gradients, 3 also the parameters over
    ``dp`` ranks. Activations are per rank for one micro-batch of ``seq_len`` tokens:

    * ``activations="gpt"`` (default): ``gpt_activation_bytes``, the tensors our GPT saves,
      and ``other`` = the loss-gradient temporaries (2 x tokens x vocab);
    * ``activations="korthikanti"``: the paper's per-layer formula as published (16-bit),
      doubled for fp32 activations (this course's adaptation); ``checkpointing`` selects its
      full recomputation (2*s*b*h per layer).

    ``total`` is the sum of all categories. ``peak`` is when they coexist: gradients appear
    during backward as activations are freed, so unless ``keep_grads`` (gradients living
    through the step: gradient accumulation, ``zero_grad(set_to_none=False)``) the peak is
    params + optimizer + the largest of: activations + temporaries at the start of
    backward; kept block inputs + one recomputed block and its backward temporaries + the
    gradients of later blocks (with checkpointing); the gradients (optimizer step).
    On small lab models this matched ``measure`` within 1 % without and within 4 % with
    checkpointing (see tests). Not counted: ZeRO-3's gathered layers, communication
    buckets, allocator overheads, and optimizer-step temporaries (torch's for-loop Adam on
    CPU makes two copies of the largest tensor, its for-each Adam, the CUDA default, about
    one fp32 copy of all parameters).
    """
    if (params is None) == (model is None):
        raise ValueError(
            f"estimate needs exactly one of params (got {params!r}) and model "
            f"(got {type(model).__name__}); e.g. estimate(params=7_500_000_000) or "
            f"estimate(model=GPTConfig.preset('gpt2'))"
        )
    _check_positive("dp", dp)
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) or zero_stage not in range(4):
        raise ValueError(
            f"zero_stage={zero_stage!r}; ZeRO has stages 0 (off), 1 (optimizer states), "
            f"2 (+ gradients) and 3 (+ parameters): use 0, 1, 2 or 3"
        )
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_positive("micro_batch", micro_batch)
    if seq_len is not None:
        _check_positive("seq_len", seq_len)
    if activations not in ("gpt", "korthikanti"):
        raise ValueError(f"activations={activations!r}; choose 'gpt' or 'korthikanti'")

    config: GPTConfig | None = None
    if isinstance(model, GPTConfig):
        config = model
        n = config.num_params()
    elif isinstance(model, GPT):
        config = model.config
        n = config.num_params()
    elif isinstance(model, nn.Module):
        n = sum(p.numel() for p in model.parameters())
    elif model is not None:
        raise ValueError(f"model must be a GPTConfig or an nn.Module, got {type(model).__name__}")
    else:
        if isinstance(params, bool) or not isinstance(params, int) or params < 0:
            raise ValueError(f"params={params!r} must be a non-negative integer count")
        n = params

    p_bytes, g_bytes, k_bytes = bytes_per_param(precision, optimizer)
    # ZeRO (Rajbhandari et al. 2020, Figure 1): each stage shards one more kind of state.
    param_mem = (_shard(n, dp) if zero_stage >= 3 else n) * p_bytes
    grad_mem = (_shard(n, dp) if zero_stage >= 2 else n) * g_bytes
    opt_mem = (_shard(n, dp) if zero_stage >= 1 else n) * k_bytes
    live_grads = 0 if keep_grads else grad_mem  # gradients that appear during the step

    act_mem = other = 0
    transient = live_grads  # the optimizer step holds all gradients
    if config is not None:
        seq = config.seq_len if seq_len is None else seq_len
        if activations == "gpt":
            parts = _gpt_activations(config, micro_batch, seq, precision)
            other = parts.loss_temps
            if checkpointing:
                kept = config.n_layers * parts.block_input
                act_mem = kept + parts.per_block + parts.head
                # Start of backward: kept inputs + head + loss temporaries. Later, the first
                # block is recomputed and differentiated while the gradients of all later
                # blocks and of the head exist.
                later_grads = round(live_grads * (1 - parts.first_block_share))
                transient = max(transient, kept + parts.head + other,
                                kept + parts.per_block + parts.block_temps + later_grads)
            else:
                act_mem = config.n_layers * parts.per_block + parts.head
                transient = max(transient, act_mem + other)
        else:
            act_mem = korthikanti_activation_bytes(
                seq, micro_batch, config.d_model, config.n_heads, config.n_layers,
                recompute="full" if checkpointing else "none",
            )
            if PRECISIONS[precision][4] == 4:
                act_mem *= 2  # course adaptation: fp32 activations are twice the 16-bit bytes
            transient = max(transient, act_mem)
    peak = param_mem + opt_mem + (grad_mem if keep_grads else 0) + transient
    source = f"estimate ({precision}, {optimizer}, dp={dp}, ZeRO-{zero_stage}, {activations})"
    return MemoryBreakdown(param_mem, grad_mem, opt_mem, act_mem, other, peak, source)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _step_tracker() -> Any:
    # MemTracker (torch.distributed._tools.mem_tracker) categorises every tensor storage as
    # parameter / gradient / optimizer state / activation / temporary. Two of its private
    # hooks are adjusted (checked against torch 2.13):
    # * it refuses a second forward of the root module ("multiple iterative calls"), which
    #   gradient accumulation does inside one step: clear its per-module stats (not the
    #   peak) before such a call;
    # * after every op it updates a peak for every module, which dominates the run time of
    #   big models (e.g. 27 s instead of a few for a fake Llama-2 7B step); we only read the
    #   global peak, so update just that.
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class _StepMemTracker(MemTracker):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            tracker = self._mod_tracker
            if module in self.memory_tracking and not tracker.is_bw:
                name = tracker.get_known_fqn(module)
                if set(tracker.parents) - {name} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)

    return _StepMemTracker()


@contextlib.contextmanager
def _removing_multi_grad_hooks() -> Any:
    """Remove the backward hooks that MemTracker's ModTracker puts on module inputs and outputs.

    Each hook's closure holds the autograd nodes of the tensors it is registered on: a cycle
    through C++ that Python's collector cannot free, so every tracked step leaked its
    parameters and gradients (torch 2.13: all but 5 of 29 parameters of a small GPT stayed
    alive after ``measure``). ModTracker keeps no handles, so record them here and remove
    them when the step is done.
    """
    from torch.distributed._tools import mod_tracker

    handles: list[Any] = []
    original = mod_tracker.register_multi_grad_hook

    def recording(*args: Any, **kwargs: Any) -> Any:
        handle = original(*args, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = recording
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original
        for handle in handles:
            handle.remove()


def measure(
    step_fn: Callable[[], Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    warmup: bool = True,
) -> MemoryBreakdown:
    """Run ``step_fn()`` (forward, backward, ``optimizer.step()``) and return its peak.

    With ``warmup`` one untracked step runs first so the optimizer state exists, as in every
    step after the first (Adam creates its states lazily in the first ``step()``). Memory is
    counted by torch's ``MemTracker``: exact tensor bytes on CPU, bytes rounded to the CUDA
    allocator's 512-byte blocks on GPU (allocator caching and fragmentation not included).
    Categories are read at the peak, so ``result.total`` is the peak on the model's device.
    ``step_fn`` may run several micro-batches (gradient accumulation). Note that the model
    trains: ``step_fn`` runs twice with ``warmup``.
    """
    if not callable(step_fn):
        raise ValueError(f"step_fn must be callable (a function running one step), got {step_fn!r}")
    if warmup:
        step_fn()
    tracker = _step_tracker()
    tracker.track_external(model, optimizer)
    with _removing_multi_grad_hooks(), tracker:
        step_fn()
    device = _model_device(model)
    snapshot = tracker.get_tracker_snapshot("peak")
    peak = snapshot.get(device)
    if peak is None:
        # e.g. device "cuda" vs "cuda:0": fall back to the device with the largest peak
        peak = max(snapshot.values(), key=lambda s: s["Total"], default={"Total": 0})

    def get(key: str) -> int:  # keys are MemTracker's category names
        return int(peak.get(key, 0))

    result = MemoryBreakdown(
        params=get("Parameter"),
        grads=get("Gradient"),
        optimizer=get("Optstate"),
        activations=get("Activation"),
        other=get("Temp") + get("Buffer") + get("Other"),
        source=f"measured (MemTracker, {device.type})",
    )  # peak defaults to the sum, which is MemTracker's peak (checked below)
    if result.total != get("Total"):
        raise RuntimeError(f"MemTracker categories {result.as_dict()} do not add up to {get('Total')}")
    return result


_FAKE_PRECISIONS = ("fp32", "bf16", "autocast")


def _make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    # model.to(dtype) swaps FakeTensor parameters in place, which torch refuses for tensors
    # that FakeTensorMode holds weak references to; build new Parameters instead, once per
    # tensor so that tied weights stay tied.
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in new:
                new[id(param)] = nn.Parameter(param.detach().to(dtype), param.requires_grad)
            setattr(module, name, new[id(param)])


def estimate_fake(
    config: GPTConfig,
    micro_batch: int,
    optimizer: str = "adam",
    precision: str = "fp32",
    checkpointing: bool = False,
    seq_len: int | None = None,
) -> MemoryBreakdown:
    """Peak memory of one training step of ``GPT(config)`` without allocating it.

    The model, optimizer and batch are FakeTensors (``torch._subclasses.fake_tensor``): shapes
    and dtypes are real, storage is not, so a 7B-parameter step is "run" in seconds with a
    few hundred MB of real memory and measured with ``measure`` (on the CPU code path, e.g.
    CPU attention kernels). ``precision``: "fp32", "bf16" (model and Adam states in bf16) or
    "autocast" (fp32 model, bf16 autocast); ZeRO's "mixed" needs an fp32 master copy that a
    plain torch optimizer does not keep, so use ``estimate`` for it.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    _check_positive("micro_batch", micro_batch)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    if precision not in _FAKE_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by estimate_fake; choose one of "
            f"{', '.join(_FAKE_PRECISIONS)}, or use estimate(precision={precision!r})"
        )
    seq = config.seq_len if seq_len is None else seq_len
    _check_positive("seq_len", seq)
    if seq > config.seq_len:
        raise ValueError(f"seq_len({seq}) > config.seq_len({config.seq_len}); use seq_len <= {config.seq_len}")

    with FakeTensorMode():
        model = GPT(config, checkpointing=checkpointing)
        if precision == "bf16":
            _cast_parameters(model, torch.bfloat16)
        opt = _make_optimizer(optimizer, model.parameters())
        x = torch.zeros(micro_batch, seq, dtype=torch.long)
        y = torch.zeros(micro_batch, seq, dtype=torch.long)

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        result = measure(step, model, opt, warmup=True)
    return MemoryBreakdown(
        result.params, result.grads, result.optimizer, result.activations, result.other,
        source=f"FakeTensor ({precision}, {optimizer}, micro_batch={micro_batch}, seq={seq})",
    )


@dataclass
class BatchSearch:
    """Result of ``find_max_batch``: the largest fitting micro-batch and every trial made."""

    batch: int
    trials: list[tuple[int, bool]] = field(default_factory=list)
    limit: int = 0

    @property
    def hit_limit(self) -> bool:
        """True when ``limit`` itself fits (the real maximum may be larger)."""
        return self.batch == self.limit


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def find_max_batch(
    step_fn: Callable[[int], Any],
    *,
    start: int = 1,
    limit: int = 4096,
) -> BatchSearch:
    """Largest micro-batch in [1, limit] for which ``step_fn(micro_batch)`` does not OOM.

    ``step_fn`` runs one training step and raises ``torch.OutOfMemoryError`` when it does
    not fit (CUDA does; so does labkit's emulated memory budget on CPU). The search doubles
    from ``start`` until a step fails, then bisects between the last fit and the first
    failure: about 2*log2(answer) trials. After each failure the exception is dropped and
    memory freed (``gc.collect()``, ``torch.cuda.empty_cache()``) before the next trial,
    so nothing of a failed step is left behind.
    Returns ``batch=0`` when no size fits. Assumes a larger batch never uses less memory.
    """
    if not callable(step_fn):
        raise ValueError(f"step_fn must be callable as step_fn(micro_batch), got {step_fn!r}")
    _check_positive("start", start)
    _check_positive("limit", limit)
    if start > limit:
        raise ValueError(f"start({start}) > limit({limit}); use start <= limit")

    trials: list[tuple[int, bool]] = []

    def fits(batch: int) -> bool:
        ok = True
        try:
            step_fn(batch)
        except torch.OutOfMemoryError:
            ok = False
        if not ok:
            # Outside the except block the exception and its traceback (whose frames hold
            # the failed step's tensors) are gone, so the memory can really be released.
            _free_memory()
        trials.append((batch, ok))
        return ok

    good, bad = 0, limit + 1  # invariant: good fits (or is 0), bad fails (or is past limit)
    batch = start
    while True:  # doubling phase
        if fits(batch):
            good = batch
            if batch == limit:
                break
            batch = min(2 * batch, limit)
        else:
            bad = batch
            break
    while bad - good > 1:  # bisection phase
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return BatchSearch(batch=good, trials=trials, limit=limit)


# ---------------------------------------------------------------- gradient accumulation


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that micro_batch x steps x world_size == global_batch.

    Raises ValueError, with the values and a fix, when the sizes are not positive or the
    global batch does not divide into micro-batches over the ranks (the optimizer would then
    see a different batch than the one asked for).
    """
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch),
                        ("world_size", world_size)):
        _check_positive(name, value)
    per_step = micro_batch * world_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    if global_batch % world_size == 0:
        per_rank = global_batch // world_size
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        fix = (f"use a micro_batch that divides global_batch / world_size = {per_rank}: "
               f"{', '.join(map(str, divisors))}")
    else:
        lower = global_batch // per_step * per_step
        fix = (f"use global_batch={lower or per_step} or {lower + per_step} "
               f"(a multiple of {per_step}), or another micro_batch")
    if per_step > global_batch:
        problem = (f"micro_batch({micro_batch}) x world_size({world_size}) = {per_step} "
                   f"> global_batch({global_batch})")
    else:
        problem = (f"global_batch({global_batch}) is not divisible by micro_batch({micro_batch}) "
                   f"x world_size({world_size}) = {per_step}")
    raise ValueError(f"{problem}; every rank must run the same whole number of micro-steps: {fix}")


def choose_micro_batch(global_batch: int, world_size: int, max_fit: int) -> int:
    """Largest micro-batch <= ``max_fit`` that divides this rank's share of ``global_batch``.

    ``max_fit`` is the largest micro-batch that fits (e.g. ``max_micro_batch(...).batch``).
    Raises ValueError when not even one sample fits or the batch cannot be shared evenly.
    """
    _check_positive("global_batch", global_batch)
    _check_positive("world_size", world_size)
    if isinstance(max_fit, bool) or not isinstance(max_fit, int) or max_fit < 1:
        raise ValueError(
            f"max_fit={max_fit!r}: not even a micro-batch of 1 fits in memory; accumulation "
            f"cannot help. Use bf16 autocast, activation checkpointing, a shorter sequence, "
            f"or shard the model states (ZeRO / FSDP)"
        )
    if global_batch % world_size != 0:
        accumulation_steps(global_batch, 1, world_size)  # raises with the values and the fix
    per_rank = global_batch // world_size
    return max(d for d in range(1, min(per_rank, max_fit) + 1) if per_rank % d == 0)


def rank_micro_batches(
    config: GPTConfig,
    global_batch: int,
    micro_batch: int,
    rank: int,
    world_size: int,
    *,
    step: int = 0,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches ``[(x, y), ...]`` of global batch number ``step``.

    The global batch is ``synthetic_batch(config, global_batch, seed=seed, step=step)``;
    rank r takes rows [r*B/n, (r+1)*B/n) and cuts them into ``micro_batch`` rows each. Any
    split of the same global batch therefore sees the same samples, so its gradient can be
    compared with ``reference_gradients``.
    """
    steps = accumulation_steps(global_batch, micro_batch, world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in 0..{world_size - 1} (world_size={world_size})")
    x, y = synthetic_batch(config, global_batch, seed=seed, step=step)
    per_rank = global_batch // world_size
    first = rank * per_rank
    out = []
    for i in range(steps):
        rows = slice(first + i * micro_batch, first + (i + 1) * micro_batch)
        # clone: a slice would keep the whole global batch alive on every rank
        out.append((x[rows].clone().to(device), y[rows].clone().to(device)))
    return out


def accumulate_with_no_sync(ddp: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Sum the gradients of ``mean loss / len(batches)`` over the micro-batches; one all-reduce.

    Every micro-step but the last runs inside ``ddp.no_sync()``, so DDP only accumulates the
    local gradients; the last backward all-reduces the sum, bucket by bucket (PyTorch docs,
    ``DistributedDataParallel.no_sync``).
    """
    n = len(batches)
    for x, y in batches[:-1]:
        with ddp.no_sync():
            (ddp(x, y) / n).backward()
    x, y = batches[-1]
    (ddp(x, y) / n).backward()


def accumulate_without_no_sync(ddp: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The silent mistake: the same gradients, but DDP all-reduces after every micro-step."""
    n = len(batches)
    for x, y in batches:
        (ddp(x, y) / n).backward()


class _Runner(nn.Module):
    """The model as DDP sees it: forward under bf16 ``torch.autocast`` if asked (backward then
    runs outside it, as the autocast docs advise), and each loss value logged."""

    def __init__(self, model: nn.Module, device_type: str, autocast: bool) -> None:
        super().__init__()
        self.model = model
        self.device_type = device_type
        self.autocast = autocast
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(x, y)
        self.losses.append(float(loss.detach()))
        return loss


_DP_PRECISIONS = ("fp32", "autocast")


def _lab_model(config: GPTConfig, precision: str, checkpointing: bool, seed: int,
               device: torch.device) -> tuple[GPT, _Runner]:
    if precision not in _DP_PRECISIONS:
        raise ValueError(f"precision={precision!r}; choose 'fp32' or 'autocast' (bf16 autocast)")
    torch.manual_seed(seed)
    model = GPT(config, checkpointing=checkpointing).to(device)
    return model, _Runner(model, device.type, precision == "autocast")


def _peak_bytes(device: torch.device) -> int | None:
    """The device's peak since the last reset: CUDA, the emulated budget, or None (neither)."""
    from labkit.emulate import active_budget, max_memory_allocated

    if device.type == "cuda" or active_budget() is not None:
        return max_memory_allocated(device)
    return None


def _host_flat(tensors: list[torch.Tensor]) -> Any:
    """One flat numpy copy of ``tensors`` in host memory, which the device budget does not
    count (``.cpu()`` copies on a GPU; on CPU numpy copies outside torch's dispatcher, and no
    tensor is made from it here: ``torch.from_numpy`` under the emulated budget is counted)."""
    import numpy as np

    parts = [t.detach().cpu().numpy().reshape(-1) for t in tensors]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class DPResult:
    """What one rank of ``dp_train`` measured on its last optimizer step."""

    rank: int
    world_size: int
    global_batch: int
    micro_batch: int
    accumulation_steps: int
    precision: str
    checkpointing: bool
    peak_bytes: int  # peak memory of the last optimizer step on this rank
    peak_source: str  # "emulated budget", "torch.cuda.max_memory_allocated" or "MemTracker"
    allreduce_calls: int  # bucket all-reduces DDP issued in the last optimizer step
    buckets: int  # DDP's buckets (distinct bucket indices seen in that step)
    allreduce_bytes: int  # bytes of gradient buckets all-reduced in that step
    step_s: float  # wall time of the last optimizer step (MemTracker slows it when used)
    loss: float  # mean loss over this rank's share of the last global batch
    grads_array: Any = None  # numpy: first step's gradients, flattened (return_grads=True)
    breakdown: MemoryBreakdown | None = None  # MemTracker categories at the peak

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / _MIB

    @property
    def grads(self) -> torch.Tensor | None:
        """The first step's gradients as a flat CPU tensor (None without ``return_grads``)."""
        return None if self.grads_array is None else torch.from_numpy(self.grads_array)


class _AllReduceCounter:
    """State of a DDP comm hook that counts the bucket all-reduces, then does the default one."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (bucket index, bytes)

    @staticmethod
    def hook(state, bucket):  # unannotated: DDP rejects annotations other than its own
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buffer = bucket.buffer()
        state.calls.append((bucket.index(), buffer.numel() * buffer.element_size()))
        return allreduce_hook(None, bucket)  # None: the default process group


def dp_train(
    config: GPTConfig,
    global_batch: int,
    micro_batch: int,
    *,
    accumulate: Callable[[nn.Module, list], Any] | None = None,
    precision: str = "fp32",
    checkpointing: bool = False,
    optimizer_steps: int = 2,
    bucket_cap_mb: float = 1.0,
    seed: int = 0,
    breakdown: bool = False,
    return_grads: bool = False,
) -> DPResult:
    """Data-parallel training steps of ``GPT(config)`` on this rank; run it with ``labkit.launch``.

    Each optimizer step processes one global batch: ``micro_batch`` samples x
    ``accumulation_steps(...)`` micro-steps x world_size ranks, through
    ``accumulate(ddp, batches)`` (default ``accumulate_with_no_sync``), then Adam.
    DDP uses ``gradient_as_bucket_view=True`` (gradients live in DDP's buckets, no second
    copy; PyTorch DDP docs) and ``zero_grad(set_to_none=False)``: with ``set_to_none=True``
    the gradients of micro-steps under ``no_sync`` are new tensors next to the buckets
    (measured: +1 gradient copy, 57.1 instead of 53.5 MiB on a 3.6 MiB-gradient model).
    A comm hook counts DDP's bucket all-reduces. Step 1 creates Adam's states and lets DDP
    rebuild its buckets in gradient order (torch 2.13 puts all parameters in one bucket for
    the first step), so the counts and the peak come from the last step. ``breakdown`` runs
    that step under ``measure`` (MemTracker); ``return_grads`` returns step 1's gradients
    (before any update), flattened in parameter order, as a host copy.
    """
    import time

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.launch import device as rank_device

    if not dist.is_initialized():
        raise ValueError("dp_train runs on a rank: call it as labkit.launch(dp_train, config, ...)")
    _check_positive("optimizer_steps", optimizer_steps)
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be > 0, e.g. 1.0 or DDP's default 25")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    steps = accumulation_steps(global_batch, micro_batch, world_size)
    accumulate = accumulate_with_no_sync if accumulate is None else accumulate
    # Several runs can share a rank (e.g. one launch comparing options): let the collector
    # free what earlier ones left in reference cycles, so the peak counts this run only.
    _free_memory()
    device = rank_device()
    model, runner = _lab_model(config, precision, checkpointing, seed, device)
    ddp = DDP(runner, gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb)
    counter = _AllReduceCounter()
    ddp.register_comm_hook(counter, _AllReduceCounter.hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    grads: Any = None  # numpy copy of the first step's gradients
    losses: list[float] = []  # mean loss of this rank's share of each global batch

    def one_step(step: int) -> None:
        nonlocal grads
        batches = rank_micro_batches(config, global_batch, micro_batch, rank, world_size,
                                     step=step, seed=seed, device=device)
        runner.losses.clear()
        accumulate(ddp, batches)
        if len(runner.losses) != steps:
            raise ValueError(
                f"accumulate ran {len(runner.losses)} forward passes for {steps} micro-batches; "
                f"call ddp(x, y) once for every (x, y) in batches"
            )
        losses.append(sum(runner.losses) / steps)
        if return_grads and step == 0:
            missing = [name for name, p in model.named_parameters() if p.grad is None]
            if missing:
                raise ValueError(f"no gradient for {missing[:3]}...: did accumulate call backward()?")
            grads = _host_flat([p.grad for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    for step in range(optimizer_steps - 1):
        one_step(step)
    counter.calls.clear()
    reset_peak_memory_stats(device)
    last = optimizer_steps - 1
    t0 = time.perf_counter()
    measured = None
    if breakdown or _peak_bytes(device) is None:
        measured = measure(lambda: one_step(last), model, optimizer, warmup=False)
    else:
        one_step(last)
    step_s = time.perf_counter() - t0
    peak = _peak_bytes(device)
    if peak is None:
        source = "MemTracker"
        peak = int(measured.peak)  # type: ignore[union-attr]
    else:
        source = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "emulated budget"
    return DPResult(
        rank=rank,
        world_size=world_size,
        global_batch=global_batch,
        micro_batch=micro_batch,
        accumulation_steps=steps,
        precision=precision,
        checkpointing=checkpointing,
        peak_bytes=int(peak),
        peak_source=source,
        allreduce_calls=len(counter.calls),
        buckets=len({index for index, _ in counter.calls}),
        allreduce_bytes=sum(nbytes for _, nbytes in counter.calls),
        step_s=step_s,
        loss=losses[-1],
        grads_array=grads,
        breakdown=measured if breakdown else None,
    )


def max_micro_batch(
    config: GPTConfig,
    *,
    precision: str = "fp32",
    checkpointing: bool = False,
    start: int = 1,
    limit: int = 4096,
    seed: int = 0,
) -> BatchSearch:
    """``find_max_batch`` for one rank's training step of ``GPT(config)`` on this device.

    Run it where the memory limit is (``labkit.launch`` on a cluster with ``memory_gib``:
    the emulated budget, or the GPU with its memory fraction). The trial step is a plain
    (non-DDP) step with Adam and ``zero_grad(set_to_none=False)``: the same bytes as a
    ``dp_train`` rank, whose gradients live in DDP's buckets for the whole step (both match
    ``estimate(..., keep_grads=True)`` in the tests). Trials do not communicate, so an OOM on
    one rank never leaves another waiting in a collective (a DDP step failing mid-backward
    could).
    """
    from labkit.launch import device as rank_device

    _free_memory()  # what earlier runs on this rank left in reference cycles
    device = rank_device()
    model, runner = _lab_model(config, precision, checkpointing, seed, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(batch: int) -> None:
        try:
            x, y = synthetic_batch(config, batch, seed=seed, device=device)
            runner(x, y).backward()
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=False)

    return find_max_batch(step, start=start, limit=limit)


def reference_gradients(config: GPTConfig, global_batch: int, *, seed: int = 0) -> torch.Tensor:
    """Gradient of the mean loss over the whole first global batch, in one process, fp32.

    The big-batch gradient that gradient accumulation must reproduce: same initial weights
    (``torch.manual_seed(seed)``) and same samples as ``dp_train``'s first step, flattened
    in parameter order. Runs on CPU with no memory budget.
    """
    _check_positive("global_batch", global_batch)
    torch.manual_seed(seed)
    model = GPT(config)
    x, y = synthetic_batch(config, global_batch, seed=seed, step=0)
    model(x, y).backward()
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()])
