"""Name the likely bottleneck of a run from its traces, with the numbers that show it.

`diagnose(traces)` reads one run's per-rank traces with `analyze.py` and checks, in this order, for
the mistakes lab 05 plants (each seen in real jobs). Most rules compare a share of the step with a
threshold; two count collectives (`MANY_COLLECTIVES` per step, at most 4 blocking ones), so a model with
fewer than `MANY_COLLECTIVES` parameter tensors is never flagged for a per-tensor all-reduce:

1. **data loading**: a rank spends at least `DATA_SHARE` of its step loading data in the training
   process (`data_loading.py`: PyTorch's DataLoader spans, Python work outside any operator before the
   forward, or `phase("data")`); the job needs no label;
2. **host sync**: a rank spends at least `HOST_SYNC_SHARE` of its step in host synchronisations
   (`.item()`, `cuda*Synchronize`). On the emulated cluster compute is synchronous, so a sync costs
   nothing there: this one fires on GPU traces only (the time is spent in the sync; what removing it saves
   is the host work after it that could have overlapped the device);
3. **straggler**: one rank computes at least `STRAGGLER_RATIO` times the others' median while they wait
   for it at least `WAIT_SHARE` of the step, and it waits less than half as much as they do (on GPU traces
   the wait is inside the NCCL kernels: `_waited_ms`);
4. **small collectives**: at least `MANY_COLLECTIVES` collectives per step, at least `EXPOSED_SHARE` of
   them run with no compute beside them (the emulated timeline's collectives, a GPU trace's NCCL kernels,
   a CPU host trace's `gloo:*` transfers: a share, so it does not depend on their size), with the ranks
   blocked at least `WAIT_SHARE` of the step (on GPU traces, exposed NCCL kernels count as blocked): the
   per-tensor all-reduce after backward, not DDP's buckets under backward;
5. **synchronous collective**: a rank blocked at least `WAIT_SHARE` of the step on a few collectives
   issued early in its step (at most `EARLY` of its compute before them, as after forward) with compute
   still to do after them (the backward): a logging all-reduce or all-gather between forward and
   backward. DDP's gradient buckets, waited for at the end of backward, are not it;
6. otherwise **none** stands out.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from labkit.trace.analyze import Collective, RankBreakdown, analyze

__all__ = ["KINDS", "Diagnosis", "diagnose", "findings"]

KINDS = ("straggler", "data_loading", "small_collectives", "sync_collective", "host_sync", "none")
DATA_SHARE = 0.15
HOST_SYNC_SHARE = 0.10
STRAGGLER_RATIO = 1.5
WAIT_SHARE = 0.10
MANY_COLLECTIVES = 16
EXPOSED_SHARE = 0.8
EARLY = 0.4  # a collective issued with at most this share of the step's compute done, and ...
LATE = 0.3  # ... at least this share still to do after it, sits between forward and backward


@dataclass
class Diagnosis:
    """The verdict: `kind` (one of KINDS), the rank concerned (or None), the evidence and the breakdown."""

    kind: str
    rank: int | None
    evidence: str
    breakdown: list[RankBreakdown]

    def __str__(self) -> str:
        who = "" if self.rank is None else f" (rank {self.rank})"
        return f"{self.kind}{who}: {self.evidence}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _data_parts(r: RankBreakdown) -> str:
    """What the data loading was, where part of it was Python work outside any operator."""
    if r.host_python_ms <= 0.05 * r.data_ms:
        return ""
    return (
        f" ({r.host_python_ms:.1f} ms of it Python work before the forward, outside any torch operator: "
        "tokenising inline?)"
    )


def _check_data(b: list[RankBreakdown]) -> Diagnosis | None:
    worst = max(b, key=lambda r: r.data_ms / r.step_ms)
    share = worst.data_ms / worst.step_ms
    if share < DATA_SHARE:
        return None
    slow = [r.rank for r in b if r.data_ms / r.step_ms >= DATA_SHARE]
    rank = None if len(slow) == len(b) else worst.rank
    where = "every rank" if rank is None else f"rank {worst.rank}"
    return Diagnosis(
        "data_loading",
        rank,
        f"{where} spends {worst.data_ms:.1f} of {worst.step_ms:.1f} ms per step "
        f"({_pct(share)}) loading data in the training process{_data_parts(worst)} (threshold "
        f"{_pct(DATA_SHARE)})",
        b,
    )


def _check_host_sync(b: list[RankBreakdown]) -> Diagnosis | None:
    worst = max(b, key=lambda r: r.host_sync_ms / r.step_ms)
    share = worst.host_sync_ms / worst.step_ms
    if share < HOST_SYNC_SHARE:
        return None
    return Diagnosis(
        "host_sync",
        None,
        f"rank {worst.rank} waits {worst.host_sync_ms:.1f} ms per step "
        f"({_pct(share)}) in {worst.host_syncs:.0f} host synchronisations (.item(), cudaSynchronize): "
        "the host stops feeding the GPU until its queue drains",
        b,
    )


def _waited_ms(r: RankBreakdown, b: list[RankBreakdown]) -> float:
    """How long `r` waited for the other ranks per step.

    On GPU traces a rank that arrives early at a collective waits inside the NCCL kernel: the kernels of one
    collective start when each rank issues them and end together, once the last rank has joined (as
    AMD-AGI/TraceLens#22 describes them), so the wait shows as communication, not as idle time. The part of a
    rank's exposed communication beyond the least any rank had (the transfer itself) is then waiting too:
    DeepSpeed's comms logger calls the same difference the straggler effect (deepspeedai/DeepSpeed#3579).
    The emulated device timeline and CPU traces show the wait itself."""
    if r.source != "GPU kernels":
        return r.wait_ms
    return r.wait_ms + r.exposed_comm_ms - min(x.exposed_comm_ms for x in b)


def _check_straggler(b: list[RankBreakdown]) -> Diagnosis | None:
    if len(b) < 2:
        return None
    slow = max(b, key=lambda r: r.compute_ms + r.data_ms)
    others = [r for r in b if r.rank != slow.rank]
    typical = statistics.median(r.compute_ms + r.data_ms for r in others)
    ratio = (slow.compute_ms + slow.data_ms) / typical if typical > 0 else float("inf")
    waited = statistics.median(_waited_ms(r, b) / r.step_ms for r in others)
    own_wait = _waited_ms(slow, b) / slow.step_ms
    # the others wait for it, and it waits much less than they do (a collective every rank waits on is not it)
    if ratio < STRAGGLER_RATIO or waited < WAIT_SHARE or own_wait > waited / 2:
        return None
    return Diagnosis(
        "straggler",
        slow.rank,
        f"rank {slow.rank} computes {slow.compute_ms + slow.data_ms:.1f} ms per "
        f"step, {ratio:.2f}x the other ranks' {typical:.1f} ms, and they wait {_pct(waited)} of their "
        "step for it",
        b,
    )


def _blocked_ms(r: RankBreakdown) -> float:
    """The time `r`'s step ran no compute while its collectives were in flight, or was idle. On GPU traces
    a rank blocked behind its NCCL kernels shows them as communication, not as idle time."""
    return r.wait_ms + (r.exposed_comm_ms if r.source == "GPU kernels" else 0.0)


def _check_small(b: list[RankBreakdown]) -> Diagnosis | None:
    r = max(b, key=lambda x: _blocked_ms(x) / x.step_ms)
    share = _blocked_ms(r) / r.step_ms
    if r.collectives < MANY_COLLECTIVES or share < WAIT_SHARE:
        return None
    mean_bytes = r.comm_bytes / r.collectives if r.comm_bytes else None
    # were they waited for one by one, with nothing computed beside? (a trace that times no collective
    # says nothing against it)
    alone = [c for c in r.step_collectives if c.overlapped_ms <= 0.1 * (c.end_ms - c.start_ms)]
    if len(alone) < EXPOSED_SHARE * len(r.step_collectives):
        return None  # most ran under compute, as DDP's buckets do during backward
    size = f" of {mean_bytes / 1024:.1f} KiB on average" if mean_bytes else ""
    return Diagnosis(
        "small_collectives",
        None,
        f"{r.collectives:.0f} collectives per step{size}, one after another "
        f"with nothing computed beside them; rank {r.rank} is blocked {_blocked_ms(r):.1f} ms "
        f"({_pct(share)}) "
        "of its step: each pays a fixed cost",
        b,
    )


def _step_compute(c: Collective) -> float:
    """The compute (data loading included) of the step a collective ran in: before, during and after it."""
    return c.compute_before_ms + c.overlapped_ms + c.compute_after_ms


def _check_sync_collective(b: list[RankBreakdown]) -> Diagnosis | None:
    best = None
    for r in b:
        # Each collective against the compute of its own step: `step_collectives` are the last profiled
        # step's, while `compute_ms` is the median over steps (a slower last step pushed shares past EARLY).
        mid = [
            c
            for c in r.step_collectives
            if c.waited_ms > 0
            and c.compute_before_ms <= EARLY * _step_compute(c)
            and c.compute_after_ms >= LATE * _step_compute(c)
        ]
        waited = sum(c.waited_ms for c in mid)
        if mid and len(mid) <= 4 and waited >= WAIT_SHARE * r.step_ms and (best is None or waited > best[1]):
            best = (r, waited, mid)
    if best is None:
        return None
    r, waited, mid = best
    names = ", ".join(sorted({c.name.split(" #")[0] for c in mid}))
    size = sum(c.nbytes or 0 for c in mid)
    return Diagnosis(
        "sync_collective",
        None,
        f"rank {r.rank} stops early in its step and waits {waited:.1f} ms "
        f"({_pct(waited / r.step_ms)}) for {len(mid)} collective(s) ({names}, {size / 1024:.0f} KiB) "
        "with compute still to do after them: a blocking collective outside backward (logging?)",
        b,
    )


_RULES = (_check_data, _check_host_sync, _check_straggler, _check_small, _check_sync_collective)


def findings(traces: str | Path | Sequence[str | Path]) -> list[Diagnosis]:
    """Every rule that fires on one run, in `diagnose`'s order; empty when none does. A job with several
    mistakes shows several (the capstone): fix the first, measure again."""
    b = analyze(traces)
    return [found for found in (rule(b) for rule in _RULES) if found is not None]


def diagnose(traces: str | Path | Sequence[str | Path]) -> Diagnosis:
    """The likely bottleneck of one run: a directory of its per-rank traces, or a list of their paths."""
    b = analyze(traces)
    for rule in _RULES:
        found = rule(b)
        if found is not None:
            return found
    worst = max(b, key=lambda r: r.wait_ms / r.step_ms)
    slow = max(b, key=lambda r: r.compute_ms + r.data_ms)
    others = [r.compute_ms + r.data_ms for r in b if r.rank != slow.rank] or [slow.compute_ms + slow.data_ms]
    ratio = (slow.compute_ms + slow.data_ms) / max(statistics.median(others), 1e-9)
    return Diagnosis(
        "none",
        None,
        f"no rule fired: the most any rank waits is {_pct(worst.wait_ms / worst.step_ms)} "
        f"of its step (rank {worst.rank}), data loading and host syncs are below "
        f"{_pct(DATA_SHARE)} and {_pct(HOST_SYNC_SHARE)}, and the busiest rank (rank {slow.rank}) "
        f"computes {ratio:.2f}x the others' median (a straggler: {STRAGGLER_RATIO}x)",
        b,
    )
