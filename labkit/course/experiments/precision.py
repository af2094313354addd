"""Lab 02's precision driver: fp32 against bf16 and fp16 mixed precision, in one process.

* ``compare_precisions``: the same seeded ``GPT`` trained for a few AdamW steps in fp32, under
  bf16 ``torch.autocast`` (no loss scaling) and under fp16 ``torch.autocast`` with a
  ``GradScaler``; for each, how far the first gradient is from fp32's, the losses, the loss
  scale, the skipped steps, and the memory of one step (``labkit.measured_memory.measure``);
* ``forced_overflow``: one fp16 step whose gradient is made inf, which the scaler skips (and
  halves its scale), then one normal step.

Neighbours: ``oom_batch.py`` (lab 02's data-parallel driver, bf16 autocast only) and
``labkit.models`` (``seeded_model``); the memory formulas are in ``labkit.memory``.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit import validate
from labkit.machine import runtime
from labkit.measured_memory import free_memory, measure
from labkit.models import GPTConfig, seeded_model, synthetic_batch

__all__ = ["VARIANTS", "compare_precisions", "forced_overflow"]

# name -> autocast dtype (None: plain fp32). Only fp16 needs loss scaling: bf16 keeps fp32's
# 8 exponent bits, so small gradients do not underflow (Kalamkar et al. 2019, "A Study of
# BFLOAT16 for Deep Learning Training"); fp16 has 5 and flushes them to zero without it.
VARIANTS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check(config: Any, batch_size: Any, seed: Any, device: Any) -> torch.device:
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config={config!r} must be a GPTConfig; e.g. GPTConfig(n_layers=2, d_model=32)")
    validate.positive_int("batch_size", batch_size, "batch_size=4")
    validate.non_negative_int("seed", seed, "seed=0")
    if device is None:
        return runtime.device()
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device={device!r} must be a torch device; e.g. device='cpu', "
            f"device='cuda:0', or None for labkit.machine.runtime.device()"
        ) from None


class _Run:
    """One model, its AdamW and its GradScaler (enabled for fp16 only), stepping on ``device``."""

    def __init__(
        self, config: GPTConfig, dtype: torch.dtype | None, lr: float, seed: int, device: torch.device
    ) -> None:
        self.config, self.dtype, self.seed, self.device = config, dtype, seed, device
        self.model = seeded_model(config, seed, device)  # every variant starts from these weights
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, **runtime.optimizer_options())
        # A disabled GradScaler passes the loss and the step through unchanged (torch.amp docs).
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)

    def backward(self, batch_size: int, step: int) -> float:
        """Forward under autocast (if any), backward outside it, as the AMP docs advise."""
        x, y = synthetic_batch(self.config, batch_size, seed=self.seed, step=step, device=self.device)
        # Gradients are zeroed in place (not set to None) so they stay allocated through the
        # whole step, as in oom_batch.py: the measured model states are then params + grads + Adam.
        self.optimizer.zero_grad(set_to_none=False)
        with torch.autocast(
            self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None
        ):
            loss = self.model(x, y)
        # Loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2):
        # multiply the loss by S so small fp16 gradients stay representable; divide them again
        # before the update. The scaler's S starts at 2**16 (init_scale).
        self.scaler.scale(loss).backward()
        return float(loss.detach())

    def update(self) -> bool:
        """``scaler.step`` then ``scaler.update``; True if the optimizer step was skipped.

        torch.amp GradScaler docstring: if the (unscaled) gradients hold infs/NaNs,
        ``scaler.step`` skips ``optimizer.step()`` and ``update()`` multiplies the scale by
        ``backoff_factor`` (0.5); otherwise it grows by ``growth_factor`` only after
        ``growth_interval`` (2000) clean steps. So within a few steps, a drop means a skip.
        """
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < before

    def flat_grads(self) -> torch.Tensor:
        """The true (unscaled) gradients, flattened. ``unscale_`` divides them by the scale in
        place, and ``step`` then does not divide again ("Working with Unscaled Gradients" in
        the AMP examples); a no-op when the scaler is disabled."""
        self.scaler.unscale_(self.optimizer)
        return torch.cat([p.grad.detach().flatten() for p in self.model.parameters()])

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def compare_precisions(
    config: GPTConfig,
    batch_size: int,
    *,
    steps: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Train ``GPT(config)`` for ``steps`` AdamW steps in fp32, bf16 autocast and fp16 autocast
    with a GradScaler, from the same seeded weights on the same batches (one process).

    Returns ``{"device": str, "steps": int, "fp32": {...}, "bf16": {...}, "fp16": {...}}``; each
    variant holds ``dtype`` (str), ``grad_max_abs`` (largest |gradient| of step 0, unscaled),
    ``grad_rel_diff`` (max |g - g_fp32| / max |g_fp32| at step 0; 0.0 for fp32), ``losses`` (the
    loss of each step's forward pass, before its update), ``scales`` (the loss scale after each
    step; [] unless fp16), ``skipped_steps``, and the memory of one more step measured with
    ``labkit.measured_memory.measure``: ``activation_bytes``, ``model_state_bytes`` (params +
    grads + AdamW states), ``peak_bytes`` and ``breakdown`` (the ``MemoryBreakdown``). Autocast
    keeps the fp32 weights and makes 2-byte copies for its matmuls, saved for backward: they
    count as activations.
    """
    dev = _check(config, batch_size, seed, device)
    validate.positive_int("steps", steps, "steps=3")
    validate.positive_number("lr", lr, "lr=1e-3")
    free_memory()  # what earlier runs left in reference cycles must not count in the peaks
    result: dict[str, Any] = {"device": str(dev), "steps": steps}
    reference: torch.Tensor | None = None
    for name, dtype in VARIANTS.items():
        run = _Run(config, dtype, lr, seed, dev)
        losses, scales, skipped = [], [], 0
        grads: torch.Tensor | None = None
        for step in range(steps):
            losses.append(run.backward(batch_size, step))
            if step == 0:
                grads = run.flat_grads()
            skipped += run.update()
            if dtype is torch.float16:
                scales.append(run.scaler.get_scale())
        if reference is None:
            reference = grads
        denom = reference.abs().max().item()
        rel = (grads - reference).abs().max().item() / denom if denom > 0 else 0.0

        def one_step(run: _Run = run, step: int = steps) -> None:  # the batch after the last one
            run.backward(batch_size, step)
            run.update()

        # AdamW's states exist after the steps above (unless every one was skipped): no warm-up.
        memory = measure(one_step, run.model, run.optimizer, warmup=False)
        result[name] = {
            "dtype": "float32" if dtype is None else str(dtype).removeprefix("torch."),
            "grad_max_abs": grads.abs().max().item(),
            "grad_rel_diff": rel,
            "losses": losses,
            "scales": scales,
            "skipped_steps": skipped,
            "activation_bytes": memory.activations,
            "model_state_bytes": memory.params + memory.grads + memory.optimizer,
            "peak_bytes": int(memory.peak),
            "breakdown": memory,
        }
    return result


