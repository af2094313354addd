"""Measured training memory: MemTracker categories, FakeTensor estimates, the largest batch that fits.

* ``measure(step_fn, model, optimizer)``: run one step under torch's ``MemTracker`` and read
  the bytes per category (parameters, gradients, optimizer states, activations) at the peak;
* ``estimate_fake(config, micro_batch)``: the same for a model too large to allocate, with
  FakeTensors (shapes without storage);
* ``find_max_batch(step_fn)``: the largest micro-batch whose step does not raise
  ``torch.OutOfMemoryError`` (CUDA's, or the emulated budget's), by doubling then bisection.

The formulas these are checked against are ``labkit.memory``. The private torch pieces
(MemTracker's hooks, FakeTensorMode) are fenced in ``labkit.machine._torch_compat``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labkit import validate
from labkit.machine import _torch_compat as compat
from labkit.memory import OPTIMIZERS, MemoryBreakdown
from labkit.models import GPT, GPTConfig

__all__ = ["BatchSearch", "estimate_fake", "find_max_batch", "free_memory", "measure"]


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


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
        raise ValueError(f"step_fn={step_fn!r} must be callable: a function running one step")
    if warmup:
        step_fn()
    tracker = compat.step_mem_tracker()
    tracker.track_external(model, optimizer)
    with tracker:
        with compat.removing_module_grad_hooks():  # only while the tracked step runs
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

    The model, optimizer and batch are FakeTensors (``labkit.machine._torch_compat.fake_tensor_mode``): shapes
    and dtypes are real, storage is not, so a 7B-parameter step is "run" in seconds with a
    few hundred MB of real memory and measured with ``measure`` (on the CPU code path, e.g.
    CPU attention kernels). ``precision``: "fp32", "bf16" (model and Adam states in bf16) or
    "autocast" (fp32 model, bf16 autocast); ZeRO's "mixed" needs an fp32 master copy that a
    plain torch optimizer does not keep, so use ``estimate`` for it.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    validate.positive_int("micro_batch", micro_batch)
    validate.one_of("optimizer", optimizer, OPTIMIZERS)
    if precision not in _FAKE_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by estimate_fake; choose one of "
            f"{', '.join(_FAKE_PRECISIONS)}, or use estimate(precision={precision!r})"
        )
    seq = config.seq_len if seq_len is None else seq_len
    validate.positive_int("seq_len", seq)
    if seq > config.seq_len:
        raise ValueError(
            f"seq_len({seq}) > config.seq_len({config.seq_len}); use seq_len <= {config.seq_len}"
        )

    with compat.fake_tensor_mode():
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
        result.params,
        result.grads,
        result.optimizer,
        result.activations,
        result.other,
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


def free_memory() -> None:
    """Collect Python garbage and return cached CUDA blocks, so the next trial starts clean."""
    gc.collect()
    if torch.cuda.is_initialized():  # never create a CUDA context just to empty it
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
    validate.positive_int("start", start)
    validate.positive_int("limit", limit)
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
            free_memory()
        trials.append((batch, ok))
        return ok

    return BatchSearch(batch=_largest_fit(fits, start, limit), trials=trials, limit=limit)


def _largest_fit(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """Double from `start` until a size fails (or `limit` fits), then bisect between the last fit and the
    first failure; 0 when nothing fits."""
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
    return good
