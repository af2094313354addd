"""Lab 01's exercise checks: the tensor-parallel all-reduce time against `labkit.planner.tp_comm_s`, and the
learner's layout choice against the plan; their hints name the mistake made."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from labkit.links import Link, collective_time_s
from labkit.models import GPTConfig
from labkit.planner import tp_comm_s

__all__ = ["check_layout_choice", "check_tp_comm"]


def check_tp_comm(fn: Callable[..., float]) -> None:
    """Lab 01: `fn(config, micro_batch, tp, link)` gives the ms of tensor-parallel all-reduces for one
    micro-batch through every block (`labkit.planner.tp_comm_s`, without checkpointing, fp32)."""

    nvlink, ib = Link(450.0, 5.0, "NVLink"), Link(50.0, 10.0, "InfiniBand")
    cases = [
        (GPTConfig(n_layers=8, d_model=512, n_heads=8, vocab_size=1024, seq_len=256), 4, 4, ib),
        (GPTConfig(n_layers=24, d_model=2048, n_heads=16, vocab_size=1024, seq_len=1024), 2, 8, nvlink),
        (GPTConfig(n_layers=4, d_model=512, n_heads=8, vocab_size=256, seq_len=256), 1, 2, ib),
    ]
    for config, mb, tp, link in cases:
        want = tp_comm_s(config, mb, tp, link) * 1e3
        got = fn(config, mb, tp, link)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise AssertionError(f"return a number of milliseconds, not {got!r}")
        where = (
            f"{config.n_layers} blocks, d_model {config.d_model}, seq {config.seq_len}, micro-batch {mb}, "
            f"tp={tp} over {link.name} ({link.bandwidth_gb_s:g} GB/s, {link.latency_us:g} µs)"
        )
        if math.isclose(got, want, rel_tol=0.02):
            continue
        nbytes = mb * config.seq_len * config.d_model * 4
        shard = config.n_layers * 4 * collective_time_s("all_reduce", nbytes // tp, tp, link) * 1e3
        ratio = got / want if want else math.inf
        if math.isclose(ratio, 0.5, rel_tol=0.05):
            raise AssertionError(
                f"{where}: you gave {got:.3f} ms, half of {want:.3f} ms. You counted the forward's "
                "two all-reduces per block (g); backward has two more (f's gradient before attention "
                "and before the MLP): 4 per block."
            )
        if math.isclose(got, shard, rel_tol=0.05) or math.isclose(ratio, 1 / tp, rel_tol=0.05):
            raise AssertionError(
                f"{where}: you gave {got:.3f} ms for {want:.3f} ms, as if each rank all-reduced a 1/tp "
                "shard. The tensor each rank all-reduces is the whole activation (micro_batch x seq x "
                "d_model), not a 1/tp shard: each rank holds a partial sum of all of it."
            )
        if math.isclose(ratio, 1 / config.n_layers, rel_tol=0.05):
            raise AssertionError(
                f"{where}: you gave {got:.3f} ms, one block's worth of {want:.3f} ms: multiply by "
                f"the {config.n_layers} blocks."
            )
        raise AssertionError(
            f"{where}: you gave {got:.3f} ms, expected {want:.3f} ms. Per block: 4 all-reduces of "
            "micro_batch x seq x d_model x 4 bytes (fp32), each "
            "labkit.links.collective_time_s('all_reduce', nbytes, tp, link) seconds."
        )
    if fn(cases[0][0], 4, 1, nvlink) != 0:
        raise AssertionError("with tp=1 there is no tensor parallelism and nothing to all-reduce: return 0")


def check_layout_choice(layout: Any, reason: str, plan: Any) -> Any:
    """Lab 01: `layout` = (dp, tp, pp) is a layout of `plan` that divides, fits, keeps tp inside a node and is
    within 10 % of the fastest prediction; `reason` quotes its predicted ms and its memory per GPU in MiB
    (each within 5 %). Returns the layout's `labkit.planner.Candidate`."""

    if not (isinstance(layout, tuple) and len(layout) == 3 and all(isinstance(v, int) for v in layout)):
        raise AssertionError(
            f"my_layout={layout!r}: give a tuple of three whole numbers (dp, tp, pp), e.g. (2, 1, 4)"
        )
    dp, tp, pp = layout
    world = plan.cluster.world_size
    if dp * tp * pp != world:
        raise AssertionError(
            f"my_layout={layout}: dp x tp x pp = {dp * tp * pp}, but the cluster has {world} GPUs; "
            f"every GPU holds one (dp, tp, pp) coordinate, so the product must be {world}"
        )
    chosen, best = plan.candidate(dp, tp, pp), plan.best
    if chosen.reason.startswith("does not fit"):
        raise AssertionError(
            f"{chosen.layout} {chosen.reason}. With dp={dp} each replica holds 1/{tp * pp} of the "
            "model's weights, gradients and Adam states: more model parallelism (tp or pp) shrinks "
            "them, more data parallelism does not."
        )
    if chosen.reason.startswith("tp group crosses nodes"):
        raise AssertionError(f"{chosen.layout}: {chosen.reason}.")
    if not chosen.ok:
        raise AssertionError(f"{chosen.layout}: {chosen.reason}")
    if chosen.predicted_ms > 1.10 * best.predicted_ms:
        terms = ", ".join(f"{k} {v:.0f}" for k, v in chosen.parts_ms.items() if v)
        raise AssertionError(
            f"{chosen.layout} fits, but is predicted at {chosen.predicted_ms:.1f} ms ({terms} ms), "
            f"more than 10 % above the fastest layout that fits ({best.layout}, "
            f"{best.predicted_ms:.1f} ms): read the table's terms and take the smallest total"
        )
    numbers = [float(v) for v in re.findall(r"\d+(?:\.\d+)?", reason or "")]
    mib = chosen.memory.peak / 2**20
    for what, value, unit in (("predicted step", chosen.predicted_ms, "ms"), ("memory per GPU", mib, "MiB")):
        if not any(math.isclose(v, value, rel_tol=0.05) for v in numbers):
            raise AssertionError(
                f"my_reason={reason!r} does not quote the planner's {what} for {chosen.layout} "
                f"({value:.1f} {unit}): explain the choice with the plan's numbers"
            )
    return chosen
