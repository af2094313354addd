"""Ideal pipeline schedules: the order each rank runs its forwards and backwards, simulated with unit costs.

`rank_order(schedule, p, m, rank, v)` is the list of (kind, stage, micro-batch) a rank runs:

* GPipe (Huang et al. 2019): every forward, then every backward;
* 1F1B (PipeDream-Flush: Narayanan, Phanishayee et al., ICML 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training"): p - rank - 1 warm-up forwards, then one forward and one backward in turn, then the remaining
  backwards;
* interleaved 1F1B (Narayanan et al. 2021, section 2.2): v chunks per rank (virtual stage k on rank k mod p),
  micro-batches taken in groups of p per chunk, (p - rank - 1) x 2 + (v - 1) x p warm-up forwards (as in
  Megatron-LM's `forward_backward_pipelining_with_interleaving`), then one forward and one backward in turn.

`simulate(schedule, p, m, v)` runs those orders against their dependencies (a forward needs the previous
stage's forward of the same micro-batch; a backward the next stage's backward, and its own forward), a forward
costing 1/v and a backward 2/v of a stage's work, and returns each rank's spans, the step, the bubble and the
most micro-batch activations each rank holds at once: what `labkit.pipeline_plan.bubble_fraction` and
`in_flight` say, derived by running the schedule. `labkit.course.widgets.pipeline_explorer` draws it."""

from __future__ import annotations

from dataclasses import dataclass

from labkit import validate

__all__ = ["Simulation", "rank_order", "simulate"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def rank_order(schedule: str, p: int, m: int, rank: int, v: int = 1) -> list[tuple[str, int, int]]:
    """The (kind "F"/"B", virtual stage, micro-batch) actions of `rank`, in the order it runs them."""
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - rank - 1, m)
        order = [("F", rank, i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", rank, warm + i), ("B", rank, i)]
        return order + [("B", rank, i) for i in range(m - warm, m)]
    # interleaved: forwards visit chunk 0 for p micro-batches, then chunk 1, ...; backwards the chunks
    # reversed
    fwd = [("F", c * p + rank, g * p + j) for g in range(m // p) for c in range(v) for j in range(p)]
    bwd = [
        ("B", c * p + rank, g * p + j) for g in range(m // p) for c in reversed(range(v)) for j in range(p)
    ]
    warm = min((p - rank - 1) * 2 + (v - 1) * p, len(fwd))
    order = fwd[:warm]
    for i in range(len(fwd) - warm):
        order += [fwd[warm + i], bwd[i]]
    return order + bwd[len(fwd) - warm :]


@dataclass
class Simulation:
    schedule: str
    stages: int  # p ranks
    micro_batches: int
    chunks: int
    spans: list[list[tuple[str, int, int, float, float]]]  # per rank: (kind, stage, micro-batch, start, end)
    step: float  # in units of one micro-batch's forward + backward through one stage (F = 1, B = 2)
    bubble: float  # idle share of the step, averaged over ranks
    in_flight: list[float]  # per rank: the most activations held at once, in one stage's micro-batches


def simulate(schedule: str, p: int, m: int, v: int = 1) -> Simulation:
    """Run every rank's order against the dependencies with unit stage costs (forward 1/v, backward 2/v)."""
    validate.one_of("schedule", schedule, SCHEDULES, 'simulate("1f1b", p=4, m=8)')
    validate.positive_int("p", p, 'simulate("1f1b", p=4, m=8)')
    validate.positive_int("m", m, 'simulate("1f1b", p=4, m=8)')
    validate.positive_int("v", v, 'simulate("interleaved_1f1b", p=4, m=8, v=2)')
    if schedule != "interleaved_1f1b":
        v = 1
    elif m % p:
        raise ValueError(
            f"interleaved 1F1B takes micro-batches in groups of p: m={m} is not a multiple of p={p}; "
            f"use m={max(p, m // p * p)}"
        )
    stages = p * v
    orders = [rank_order(schedule, p, m, r, v) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free, nxt = [0.0] * p, [0] * p
    spans: list[list[tuple[str, int, int, float, float]]] = [[] for _ in range(p)]
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if nxt[r] >= len(orders[r]):
                continue
            kind, k, i = orders[r][nxt[r]]
            deps = (
                ([("F", k - 1, i)] if kind == "F" and k > 0 else [])
                + ([("B", k + 1, i)] if kind == "B" and k < stages - 1 else [])
                + ([("F", k, i)] if kind == "B" else [])
            )
            if all(d in done for d in deps):
                start = max([free[r]] + [done[d] for d in deps])
                end = start + (1.0 if kind == "F" else 2.0) / v
                done[(kind, k, i)] = free[r] = end
                spans[r].append((kind, k, i, start, end))
                nxt[r] += 1
                progressed = True
        if not progressed:  # an order that waits on itself: a bug in rank_order, never a learner's input
            raise RuntimeError(
                f"{schedule} with p={p}, m={m}, v={v} deadlocked at {[orders[r][nxt[r]] for r in range(p)]}"
            )
    step = max(free)
    busy = sum(e - a for rs in spans for *_, a, e in rs)
    held = []
    for rs in spans:
        level = peak = 0
        for kind, *_ in rs:  # forwards add an activation, backwards free one (per chunk: 1/v of a stage's)
            level += 1 if kind == "F" else -1
            peak = max(peak, level)
        held.append(peak / v)
    return Simulation(schedule, p, m, v, spans, step, 1 - busy / (p * step), held)
