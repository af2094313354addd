"""Exercise checks: each names the mistake a learner actually made, not one general hint.

A check runs after an exercise cell; on a wrong answer it raises `AssertionError` whose message
says what was found, what it means and what to change. Checks that need ranks launch them with a
deadline, so a livelock ends in seconds. The reference answers are in `labkit.parallel` and the
solution notebooks; `tests/test_exercise_mistakes.py` runs the plausible wrong answers through them.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "check_accumulation",
    "check_balance",
    "check_find_straggler",
    "check_layout_choice",
    "check_overlapped_ddp",
    "check_sum_over_ranks",
    "check_tp_comm",
    "drive_hooks_shuffled",
]


def check_sum_over_ranks(results: list[Any], world_size: int) -> float:
    """Lab 00: every rank returned a tensor holding 1 + 2 + ... + n everywhere; returns that sum."""
    expected = world_size * (world_size + 1) / 2
    for rank, t in enumerate(results):
        if t is None:
            raise AssertionError(
                f"rank {rank} returned None: dist.all_reduce(t) changes t in place and returns None (or a work "
                "object with async_op=True). Call it without assigning its result (dist.all_reduce(t)), then "
                "return t."
            )
        if not isinstance(t, torch.Tensor):
            raise AssertionError(
                f"rank {rank} returned {type(t).__name__} {t!r}: return the tensor t itself."
            )
        if torch.all(t == expected):
            continue
        if torch.allclose(t, torch.full_like(t, expected / world_size)):
            raise AssertionError(
                f"rank {rank} holds {expected / world_size:g} = the sum divided by world_size: the exercise asks "
                "for the SUM over ranks (dist.all_reduce's default op); do not divide it."
            )
        if torch.all(t == rank + 1):
            raise AssertionError(
                f"rank {rank} still holds its own value {rank + 1}: nothing was reduced. Call dist.all_reduce(t) "
                "before returning t."
            )
        raise AssertionError(
            f"rank {rank} holds {t.tolist()}, expected {expected:g} everywhere "
            f"(1 + ... + {world_size}); use dist.all_reduce(t) with the default op, SUM."
        )
    return expected


class _OutOfOrder(Exception):
    """A bucket was flushed out of index order (raised before its collective is issued)."""


def drive_hooks_shuffled(ddp_class: type, bucket_cap_mb: float = 0.002, seed: int = 0) -> dict[str, Any]:
    """On a rank: call a DDP class's gradient hook for every parameter in a shuffled order.

    Gradients are set by hand (rank + 1 everywhere), so the expected average is known; the
    order is the same on every rank (one seed), as a backward whose gradients come out of order
    would be. Returns the order buckets were flushed in, the bucket count and the gradients'
    distinct values after `finish_gradient_synchronization()`.
    """
    from labkit.experiments.common import seeded_model
    from labkit.models import GPTConfig

    model = seeded_model(GPTConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8), seed)
    ddp = ddp_class(model, bucket_cap_mb=bucket_cap_mb)
    flushed: list[int] = []
    flush = ddp._flush

    def recorded_flush(bucket: Any) -> None:  # record; stop before a wrong flush issues its collective
        flushed.append(bucket.index)
        if flushed != list(range(len(flushed))):
            raise _OutOfOrder(flushed)
        flush(bucket)

    ddp._flush = recorded_flush
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    values: list[float] = []  # stays empty when a flush came out of order
    try:
        for p in random.Random(seed).sample(params, len(params)):
            ddp._on_grad_ready(p)
        ddp.finish_gradient_synchronization()
        values = sorted({round(v, 6) for p in params for v in p.grad.unique().tolist()})
    except _OutOfOrder:
        pass
    return {"flushed": flushed, "buckets": len(ddp.buckets), "values": values, "rank": dist.get_rank()}


def check_overlapped_ddp(results: list[dict[str, Any]], world_size: int) -> None:
    """Lab 03: buckets flushed once each, in index order, and gradients averaged exactly once."""
    expected = (world_size + 1) / 2  # the mean of 1 .. world_size
    for r in results:
        k, flushed = r["buckets"], r["flushed"]
        again = [b for i, b in enumerate(flushed) if b in flushed[:i]]
        if again:
            raise AssertionError(
                f"rank {r['rank']}: bucket {again[0]} was flushed again (order {flushed}): flush each bucket once, "
                "and advance self._next_bucket after each flush."
            )
        if flushed != list(range(k)):
            raise AssertionError(
                f"rank {r['rank']} flushed buckets in the order {flushed}{'...' if len(flushed) < k else ''}, not 0, "
                f"1, ..., {k - 1}, with the hooks "
                "called in a shuffled order. Flush buckets in index order, never as they fill up: only "
                "self.buckets[self._next_bucket], once it is complete, then the next index while buckets are complete."
            )
        if r["values"] == [expected]:
            continue
        if r["values"] == [expected / world_size]:
            raise AssertionError(
                f"the gradients came out as {expected / world_size:g} instead of the mean {expected:g}: they were "
                "divided by the world size twice. finish_gradient_synchronization() already divides the "
                "all-reduced sum by world_size; in _flush copy the gradients as they are."
            )
        if r["values"] == [float(r["rank"] + 1)]:
            raise AssertionError(
                "the gradients are unchanged after finish_gradient_synchronization(): the buffer was not "
                "all-reduced, or did not receive the gradients. In _flush copy each p.grad into bucket.buffer at "
                "its offset, then dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)."
            )
        raise AssertionError(
            f"rank {r['rank']}: gradients {r['values'][:4]} after synchronisation, expected {expected:g} everywhere; "
            "check that every parameter's gradient lands at its own offset (zip bucket.params, bucket.offsets)."
        )


def _scaled(g: torch.Tensor, ref: torch.Tensor, factor: float) -> bool:
    return torch.allclose(g, ref * factor, rtol=1e-4, atol=1e-6)


def check_accumulation(results: list[Any], reference: torch.Tensor, steps: int) -> float:
    """Lab 02: accumulated gradients equal the big batch's, with one all-reduce per bucket per optimizer
    step; `results` are `dp_train` results (`return_grads=True`). Returns the largest gradient error."""
    error = max((r.grads - reference).abs().max().item() for r in results)
    r0 = results[0]
    if r0.allreduce_calls == 0:
        raise AssertionError(
            "no all-reduce in the optimizer step: every backward ran inside no_sync(), so each rank kept only its "
            "own gradients. Run the last micro-batch outside `with ddp.no_sync():`; its backward all-reduces the "
            "accumulated sum."
        )
    if error >= 1e-5:
        g = results[0].grads
        if steps > 1 and _scaled(g, reference, (steps - 1) / steps):
            raise AssertionError(
                f"the gradients are {steps - 1}/{steps} of the big batch's: one micro-batch is missing. Run forward "
                "and backward for every (x, y) in batches, the last one included (outside no_sync)."
            )
        if _scaled(g, reference, steps):
            raise AssertionError(
                f"the gradients are {steps}x the big batch's: divide each micro-batch's loss by len(batches) "
                "before backward, so that the sum over micro-steps is the mean."
            )
        raise AssertionError(
            f"gradients differ from the big batch's by {error:.2e}: divide every micro-batch loss by "
            "len(batches) and run backward for every micro-batch, the last one outside no_sync."
        )
    if r0.allreduce_calls != r0.buckets:
        raise AssertionError(
            f"{r0.allreduce_calls} all-reduces for {r0.buckets} buckets in one optimizer step: DDP all-reduced on "
            "every micro-step. Every micro-batch but the last must run inside `with ddp.no_sync():`, its forward "
            "as well as its backward (DDP decides in forward whether the next backward synchronises)."
        )
    return error


def _best_bottleneck(costs: Sequence[float], stages: int) -> float:
    """The cheapest most-expensive stage over every contiguous split (brute force: small inputs only)."""
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


# Cases chosen so that the usual wrong answers fail on at least one: a heavy last layer (a split by
# layer count loses), and costs where filling each stage up to the average (greedy) is not optimal.
_BALANCE_CASES = [
    ([8.0, 2, 2, 2, 2, 2, 2, 2, 2, 8.0], 4),
    ([1.0, 1, 1, 1, 1, 1, 1, 9.0], 2),
    ([3.0, 3, 2, 2, 2, 4], 3),
    ([1.0, 4, 1, 1, 4, 1], 3),
    ([5.0, 1, 1, 1, 1, 1, 5], 3),
    ([2.0, 7, 3, 1, 1, 6, 2], 4),
    ([1.0, 2, 3], 3),
    ([4.0, 1, 1], 1),
]


def check_balance(fn: Callable[[list[float], int], list[int]], seed: int = 0) -> int:
    """Lab 04: `fn(costs, stages)` returns the layers per stage of the contiguous split whose most expensive
    stage is cheapest (equal to brute force), and refuses impossible input. Returns the cases checked."""
    rng = random.Random(seed)
    cases = list(_BALANCE_CASES)
    for _ in range(30):
        n = rng.randint(2, 9)
        cases.append(([round(rng.uniform(0.5, 9.0), 2) for _ in range(n)], rng.randint(1, n)))
    for costs, stages in cases:
        got = fn(list(costs), stages)
        n = len(costs)
        if got is None:
            raise AssertionError(
                f"{fn.__name__}({costs}, {stages}) returned None: return the list of layers per stage"
            )
        got = list(got)
        if (
            len(got) == stages
            and all(isinstance(k, int) for k in got)
            and got == sorted(got)
            and got[-1] == n
            and (stages == 1 or got[0] > 0)
            and sum(got) != n
        ):
            raise AssertionError(
                f"{fn.__name__}({costs}, {stages}) returned {got}: these look like cut positions (where each stage "
                f"ends). Return how many layers each stage has, e.g. [2, 3] for cuts [2, 5]; they add up to {n}."
            )
        if len(got) != stages:
            raise AssertionError(
                f"{fn.__name__}({costs}, {stages}) returned {got}: one number per stage, {stages} "
                f"numbers, each the count of consecutive layers in that stage."
            )
        if any(not isinstance(k, int) or k < 1 for k in got) or sum(got) != n:
            raise AssertionError(
                f"{fn.__name__}({costs}, {stages}) returned {got}: every stage needs at least one layer and the "
                f"counts must add up to the {n} layers. In the dynamic programme, stage k can only end after "
                "layer k (leave one layer for each stage before it)."
            )
        best = _best_bottleneck(costs, stages)
        start, mine = 0, []
        for k in got:
            mine.append(sum(costs[start : start + k]))
            start += k
        if max(mine) > best + 1e-9:
            even = [n // stages + (1 if s < n % stages else 0) for s in range(stages)]
            why = (
                "that is the split by layer count, which ignores what the layers cost"
                if got == even
                else "filling each stage up to the average and moving on (greedy) is not optimal, since a cut decided "
                "early cannot be undone, and the quantity to minimise is the most expensive stage (a max, not a "
                "sum). Exactly: best[k][i] = min over j of max(best[k-1][j], cost of layers j..i-1)"
            )
            raise AssertionError(
                f"{fn.__name__}({costs}, {stages}) returned {got}, whose most expensive stage costs "
                f"{max(mine):g}; the best split's costs {best:g}: {why}."
            )
    for bad, what in (
        (([1.0, 2.0], 3), "more stages than layers"),
        (([1.0, 0.0, 2.0], 2), "a cost of 0"),
        (([1.0, -1.0], 1), "a negative cost"),
        (([1.0, float("nan")], 1), "a NaN cost"),
    ):
        try:
            got = fn(*bad)
        except ValueError:
            continue
        except Exception as exc:
            raise AssertionError(
                f"{fn.__name__}{bad} ({what}) raised {type(exc).__name__}: {exc}; raise ValueError "
                "with the value, the constraint and the fix"
            ) from exc
        raise AssertionError(
            f"{fn.__name__}{bad} ({what}) returned {got!r}: raise ValueError saying which value is "
            "wrong and what would be right (e.g. 'stages=3 is more than the 2 layers')"
        )
    return len(cases)


def _breakdown(rank: int, compute: float, step: float = 100.0) -> Any:
    from labkit.trace.analyze import RankBreakdown

    return RankBreakdown(
        rank=rank,
        source="test",
        steps=1,
        step_ms=step,
        compute_ms=compute,
        comm_ms=5.0,
        wait_ms=step - compute,
        exposed_comm_ms=5.0,
        data_ms=0.0,
        host_sync_ms=0.0,
        host_syncs=0,
        collectives=4,
        comm_bytes=2**20,
    )


def check_find_straggler(fn: Callable[[list[Any]], Any]) -> None:
    """Lab 05: `fn(breakdown)` returns (rank, ratio) for the rank that computes at least 1.25x the others'
    median while they wait at least 10 % of their step, else None (`labkit.trace.diagnose`'s rule)."""
    cases = [
        ([_breakdown(0, 90.0), _breakdown(1, 50.0)], 0),
        ([_breakdown(0, 50.0), _breakdown(1, 52.0), _breakdown(2, 49.0), _breakdown(3, 91.0)], 3),
        ([_breakdown(0, 60.0), _breakdown(1, 95.0), _breakdown(2, 61.0)], 1),
        ([_breakdown(0, 70.0), _breakdown(1, 72.0)], None),  # 3 % apart: noise, not a straggler
        ([_breakdown(0, 70.0), _breakdown(1, 80.0), _breakdown(2, 72.0)], None),  # 1.1x: below the threshold
    ]
    for breakdown, expected in cases:
        got = fn(breakdown)
        computes = {b.rank: b.compute_ms for b in breakdown}
        waits = {b.rank: b.wait_ms for b in breakdown}
        if expected is None:
            if got is not None:
                raise AssertionError(
                    f"compute per rank {computes} ms: you named {got!r}, but the ranks are within "
                    f"{max(computes.values()) / min(computes.values()):.2f}x of each other, which is noise on real "
                    "machines. Name a straggler only when it computes at least 1.25x the median of the other ranks "
                    "(and they wait for it); return None otherwise."
                )
            continue
        if got is None:
            raise AssertionError(
                f"compute per rank {computes} ms: rank {expected} is the straggler, but you "
                "returned None; compare each rank's compute_ms with the median of the others'."
            )
        if not isinstance(got, tuple) or len(got) != 2:
            raise AssertionError(f"return a pair (rank, ratio), not {got!r}")
        rank, ratio = got
        if rank == expected:
            others = sorted(c for r, c in computes.items() if r != expected)
            want = (
                computes[expected] / others[len(others) // 2]
                if len(others) % 2
                else computes[expected] / ((others[len(others) // 2 - 1] + others[len(others) // 2]) / 2)
            )
            if isinstance(ratio, (int, float)) and abs(ratio - 1) < 0.02:
                raise AssertionError(
                    f"the ratio is {ratio!r}: every rank's step_ms is the same in synchronous training (each waits for "
                    "the slowest), so step times cannot tell the ranks apart. Compare compute_ms instead."
                )
            if not isinstance(ratio, (int, float)) or abs(ratio - want) > 0.02 * want:
                raise AssertionError(
                    f"rank {rank} is right, but the ratio {ratio!r} is not its compute over the "
                    f"median of the other ranks' ({want:.2f})"
                )
            continue
        fastest = min(computes, key=computes.get)
        if rank == max(waits, key=waits.get) or rank == fastest:
            raise AssertionError(
                f"you named rank {rank}, which waits the most ({waits[rank]:.0f} ms): in synchronous training the "
                "fast ranks wait for the slow one. The straggler is the rank that computes the most "
                f"(compute per rank {computes} ms)."
            )
        raise AssertionError(
            f"you named rank {rank}; with compute per rank {computes} ms the straggler is rank "
            f"{expected}, the one that computes the most. (Every rank's step_ms is the same in "
            "synchronous training: compare compute_ms, not step_ms.)"
        )


def check_tp_comm(fn: Callable[..., float]) -> None:
    """Lab 01: `fn(config, micro_batch, tp, link)` gives the ms of tensor-parallel all-reduces for one
    micro-batch through every block (`labkit.planner.tp_comm_s`, without checkpointing, fp32)."""
    from labkit.links import Link, collective_time_s
    from labkit.models import GPTConfig
    from labkit.planner import tp_comm_s

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
                f"{where}: you gave {got:.3f} ms for {want:.3f} ms, as if each rank all-reduced a 1/tp shard. The tensor each rank "
                "all-reduces is the whole activation (micro_batch x seq x d_model), not a 1/tp shard: "
                "each rank holds a partial sum of all of it."
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
    within 10 % of the fastest prediction; `reason` quotes its predicted ms and its memory per GPU in MiB (each
    within 5 %). Returns the layout's `labkit.planner.Candidate`."""
    import re

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
