"""labkit.parallel.tensor: a Megatron-split GPT on 2 and 4 emulated ranks gives one process's loss, logits and
gradients (plain and grouped-query attention, one TP group and two TP groups side by side), with exactly two
all-reduces per block forward and two backward; each section of a weight is sharded on its own. The sizes that
work (`check_tp_size`): tests/test_models.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit import Cluster, launch
from labkit.links import Link
from labkit.models import GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.tensor import TPStats, shard, shard_state, tensor_parallel

pytestmark = pytest.mark.usefixtures("one_thread")

MHA = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8)
GQA = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8, n_kv_heads=2)
GQA8 = GPTConfig(n_layers=2, d_model=32, n_heads=8, vocab_size=64, seq_len=8, n_kv_heads=4)
# Llama's block: RMSNorm, rotary positions, SwiGLU (gate and up fused in mlp.fc), no biases
LLAMA = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8, n_kv_heads=2, block="llama")
BATCH = 3


def _cluster(n: int) -> Cluster:
    link = Link(bandwidth_gb_s=1.0, latency_us=20)
    return Cluster.emulated(gpus_per_node=n, intra_node=link, inter_node=link)


def _step(model: nn.Module, config: GPTConfig, seed: int) -> tuple[float, torch.Tensor, dict]:
    """One forward (logits and loss from the same pass) and backward; the gradients by name."""
    x, y = synthetic_batch(config, BATCH, seed=seed)
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, config.vocab_size), y.view(-1))
    loss.backward()
    return loss.item(), logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _tp_case(config: GPTConfig, group: dist.ProcessGroup | None, seed: int = 0) -> dict:
    """On a rank: convert the seeded model over `group`, run one step, return what to compare."""
    stats = TPStats()
    model = tensor_parallel(seeded_model(config), group, stats)
    x, y = synthetic_batch(config, BATCH, seed=seed)
    logits = model(x)
    forward = (stats.all_reduces, stats.bytes)
    loss = F.cross_entropy(logits.view(-1, config.vocab_size), y.view(-1))
    loss.backward()
    backward = (stats.all_reduces - forward[0], stats.bytes - forward[1])
    return {
        "rank": dist.get_rank(group),
        "tp": dist.get_world_size(group),
        "loss": loss.item(),
        "logits": logits.detach(),
        "forward": forward,
        "backward": backward,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "block_types": {type(b).__name__ for b in model.blocks},
    }


def worker_two_ranks() -> dict:
    return {"mha": _tp_case(MHA, None), "gqa": _tp_case(GQA, None), "llama": _tp_case(LLAMA, None)}


def worker_four_ranks() -> dict:
    # Every rank creates every group, in the same order (torch.distributed's rule for new_group).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = dist.get_rank() // 2
    return {
        "mha": _tp_case(MHA, None),
        "gqa8": _tp_case(GQA8, None),
        "2d": dict(_tp_case(MHA, pairs[pair], seed=pair), pair=pair),
    }


def _check_against_one_process(case: dict, config: GPTConfig, seed: int = 0) -> None:
    loss, logits, grads = _step(seeded_model(config), config, seed)
    assert case["block_types"] == {"TensorParallelBlock"}
    assert case["loss"] == pytest.approx(loss, abs=1e-5)
    torch.testing.assert_close(case["logits"], logits, atol=1e-5, rtol=0)
    assert case["grads"].keys() == grads.keys()  # the same parameter names as the full model
    expected = shard_state(grads, config, case["rank"], case["tp"])
    for name, grad in case["grads"].items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=0, msg=name)
    # two all-reduces per block each way, each of one (batch, seq, d_model) fp32 activation
    per_direction = (2 * config.n_layers, 2 * config.n_layers * BATCH * config.seq_len * config.d_model * 4)
    assert case["forward"] == per_direction and case["backward"] == per_direction


def _check_qkv_layout(case: dict, config: GPTConfig) -> None:
    """Written out by hand (not through shard): rank r of t holds its own rows of q, of k and of v."""
    full = seeded_model(config).blocks[0].attn.qkv.weight.detach()
    d, kv, r, t = config.d_model, config.kv_heads * config.head_dim, case["rank"], case["tp"]
    rows = [
        *range(r * d // t, (r + 1) * d // t),
        *range(d + r * kv // t, d + (r + 1) * kv // t),
        *range(d + kv + r * kv // t, d + kv + (r + 1) * kv // t),
    ]
    torch.testing.assert_close(case["params"]["blocks.0.attn.qkv.weight"], full[rows], atol=0, rtol=0)
    fc = seeded_model(config).blocks[1].mlp.proj.weight.detach()  # row-parallel: its input columns
    f = config.ffn_dim
    torch.testing.assert_close(
        case["params"]["blocks.1.mlp.proj.weight"], fc[:, r * f // t : (r + 1) * f // t]
    )


def _check_swiglu_layout(case: dict, config: GPTConfig) -> None:
    """Rank r of t holds its own columns of the gate and of the up matrix (so silu(gate) * up is local)."""
    full = seeded_model(config).blocks[0].mlp.fc.weight.detach()
    f, r, t = config.ffn_dim, case["rank"], case["tp"]
    rows = [*range(r * f // t, (r + 1) * f // t), *range(f + r * f // t, f + (r + 1) * f // t)]
    torch.testing.assert_close(case["params"]["blocks.0.mlp.fc.weight"], full[rows], atol=0, rtol=0)


def test_two_ranks_match_one_process_with_and_without_grouped_query_attention():
    results = launch(worker_two_ranks, world_size=2, cluster=_cluster(2), timeout_s=60, deadline_s=120)
    for rank, res in enumerate(results):
        assert res["mha"]["rank"] == rank and res["mha"]["tp"] == 2
        _check_against_one_process(res["mha"], MHA)
        _check_against_one_process(res["gqa"], GQA)
        _check_qkv_layout(res["gqa"], GQA)
        _check_against_one_process(res["llama"], LLAMA)
        _check_swiglu_layout(res["llama"], LLAMA)
    # the sharded weights differ between the ranks; the replicated ones do not
    a, b = (res["mha"]["params"] for res in results)
    assert not torch.equal(a["blocks.0.mlp.fc.weight"], b["blocks.0.mlp.fc.weight"])
    assert torch.equal(a["blocks.0.mlp.proj.bias"], b["blocks.0.mlp.proj.bias"])


def test_four_ranks_and_two_tp_groups_side_by_side_match_their_own_reference():
    results = launch(worker_four_ranks, world_size=4, cluster=_cluster(4), timeout_s=60, deadline_s=120)
    for rank, res in enumerate(results):
        _check_against_one_process(res["mha"], MHA)
        _check_against_one_process(res["gqa8"], GQA8)
        _check_qkv_layout(res["gqa8"], GQA8)
        two_d = res["2d"]
        assert (two_d["pair"], two_d["rank"], two_d["tp"]) == (rank // 2, rank % 2, 2)
        _check_against_one_process(two_d, MHA, seed=two_d["pair"])
    # each pair trained on its own batch: their losses differ
    assert results[0]["2d"]["loss"] != pytest.approx(results[2]["2d"]["loss"], abs=1e-4)


def test_tensor_parallel_needs_a_gpt():
    with pytest.raises(ValueError, match=r"needs a labkit\.models\.GPT, got Linear"):
        tensor_parallel(nn.Linear(2, 2))


def test_shard_splits_each_section_on_its_own():
    full = torch.arange(12).view(12, 1)
    assert shard(full, 1, 2).flatten().tolist() == [6, 7, 8, 9, 10, 11]
    assert shard(full, 1, 2, sections=[8, 2, 2]).flatten().tolist() == [4, 5, 6, 7, 9, 11]
    assert shard(full.T, 0, 3, dim=1).tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="tp=4 does not divide a section of 2"):
        shard(full, 0, 4, sections=[8, 2, 2])