def forced_overflow(
    config: GPTConfig, batch_size: int, *, seed: int = 0, device: str | torch.device | None = None
) -> dict[str, Any]:
    """One fp16 + GradScaler step with an inf planted in a gradient, then one normal step.

    The inf stands for an fp16 overflow in backward. Returns ``skipped`` (the scale dropped),
    ``params_changed`` (False: the skipped step must leave every parameter bit-identical),
    ``scale_before`` / ``scale_after`` (2**16, then halved by ``backoff_factor`` 0.5), and for
    the next, clean step: ``next_skipped`` (False), ``next_params_changed`` (True),
    ``next_scale`` (unchanged: growth needs ``growth_interval`` clean steps).
    """
    dev = _check(config, batch_size, seed, device)
    free_memory()
    run = _Run(config, torch.float16, 1e-3, seed, dev)
    start = run.parameters()
    scale_before = run.scaler.get_scale()
    run.backward(batch_size, 0)
    with torch.no_grad():  # after backward, before scaler.step: what an overflow leaves behind
        next(run.model.parameters()).grad.view(-1)[0] = float("inf")
    # scaler.step finds the inf while unscaling and skips optimizer.step(); update() then
    # multiplies the scale by backoff_factor (torch.amp "Gradient Scaling"; GradScaler
    # docstring). Dynamic loss scaling as in Micikevicius et al. 2018, section 3.2.
    skipped = run.update()
    after_skip = run.parameters()
    scale_after = run.scaler.get_scale()
    run.backward(batch_size, 1)
    next_skipped = run.update()
    after_next = run.parameters()

    def changed(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return not all(torch.equal(p, q) for p, q in zip(a, b))

    return {
        "device": str(dev),
        "skipped": skipped,
        "params_changed": changed(start, after_skip),
        "scale_before": scale_before,
        "scale_after": scale_after,
        "next_skipped": next_skipped,
        "next_params_changed": changed(after_skip, after_next),
        "next_scale": run.scaler.get_scale(),
    }
