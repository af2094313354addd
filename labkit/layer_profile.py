"""What each layer of a GPT costs inside a whole training step, and what it saves for backward.

`profile_layers(model, x, y)` gives, per layer of a `labkit.models.GPT` ("embedding", "block i", "head"), the
forward and backward time (on the rank's timer, `labkit.machine.timer.clock`) and the bytes autograd saves:
the costs `labkit.pipeline_plan.balance` splits into pipeline stages (lab 04).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit import validate
from labkit.machine import _torch_compat as compat
from labkit.machine import timer

__all__ = ["LayerProfile", "profile_layers"]


@dataclass(frozen=True)
class LayerProfile:
    """One layer's measured cost per micro-batch, and what autograd saves for its backward."""

    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int

    @property
    def ms(self) -> float:
        return self.forward_ms + self.backward_ms


def _saved_bytes(
    fn: Callable[[], torch.Tensor], params: frozenset[int] = frozenset()
) -> tuple[torch.Tensor, int]:
    """Run fn and count the bytes of the tensors autograd saves for backward (each storage once), but
    the parameters (`params`: their ids), which a linear layer saves too: they are resident whatever the
    micro-batch, so a step adds only the rest (issue 44: counted in, they made a lopsided split's memory
    prediction miss)."""
    seen: dict[int, int] = {}
    kept = []  # a FakeTensor's storage has no address: keyed by the storage object, kept alive meanwhile

    def pack(t: torch.Tensor) -> torch.Tensor:
        owner = compat.view_base(t)
        if id(t) in params or (owner is not None and id(owner) in params):
            return t
        if t.device.type != "meta":
            storage = t.untyped_storage()
            if compat.is_fake(t):
                kept.append(storage)
                seen[id(storage)] = storage.nbytes()
            else:
                seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def profile_layers(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, repeats: int = 5, warmup: int = 1
) -> list[LayerProfile]:
    """Forward and backward cost (median of `repeats` training steps after `warmup` untimed ones) and saved
    activations of each layer of a GPT: "embedding" (token + position), "block i", and "head" (final norm,
    LM head, loss).

    Each layer is timed inside a whole forward and backward of the model, as a pipeline stage runs it:
    forward from clock readings between layers, backward from gradient hooks on the tensors between
    layers (a layer's backward ends when the gradient of its input is ready). Timed on its own, hot in
    the cache, the head looked 20-40 % cheaper next to the blocks than it is in a real step (its logits
    are cold by the time backward reaches them), which a balanced split then inherits. With a large
    vocabulary the head (and the embedding's gradient) weigh as much as several blocks, which a split
    by layer count ignores. Gradients accumulate between repeats, as over a pipeline's micro-batches.
    """
    validate.positive_int("repeats", repeats, "profile_layers(model, x, y, repeats=5)")
    validate.non_negative_int("warmup", warmup, "profile_layers(model, x, y, warmup=1)")
    for name in ("tok_emb", "pos_emb", "blocks", "ln_f", "lm_head"):
        if not hasattr(model, name):
            raise TypeError(
                f"profile_layers needs a labkit.models.GPT (no .{name} on {type(model).__name__})"
            )
    clock = timer.clock

    def embedding(_: torch.Tensor | None) -> torch.Tensor:
        return model.embed(x)

    def head(h: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(model.ln_f(h))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))

    layers: list[tuple[str, Callable]] = [("embedding", embedding)]
    layers += [(f"block {i}", block) for i, block in enumerate(model.blocks)]
    layers.append(("head", head))
    weights = frozenset(id(p) for p in model.parameters())
    saved, h = [], None  # one untimed pass: what each layer saves for backward
    for _, layer in layers:
        h, nbytes = _saved_bytes(lambda layer=layer, h=h: layer(h), weights)
        saved.append(nbytes)
    h.backward()
    n = len(layers)
    fwd: list[list[float]] = [[] for _ in layers]
    bwd: list[list[float]] = [[] for _ in layers]
    for _ in range(warmup + repeats):
        marks, ready = [clock()], [0.0] * n  # ready[i]: when the gradient of layer i's input was ready
        h = None
        for i, (_, layer) in enumerate(layers):
            h = layer(h)
            marks.append(clock())
            if i < n - 1:
                h.register_hook(lambda g, i=i + 1, ready=ready: ready.__setitem__(i, clock()))
        t0 = clock()
        h.backward()
        ready[0] = clock()  # the embedding's backward ends with backward itself
        done = [t0] + [ready[i] for i in range(n - 1, -1, -1)]  # head's end first, embedding's last
        for k, i in enumerate(range(n - 1, -1, -1)):
            fwd[i].append(marks[i + 1] - marks[i])
            bwd[i].append(done[k + 1] - done[k])
    model.zero_grad(set_to_none=True)
    return [
        LayerProfile(name, statistics.median(f[warmup:]) * 1e3, statistics.median(b[warmup:]) * 1e3, nb)
        for (name, _), f, b, nb in zip(layers, fwd, bwd, saved)
    ]
