"""labkit.parallel.vocab: the embedding, LM head and loss split along the vocabulary (with the blocks split
by tensor_parallel) give one process's loss and gradients on 2 and 4 emulated ranks, tied and untied, with
the all-reduces Megatron-LM's split costs: one embedding sum forward, the head input's gradient backward,
and three numbers per token for the loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit import Cluster, launch
from labkit.links import Link
from labkit.models import GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.tensor import TPStats, shard_state, tensor_parallel
from labkit.parallel.vocab import VocabParallelCrossEntropy, check_vocab_size, vocab_parallel

pytestmark = pytest.mark.usefixtures("one_thread")

UNTIED = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8)
TIED = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8, tie_embeddings=True)
BATCH = 3


def _cluster(n: int) -> Cluster:
    link = Link(bandwidth_gb_s=1.0, latency_us=20)
    return Cluster.emulated(gpus_per_node=n, intra_node=link, inter_node=link)


def _case(config: GPTConfig) -> dict:
    stats = TPStats()
    model = vocab_parallel(tensor_parallel(seeded_model(config), None, stats), None, stats)
    x, y = synthetic_batch(config, BATCH)
    loss = model(x, y)
    forward = stats.all_reduces
    loss.backward()
    return {
        "rank": dist.get_rank(),
        "tp": dist.get_world_size(),
        "loss": loss.item(),
        "forward": forward,
        "backward": stats.all_reduces - forward,
        "logits_shape": tuple(model(x).shape),
        "tied": model.lm_head.weight is model.tok_emb.weight,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
    }


def _worker() -> dict:
    return {"untied": _case(UNTIED), "tied": _case(TIED)}


def _reference(config: GPTConfig) -> tuple[float, dict]:
    model = seeded_model(config)
    x, y = synthetic_batch(config, BATCH)
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_split_vocabulary_matches_one_process(world):
    results = launch(_worker, world_size=world, cluster=_cluster(world), timeout_s=60, deadline_s=120)
    for kind, config in (("untied", UNTIED), ("tied", TIED)):
        loss, grads = _reference(config)
        for res in results:
            case = res[kind]
            assert case["loss"] == pytest.approx(loss, abs=1e-5)
            assert case["logits_shape"] == (BATCH, config.seq_len, config.vocab_size // world)
            assert case["tied"] == config.tie_embeddings
            want = shard_state(grads, config, case["rank"], world, vocab=True)
            assert case["grads"].keys() == want.keys()
            for name, grad in case["grads"].items():
                torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=0, msg=f"{kind} {name}")
            # the blocks' 2 per block each way, plus the embedding's sum and the loss's three forward, and
            # the head input's gradient backward
            blocks = 2 * config.n_layers
            assert (case["forward"], case["backward"]) == (blocks + 1 + 3, blocks + 1)


def _loss_on_slices(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    rank, tp = dist.get_rank(), dist.get_world_size()
    n = logits.shape[-1] // tp
    mine = logits[:, rank * n : (rank + 1) * n].clone().requires_grad_()
    loss = VocabParallelCrossEntropy(logits.shape[-1], None)(mine, targets)
    loss.backward()
    return loss.item(), mine.grad


def test_the_split_loss_is_torchs_cross_entropy_even_for_large_logits():
    torch.manual_seed(0)
    logits = torch.randn(16, 12) * 30 + 100  # exp(130) overflows fp32 without the maximum subtracted
    targets = torch.randint(0, 12, (16,))
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, targets)
    want.backward()
    results = launch(_loss_on_slices, logits, targets, world_size=3, cluster=_cluster(3), timeout_s=60)
    for rank, (loss, grad) in enumerate(results):
        assert loss == pytest.approx(want.item(), rel=1e-6)
        torch.testing.assert_close(grad, full.grad[:, rank * 4 : (rank + 1) * 4], atol=1e-6, rtol=0)


def test_a_vocabulary_that_does_not_split_is_refused_with_the_padding_to_use():
    with pytest.raises(ValueError, match="vocab_size divisible by 3, got 64: pad the vocabulary to 66"):
        check_vocab_size(64, 3)
