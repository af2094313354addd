"""Lab 05's checks. The exercise's: the learner's straggler finder on breakdowns with and without a straggler
(`check_find_straggler`). The end-to-end one: the trace named the planted mistake, and its fix sped the job
up without beating the clean job by far (`check_mystery_fix`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.course.experiments.own_answer import Reference, refusing
from labkit.course.experiments.slips import name_slip
from labkit.course.training import MISTAKES
from labkit.trace.analyze import RankBreakdown
from labkit.trace.diagnose import _check_straggler, diagnose, findings

__all__ = ["CLEAN_SLOWER_OK", "STRAGGLER_REFERENCES", "check_find_straggler", "check_mystery_fix"]

# labkit's own straggler rule, which reads the same breakdowns (at its own threshold)
STRAGGLER_REFERENCES = [
    Reference(
        _check_straggler,
        "labkit.trace.diagnose's straggler rule",
        "compare each rank's compute_ms with the median of the others' yourself",
    ),
    Reference(
        diagnose,
        "labkit.trace.diagnose",
        "compare each rank's compute_ms with the median of the others' yourself",
    ),
    Reference(
        findings,
        "labkit.trace.findings",
        "compare each rank's compute_ms with the median of the others' yourself",
    ),
]


def _breakdown(rank: int, compute: float, step: float = 100.0) -> Any:

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
        with refusing(fn, STRAGGLER_REFERENCES):
            got = fn(breakdown)
        computes = {b.rank: b.compute_ms for b in breakdown}
        waits = {b.rank: b.wait_ms for b in breakdown}
        if expected is None:
            if got is not None:
                raise AssertionError(
                    f"compute per rank {computes} ms: you named {got!r}, but the ranks are within "
                    f"{max(computes.values()) / min(computes.values()):.2f}x of each other, which is noise "
                    "on real machines. Name a straggler only when it computes at least 1.25x the median of "
                    "the other ranks (and they wait for it); return None otherwise."
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
                    f"the ratio is {ratio!r}: every rank's step_ms is the same in synchronous training (each "
                    "waits for the slowest), so step times cannot tell the ranks apart. Compare compute_ms "
                    "instead."
                )
            if not isinstance(ratio, (int, float)) or abs(ratio - want) > 0.02 * want:
                everyone = sorted(computes.values())
                mid = len(everyone) // 2
                with_itself = (
                    everyone[mid] if len(everyone) % 2 else (everyone[mid - 1] + everyone[mid]) / 2
                )
                slip = isinstance(ratio, (int, float)) and name_slip(
                    ratio,
                    [
                        (1 / want, "upside down: the others' median over the straggler's compute"),
                        (100 * want, "a percentage: return the plain ratio (1.8, not 180)"),
                        (want - 1, "how much more it computes (ratio - 1): return the ratio itself"),
                        (
                            computes[expected] / with_itself,
                            "over a median that includes the straggler itself: take the median of the "
                            "other ranks' compute only",
                        ),
                    ],
                    rel_tol=0.02,
                )
                raise AssertionError(
                    f"rank {rank} is right, but the ratio {ratio!r} is not its compute over the "
                    f"median of the other ranks' ({want:.2f})" + (f": it is {slip}" if slip else "")
                )
            continue
        fastest = min(computes, key=computes.get)
        if rank == max(waits, key=waits.get) or rank == fastest:
            raise AssertionError(
                f"you named rank {rank}, which waits the most ({waits[rank]:.0f} ms): in synchronous "
                "training the fast ranks wait for the slow one. The straggler is the rank that computes the "
                f"most (compute per rank {computes} ms)."
            )
        raise AssertionError(
            f"you named rank {rank}; with compute per rank {computes} ms the straggler is rank "
            f"{expected}, the one that computes the most. (Every rank's step_ms is the same in "
            "synchronous training: compare compute_ms, not step_ms.)"
        )


# The clean job's step over the fixed job's, at most: two identical jobs in one launch differ by up to 13 %
# here (measured: clean / fixed 0.87-1.08 over 8 runs of 2 steps, both ranks sharing one core), so the fixed
# job beats the clean one "by far" when the clean one takes more than a quarter longer.
CLEAN_SLOWER_OK = 1.25


def check_mystery_fix(found: Any, planted: str, before_ms: float, after_ms: float, limit_ms: float) -> float:
    """Lab 05's end-to-end check: the diagnosis `found` (`labkit.trace.diagnose`'s, its `kind` and `evidence`)
    names the mistake `planted` in the mystery job (a `labkit.course.training.MISTAKES` name), the fixed job's
    step `after_ms` beats the mystery job's `before_ms`, and does not beat the clean job's `limit_ms` by far
    (the clean job takes at most `CLEAN_SLOWER_OK` x it: a reference measured beside it, not a bound). Returns
    the ms the fix took off the step. AssertionError naming what failed, with the numbers and a hint (never
    the planted mistake's name: the trace is to tell it)."""
    if planted not in MISTAKES:
        raise ValueError(
            f"planted={planted!r} must be one of labkit.course.training.MISTAKES: {', '.join(MISTAKES)}"
        )
    if found.kind != MISTAKES[planted].diagnosed_as:
        raise AssertionError(
            f"the diagnosis ({found.kind}) is not the planted mistake: see its evidence ({found.evidence}); "
            "hint: read the per-rank breakdown above, not the job's config"
        )
    if not after_ms < before_ms:
        raise AssertionError(
            f"the fix did not speed the job up: before {before_ms:.1f} ms, after {after_ms:.1f} ms; hint: "
            "was the job re-run with the fix the diagnosis points to (fixed_job(job, found.kind))?"
        )
    if not limit_ms <= after_ms * CLEAN_SLOWER_OK:
        raise AssertionError(
            f"the fixed job ({after_ms:.1f} ms) beat the clean one ({limit_ms:.1f} ms) by far: the clean one "
            f"took x{limit_ms / after_ms:.2f} its time, more than the x{CLEAN_SLOWER_OK} two identical jobs "
            "in one launch differ by; hint: is the machine busy with something else? Re-run section 5."
        )
    return before_ms - after_ms
