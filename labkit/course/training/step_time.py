"""A job's step time over its ranks, and the fixed job against the clean one.

In data parallelism every rank waits for the slowest at the next all-reduce, so a job's step is its slowest
rank's median (`step_ms`). Labs 05 and 06 measure the clean job (nothing planted) in the same launch as
the fixed one and call it the limit. It is a *reference*, not a bound: two measurements of the same work
differ by the machine's noise, so a fixed job can come out a little under it. `versus_clean` says which case
a run is in, against the spread of the two jobs' own timed steps (`step_spread_ms`), instead of letting
"after" sit below "the limit no fix can beat" unexplained.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.course.training.loop import JobResult

__all__ = ["step_ms", "step_spread_ms", "versus_clean"]


def step_ms(run: Sequence[JobResult]) -> float:
    """The job's step: its slowest rank's median (every rank waits for it at the next all-reduce)."""
    return max(r.step_ms for r in run)


def step_spread_ms(*runs: Sequence[JobResult]) -> float:
    """The widest range of step times over the runs' timed steps, each step as slow as its slowest rank."""
    spreads = []
    for run in runs:
        per_step = [max(ms) for ms in zip(*(r.steps_ms for r in run))]
        spreads.append(max(per_step) - min(per_step) if per_step else 0.0)
    return max(spreads, default=0.0)


def versus_clean(after_ms: float, clean_ms: float, spread_ms: float, label: str) -> str:
    """One sentence: how the fixed job's step stands against the clean job's, measured in the same launch."""
    gap = after_ms - clean_ms
    if gap >= 0:
        return (
            f"after {after_ms:.1f} ms is {gap:.1f} ms ({gap / clean_ms:.0%}) above the clean job's "
            f"{clean_ms:.1f} ms ({label})"
        )
    under = f"after {after_ms:.1f} ms is {-gap:.1f} ms under the clean job's {clean_ms:.1f} ms"
    if -gap <= spread_ms:
        return (
            f"{under}, inside the {spread_ms:.1f} ms its timed steps spread over: the same within this run's "
            f"noise; the clean job is a reference measured beside it, not a bound ({label})"
        )
    return (
        f"{under}, more than the {spread_ms:.1f} ms its timed steps spread over: not this run's step-to-step "
        "noise, yet the clean job is a reference measured beside it, not a bound (two identical jobs in one "
        f"launch differed by up to 13 % on a shared 2-core VM; more `steps` measure both better) ({label})"
    )
