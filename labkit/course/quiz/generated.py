"""Numeric questions generated from labkit's own formulas, with fresh parameters every time.

Each generator takes a `random.Random` and returns a `labkit.course.quiz.question.Question` whose answer is
computed by the same function the labs use (`labkit.memory.estimate`, `labkit.pipeline_plan.bubble_fraction`,
`labkit.links.collective_time_s` and `bus_bandwidth_factor`, `labkit.batch.accumulation_steps`,
`labkit.memory.korthikanti_activation_bytes`, `labkit.planner.tp_comm_s`), so the answers are right by
construction and a learner cannot memorise them. Sizes are drawn from published or common values."""

from __future__ import annotations

import random

from labkit.batch import accumulation_steps
from labkit.course.quiz.question import Question
from labkit.links import Link, bus_bandwidth_factor, collective_time_s
from labkit.memory import estimate, korthikanti_activation_bytes
from labkit.models import GPTConfig
from labkit.pipeline_plan import bubble_fraction
from labkit.planner import tp_comm_s

__all__ = ["GENERATORS"]

_GIB = 2**30


def model_states(rng: random.Random) -> Question:

    billions = rng.choice([1.3, 3, 7, 13, 30, 70])
    stage = rng.choice([0, 1, 2, 3])
    gpus = rng.choice([8, 16, 64, 256])
    m = estimate(params=int(billions * 1e9), dp=gpus, zero_stage=stage, precision="mixed", optimizer="adam")
    gib = (m.params + m.grads + m.optimizer) / _GIB
    return Question(
        "memory-gen-zero",
        "memory",
        "numeric",
        f"A {billions:g}-billion-parameter model is trained with mixed-precision Adam (16 bytes of model "
        f"states per parameter: 2 weights + 2 gradients + 12 optimizer) and ZeRO stage {stage} over {gpus} "
        "data-parallel GPUs. How many GiB of model states does each GPU hold (weights, gradients, "
        "optimizer; no activations)?",
        gib,
        f"ZeRO-{stage} shards "
        f"{['nothing', 'the optimizer states', 'the optimizer states and gradients', 'all three'][stage]} "
        f"over the {gpus} GPUs: {m.params / _GIB:.2f} + {m.grads / _GIB:.2f} + {m.optimizer / _GIB:.2f} GiB "
        "(Rajbhandari et al. 2020, Figure 1).",
        "02_oom_batch",
        "2 · Explain",
        unit="GiB",
        params={"billions": billions, "zero_stage": stage, "gpus": gpus},
    )


def bubble(rng: random.Random) -> Question:

    p = rng.choice([2, 4, 8])
    m = rng.choice([k for k in (4, 8, 16, 32) if k >= p])
    value = 100 * bubble_fraction(p, m)
    return Question(
        "pipeline-gen-bubble",
        "pipeline",
        "numeric",
        f"A pipeline of {p} equal stages runs 1F1B with {m} micro-batches per step. What percentage of the "
        "whole step (busy and idle time together) does each stage spend idle in the bubble?",
        value,
        f"(p - 1) / (m + p - 1) = {p - 1}/{m + p - 1} = {value:.1f} % of the step (Huang et al. 2019; 1F1B "
        "has the same bubble as GPipe, Narayanan et al. 2021). Megatron-LM's papers quote the same bubble as "
        f"(p - 1) / m = {100 * (p - 1) / m:.1f} % of the ideal, bubble-free time instead: another "
        "denominator, not another bubble.",
        "04_imbalanced_pipeline",
        "4 · Fix, part 1",
        unit="%",
        params={"p": p, "m": m},
    )


def ring_all_reduce(rng: random.Random) -> Question:

    mib = rng.choice([64, 256, 1024])
    n = rng.choice([4, 8, 16])
    bw = rng.choice([25, 50, 450])
    ms = collective_time_s("all_reduce", mib * 2**20, n, Link(bw, 0.0)) * 1e3
    return Question(
        "cluster-gen-ring",
        "cluster",
        "numeric",
        f"A ring all-reduce of {mib} MiB runs over {n} GPUs whose links give {bw} GB/s per direction (1 GB = "
        "1e9 bytes); ignore latency. How many milliseconds does it take?",
        ms,
        f"2(n - 1) steps each move nbytes/n: 2 x {n - 1} x {mib} MiB / {n} / {bw} GB/s = {ms:.2f} ms (Thakur "
        "et al. 2005).",
        "00_cluster_tour",
        "3 · How fast",
        unit="ms",
        params={"mib": mib, "n": n, "bw": bw},
    )


def bus_bandwidth(rng: random.Random) -> Question:

    n = rng.choice([2, 4, 8, 16])
    algbw = rng.choice([100, 150, 200, 240])
    value = algbw * bus_bandwidth_factor("all_reduce", n)
    return Question(
        "cluster-gen-busbw",
        "cluster",
        "numeric",
        f"nccl-tests reports an all-reduce algorithm bandwidth (size / time) of {algbw} GB/s on {n} GPUs. "
        "What bus bandwidth does it report next to it, in GB/s?",
        value,
        f"busbw = algbw x 2(n - 1)/n = {algbw} x {2 * (n - 1)}/{n} = {value:.1f} GB/s, comparable with the "
        "link's speed (nccl-tests doc/PERFORMANCE.md).",
        "00_cluster_tour",
        "3 · How fast",
        unit="GB/s",
        params={"n": n, "algbw": algbw},
    )


