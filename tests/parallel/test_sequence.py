"""labkit.parallel.sequence: sequence parallelism on top of tensor parallelism (and vocabulary parallelism)
gives one process's loss and gradients on 2 and 4 emulated ranks, GPT-2 and llama blocks, with checkpointing
too; its all-gathers and reduce-scatters carry the bytes of tensor parallelism's all-reduces."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit import Cluster, launch
from labkit.links import Link
from labkit.models import GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.sequence import sequence_parallel
from labkit.parallel.tensor import TPStats, shard_state, tensor_parallel
from labkit.parallel.vocab import vocab_parallel

pytestmark = pytest.mark.usefixtures("one_thread")

GPT2 = GPTConfig(n_layers=3, d_model=32, n_heads=4, vocab_size=64, seq_len=8)
LLAMA = GPTConfig(n_layers=2, d_model=32, n_heads=8, n_kv_heads=4, vocab_size=64, seq_len=8, block="llama")
BATCH = 3


def _cluster(n: int) -> Cluster:
    link = Link(bandwidth_gb_s=1.0, latency_us=20)
    return Cluster.emulated(gpus_per_node=n, intra_node=link, inter_node=link)


def _case(config: GPTConfig, vocab: bool, checkpointing: bool = False) -> dict:
    stats = TPStats()
    model = sequence_parallel(tensor_parallel(seeded_model(config, checkpointing=checkpointing)), None, stats)
    if vocab:
        vocab_parallel(model, None)
    x, y = synthetic_batch(config, BATCH)
    loss = model(x, y)
    forward = stats.bytes
    loss.backward()
    return {
        "rank": dist.get_rank(),
        "loss": loss.item(),
        "forward_bytes": forward,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "blocks": {type(b).__name__ for b in model.blocks},
    }


def _worker() -> dict:
    return {
        "gpt2": _case(GPT2, vocab=False),
        "gpt2_vocab_ckpt": _case(GPT2, vocab=True, checkpointing=True),
        "llama": _case(LLAMA, vocab=True),
    }


def _reference(config: GPTConfig) -> tuple[float, dict]:
    model = seeded_model(config)
    x, y = synthetic_batch(config, BATCH)
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_matches_one_process(world):
    results = launch(_worker, world_size=world, cluster=_cluster(world), timeout_s=60, deadline_s=120)
    for kind, config, vocab in (
        ("gpt2", GPT2, False), ("gpt2_vocab_ckpt", GPT2, True), ("llama", LLAMA, True)
    ):
        loss, grads = _reference(config)
        for res in results:
            case = res[kind]
            assert case["blocks"] == {"SequenceParallelBlock"}
            assert case["loss"] == pytest.approx(loss, abs=1e-5)
            want = shard_state(grads, config, case["rank"], world, vocab=vocab)
            for name, grad in case["grads"].items():
                torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=0, msg=f"{kind} {name}")
    # Forward, per block: two all-gathers of the whole (batch, seq, d_model) and two reduce-scatters of it,
    # plus the last block's gather back: an all-reduce's bytes (reduce-scatter + all-gather) per f and g.
    whole = BATCH * GPT2.seq_len * GPT2.d_model * 4
    assert results[0]["gpt2"]["forward_bytes"] == (4 * GPT2.n_layers + 1) * whole


def test_sequence_parallel_needs_tensor_parallel_blocks():
    with pytest.raises(ValueError, match="call tensor_parallel"):
        sequence_parallel(seeded_model(GPT2))


MEMORY = GPTConfig(n_layers=4, d_model=256, n_heads=8, vocab_size=256, seq_len=128)


def _saved_bytes(sp: bool) -> int:
    """What the forward pass leaves alive for backward (the barrier first lets every collective finish, so
    that no buffer the emulated group still holds is counted)."""
    from labkit.machine import device_memory

    model = tensor_parallel(seeded_model(MEMORY))
    if sp:
        sequence_parallel(model)
    x, y = synthetic_batch(MEMORY, 4)
    with device_memory.tracked():
        start = device_memory.memory_allocated()
        loss = model(x, y)
        dist.barrier()
        saved = device_memory.memory_allocated() - start
    loss.backward()
    return saved


def test_what_sequence_parallelism_saves_is_what_the_memory_estimate_says():
    """On 2 emulated ranks, what forward saves for backward shrinks by the residual stream's, the norms'
    inputs' and statistics' share, as labkit.memory.estimate(sequence_parallel=True) counts it (2,113,536
    bytes here)."""
    from labkit.memory import estimate

    cluster = _cluster(2)
    tp_only, with_sp = (launch(_saved_bytes, sp, world_size=2, cluster=cluster) for sp in (False, True))
    kwargs = {"model": MEMORY, "tp": 2, "micro_batch": 4, "precision": "fp32"}
    predicted = estimate(**kwargs).activations - estimate(**kwargs, sequence_parallel=True).activations
    assert predicted > 0
    assert [a - b for a, b in zip(tp_only, with_sp)] == [predicted, predicted]
