"""Lab 01's checks. The exercises': the tensor-parallel all-reduce time against `labkit.planner.tp_comm_s`,
and the learner's layout choice against the plan; their hints name the mistake made. The end-to-end one: the
planner's pick, measured beside every layout, is near the fastest and beats the mistake, and the prediction
ranks the layouts as measured (`check_planner_pick`)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from labkit.course.experiments.own_answer import Reference, refusing
from labkit.course.experiments.slips import name_slip_across, unit_slips
from labkit.links import Link, collective_time_s
from labkit.models import GPTConfig
from labkit.planner import tp_comm_s

__all__ = [
    "PICK_WITHIN",
    "RANKS_LIKE",
    "TP_COMM_REFERENCE",
    "check_layout_choice",
    "check_planner_pick",
    "check_tp_comm",
]


TP_COMM_REFERENCE = Reference(
    tp_comm_s,
    "labkit.planner.tp_comm_s",
    "write it from labkit.links.collective_time_s: how many all-reduces per block, of how many bytes",
)


def _tp_slips(config: GPTConfig, mb: int, tp: int, link: Link, want: float) -> list[tuple[float, str]]:
    """What each usual slip gives for this case (ms), with its hint."""

    def ms(per_block: int, nbytes: float, blocks: int = config.n_layers) -> float:
        return blocks * per_block * collective_time_s("all_reduce", nbytes, tp, link) * 1e3

    nbytes = mb * config.seq_len * config.d_model * 4
    return [
        *unit_slips(want, "ms"),
        (
            ms(2, nbytes),
            "half of it. You counted the forward's two all-reduces per block (g); backward has two more "
            "(f's gradient before attention and before the MLP): 4 per block",
        ),
        (
            ms(4, nbytes / 2),
            "what 2 bytes per element give: the lab's model is fp32, 4 bytes per element (bf16 would be 2)",
        ),
        (
            ms(4, nbytes / 4),
            "what the activation's element count gives as bytes: multiply micro_batch x seq x d_model by "
            "the 4 bytes of an fp32 element",
        ),
        (
            ms(4, nbytes // tp),
            "as if each rank all-reduced a 1/tp shard. The tensor each rank all-reduces is the whole "
            "activation (micro_batch x seq x d_model), not a 1/tp shard: each rank holds a partial sum of "
            "all of it",
        ),
        (ms(4, nbytes, blocks=1), f"one block's worth: multiply by the {config.n_layers} blocks"),
        (
            want * tp,
            f"{tp} times too much, as if the tp ranks' times added up: the {tp} ranks take part in each "
            "all-reduce together, so one all-reduce costs each of them collective_time_s once",
        ),
    ]


def check_tp_comm(fn: Callable[..., float]) -> None:
    """Lab 01: `fn(config, micro_batch, tp, link)` gives the ms of tensor-parallel all-reduces for one
    micro-batch through every block (`labkit.planner.tp_comm_s`, without checkpointing, fp32), without
    calling it."""

    nvlink, ib = Link(450.0, 5.0, "NVLink"), Link(50.0, 10.0, "InfiniBand")
    cases = [
        (GPTConfig(n_layers=8, d_model=512, n_heads=8, vocab_size=1024, seq_len=256), 4, 4, ib),
        (GPTConfig(n_layers=24, d_model=2048, n_heads=16, vocab_size=1024, seq_len=1024), 2, 8, nvlink),
        (GPTConfig(n_layers=4, d_model=512, n_heads=8, vocab_size=256, seq_len=256), 1, 2, ib),
    ]
    wants, gots = [], []
    for config, mb, tp, link in cases:
        with refusing(fn, [TP_COMM_REFERENCE]):
            got = fn(config, mb, tp, link)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise AssertionError(f"return a number of milliseconds, not {got!r}")
        wants.append(tp_comm_s(config, mb, tp, link) * 1e3)
        gots.append(got)
    pairs = enumerate(zip(gots, wants, strict=True))
    wrong = [i for i, (got, want) in pairs if not math.isclose(got, want, rel_tol=0.02)]
    if wrong:
        first = wrong[0]
        config, mb, tp, link = cases[first]
        where = (
            f"{config.n_layers} blocks, d_model {config.d_model}, seq {config.seq_len}, micro-batch {mb}, "
            f"tp={tp} over {link.name} ({link.bandwidth_gb_s:g} GB/s, {link.latency_us:g} µs)"
        )
        slips = [_tp_slips(*case, want) for case, want in zip(cases, wants, strict=True)]
        slip = name_slip_across([gots[i] for i in wrong], [slips[i] for i in wrong], rel_tol=0.02)
        raise AssertionError(
            f"{where}: you gave {gots[first]:.6g} ms, expected {wants[first]:.6g} ms: "
            + (
                f"{slip}."
                if slip
                else "Per block: 4 all-reduces of micro_batch x seq x d_model x 4 bytes (fp32), each "
                "labkit.links.collective_time_s('all_reduce', nbytes, tp, link) seconds."
            )
        )
    with refusing(fn, [TP_COMM_REFERENCE]):
        alone = fn(cases[0][0], 4, 1, nvlink)
    if alone != 0:
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
    other_units = {
        "ms": [(chosen.predicted_ms / 1e3, "seconds")],
        "MiB": [(mib / 1024, "GiB"), (mib * 2**20, "bytes")],
    }
    for what, value, unit in (("predicted step", chosen.predicted_ms, "ms"), ("memory per GPU", mib, "MiB")):
        if any(math.isclose(v, value, rel_tol=0.05) for v in numbers):
            continue
        in_other = [
            f" (you quote it in {name}, {number:g}: say it in {unit}, as the plan's table does)"
            for other, name in other_units[unit]
            for number in numbers
            if math.isclose(number, other, rel_tol=0.05)
        ]
        said = in_other[0] if in_other else ""
        raise AssertionError(
            f"my_reason={reason!r} does not quote the planner's {what} for {chosen.layout} "
            f"({value:.1f} {unit}){said}: explain the choice with the plan's numbers"
        )
    return chosen


PICK_WITHIN = 1.10  # the pick's measured step over the fastest measured layout's, at most
RANKS_LIKE = 0.8  # Spearman's rank correlation of predicted and measured steps, at least


def check_planner_pick(measured_ms: Mapping[str, float], pick: str, mistake: str, rho: float) -> float:
    """Lab 01's end-to-end check on every layout measured, `measured_ms` (layout -> measured step in ms, the
    mistake's included): the planner's pick is at most `PICK_WITHIN` x the fastest layout, the prediction
    ranks the layouts as measured (`rho`, Spearman's correlation of predicted and measured steps, at least
    `RANKS_LIKE`), and the pick beats the mistake, tensor parallelism across nodes. Returns the pick's step
    over the fastest. AssertionError naming what failed, with the numbers and a hint."""
    for name in (pick, mistake):
        if name not in measured_ms:
            raise ValueError(f"{name} was not measured: measured_ms has {', '.join(measured_ms)}")
    best = min(measured_ms, key=measured_ms.__getitem__)
    pick_ms, best_ms, mistake_ms = measured_ms[pick], measured_ms[best], measured_ms[mistake]
    again = (
        "hint: is the machine busy with something else? The planner's rates were measured in section 3: "
        "run it and this section again"
    )
    if not pick_ms <= PICK_WITHIN * best_ms:
        raise AssertionError(
            f"the pick {pick} ({pick_ms:.1f} ms) is {pick_ms / best_ms - 1:.0%} slower than the fastest "
            f"layout measured, {best} ({best_ms:.1f} ms): more than {PICK_WITHIN - 1:.0%}; {again}"
        )
    if not rho >= RANKS_LIKE:
        measured = ", ".join(f"{k} {v:.1f}" for k, v in sorted(measured_ms.items(), key=lambda kv: kv[1]))
        raise AssertionError(
            f"predicted and measured rank the layouts differently (Spearman {rho:.2f}, at least "
            f"{RANKS_LIKE}); measured ms, fastest first: {measured}; {again}"
        )
    if not pick_ms < mistake_ms:
        raise AssertionError(
            f"the pick {pick} ({pick_ms:.1f} ms) is not faster than tensor parallelism across nodes, "
            f"{mistake} ({mistake_ms:.1f} ms); {again}"
        )
    return pick_ms / best_ms
