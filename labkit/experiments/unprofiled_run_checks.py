"""Lab 05's exercise check: the learner's straggler finder on breakdowns with and without a straggler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.experiments.own_answer import Reference, refusing
from labkit.experiments.slips import name_slip
from labkit.trace.analyze import RankBreakdown
from labkit.trace.diagnose import _check_straggler, diagnose, findings

__all__ = ["STRAGGLER_REFERENCES", "check_find_straggler"]

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