def accumulation(rng: random.Random) -> Question:

    ranks = rng.choice([4, 8, 16, 32])
    micro = rng.choice([1, 2, 4, 8])
    steps = rng.choice([2, 4, 8, 16])
    global_batch = ranks * micro * steps
    value = accumulation_steps(global_batch, micro, ranks)
    return Question(
        "memory-gen-accumulation",
        "memory",
        "numeric",
        f"A global batch of {global_batch} sequences is trained on {ranks} data-parallel GPUs whose largest "
        f"micro-batch that fits is {micro} sequences. How many micro-batches does each GPU accumulate per "
        "optimizer step?",
        value,
        f"global batch = micro-batch x accumulation steps x ranks: {global_batch} / ({micro} x {ranks}) = "
        f"{value}.",
        "02_oom_batch",
        "3 · Fix 1",
        unit="micro-batches",
        tolerance=0.0,
        params={"global_batch": global_batch, "micro": micro, "ranks": ranks},
    )


def activations(rng: random.Random) -> Question:

    s, h, a = rng.choice([(2048, 4096, 32), (2048, 8192, 64), (4096, 5120, 40)])
    b = rng.choice([1, 2, 4])
    t = rng.choice([1, 2, 4, 8])
    gib = korthikanti_activation_bytes(s, b, h, a, 1, tp=t) / _GIB
    return Question(
        "memory-gen-activations",
        "memory",
        "numeric",
        "Per Korthikanti et al. 2022 (16-bit activations, dropout, attention scores stored), how many GiB "
        f"of activations does one transformer layer keep for sequence {s}, micro-batch {b}, hidden size {h}, "
        f"{a} heads, with tensor parallelism t = {t} (no sequence parallelism)?",
        gib,
        f"s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes = {gib:.3f} GiB (Korthikanti et al. 2022, Table 2).",
        "02_oom_batch",
        "2 · Explain",
        unit="GiB",
        params={"s": s, "b": b, "h": h, "a": a, "t": t},
    )


def tensor_parallel_comm(rng: random.Random) -> Question:

    h = rng.choice([1024, 2048, 4096])
    layers = rng.choice([12, 24, 32])
    mb, seq = rng.choice([1, 2, 4]), rng.choice([1024, 2048])
    tp = rng.choice([2, 4, 8])
    # line rates per direction: NVLink 4 is 18 links x 25 GB/s (H100 datasheet), NDR InfiniBand 400 Gb/s
    where, link = rng.choice(
        [
            ("NVLink 4 (H100), whose line rate is 450 GB/s", Link(450.0, 0.0)),
            ("NDR InfiniBand, whose line rate is 50 GB/s", Link(50.0, 0.0)),
        ]
    )
    config = GPTConfig(n_layers=layers, d_model=h, n_heads=16, vocab_size=32000, seq_len=seq)
    ms = tp_comm_s(config, mb, tp, link, precision="mixed") * 1e3
    # The line rate is a bound, not what NCCL reaches: on NVLink 4 its ring gets ~370 GB/s of bus bandwidth
    # (NCCL's maintainer, nccl-tests issue 212), and every all-reduce also pays NCCL's fixed latency.
    nvlink = link.bandwidth_gb_s == 450.0
    reached = " (NCCL's ring reaches ~370 of its 450 GB/s, nccl-tests issue 212)" if nvlink else ""
    return Question(
        "parallelism-gen-tp",
        "parallelism",
        "numeric",
        f"Megatron tensor parallelism of size {tp} over {where} per direction, a {layers}-layer model of "
        f"hidden size {h}, micro-batch {mb} of {seq} tokens, 16-bit activations. At the line rate and "
        "ignoring latency, how many milliseconds of all-reduces does one micro-batch's forward and backward "
        "need?",
        ms,
        f"4 all-reduces per layer (2 forward, 2 backward) of {mb} x {seq} x {h} x 2 bytes, each 2(t - 1)/t "
        f"of it over the link: {ms:.2f} ms (Shoeybi et al. 2019). A lower bound: no all-reduce reaches the "
        f"line rate{reached}, and each pays a fixed latency as well (NCCL's src/graph/tuning.cc; lab 00).",
        "01_parallelism_choice",
        "2 · Mistake two",
        unit="ms",
        params={"h": h, "layers": layers, "mb": mb, "seq": seq, "tp": tp, "bw": link.bandwidth_gb_s},
    )


GENERATORS = [
    model_states,
    bubble,
    ring_all_reduce,
    bus_bandwidth,
    accumulation,
    activations,
    tensor_parallel_comm,
]
