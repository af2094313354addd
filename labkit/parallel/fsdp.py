"""Fully sharded data parallelism (ZeRO-3) for the lab GPT with torch's FSDP2 (`fully_shard`).

Plain data parallelism keeps the whole model, its gradients and its optimizer states on every rank: 16 bytes
per parameter with mixed-precision Adam (`labkit.memory`), so a 5-billion-parameter model needs 80 GB per
GPU before any activation. ZeRO stage 3 (Rajbhandari et al. 2020, section 5.3) shards all three over the
data-parallel ranks, 16 / N bytes per parameter, and pays with communication: each unit's parameters are
all-gathered before its forward, gathered again before its backward, and its gradients reduce-scattered
after, about 1.5 times plain data parallelism's all-reduce bytes.

`fully_sharded` applies torch's FSDP2 as torch's own recipe (and torchtitan's) does: one `fully_shard` per
transformer block, so that only one or two blocks are whole at a time, then one on the root for the
embeddings and the head. The sharded parameters are DTensors in the dtype the model was made in (fp32: the
master weights); with `param_dtype` each block is gathered and computes in that dtype and its gradients are
reduced in `reduce_dtype` (FSDP2's `MixedPrecisionPolicy`). FSDP2 averages the gradients over the group, as
DDP does. The process group is passed explicitly (None: the default group) and becomes a one-dimensional
`DeviceMesh`. On a simulated machine the mesh's rank list is made on real tensors (`DeviceMesh` reads it back
with `.tolist()`, which a FakeTensor cannot answer); the rest runs at GPU size on the simulated device, which
counts FSDP2's freed and refilled unsharded parameters (`SimulatedDevice.resized`) and times the sharded
DTensors' operators on their local shards.

Neighbours: `data.py` (plain data parallelism), `tensor.py`, `pipeline.py`; `labkit.memory.estimate`
(`zero_stage=3`) predicts the memory this uses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from labkit.machine import _torch_compat as compat
from labkit.models import GPT

__all__ = ["full_gradients", "fully_sharded"]


def _mesh(group: dist.ProcessGroup | None, device_type: str) -> DeviceMesh:
    with compat.real_tensors():  # no-op outside a FakeTensorMode
        return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)


def fully_sharded(
    model: GPT,
    group: dist.ProcessGroup | None = None,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> GPT:
    """Shard `model` over `group` with FSDP2, in place: each block, then the root; returns `model`.

    Every rank must hold the same weights before the call (e.g. `labkit.models.seeded_model`).
    `param_dtype` / `reduce_dtype`: the dtype blocks are gathered and compute in, and the one gradients are
    reduce-scattered in (None: the parameters' own). `reshard_after_forward`: free each block's gathered
    parameters after its forward (ZeRO-3) or keep them until backward (less communication, more memory)."""
    if not isinstance(model, GPT):
        raise ValueError(f"fully_sharded(model) needs a labkit.models.GPT, got {type(model).__name__}")
    device_type = next(model.parameters()).device.type
    mesh = _mesh(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root (embeddings, ln_f, head): FSDP2 keeps it gathered from forward to backward, which starts there.
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if device_type != "cuda":
        _prefetch_one_block_ahead(blocks, model)
    return model


def _prefetch_one_block_ahead(blocks: list[nn.Module], model: nn.Module) -> None:
    """On a GPU the next block's all-gather runs on FSDP2's own stream under this block's compute, because the
    CPU issues it ahead (implicit prefetching). A rank without CUDA streams (emulated, simulated) would wait
    for each gather where it is issued, every byte exposed. Asked for one block ahead, forward and backward,
    with asynchronous all-gathers, it overlaps them as the GPU does (FSDP2's explicit prefetching). Its
    reduce-scatters stay synchronous there: FSDP2 has no asynchronous form of them, so on CPU ranks each
    block's gradient reduction is exposed, where a GPU overlaps it with the next block's backward."""
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    compat.unshard_asynchronously(model)


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name, gathered from the shards (a collective: call it on every
    rank of the group); for comparing with one process."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad
        out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return out
