"""The capstone's check: which planted mistakes were found and fixed, and the fixed job against the clean one.

`check_capstone(cap, found, fixed)` runs the learner's fixed job and the clean job (nothing planted) in one
launch (`labkit.experiments.capstone.train`), then, for every planted mistake, asks three things: was it named
in `found`; does the fixed job's config no longer plant it; and does the measurement agree (no OOM within the
GPU's memory, `labkit.trace.findings` no longer shows it in the fixed job's traces)? It also fails on a fix that
changes the job's contract (its global batch), on a mistake the fix brought in, and on a fixed job more than
`SLOWER_OK` times slower than the clean one. The `CapstoneReport` it returns (or puts in the AssertionError)
has a row per planted mistake and the step time and memory of both jobs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labkit.experiments.capstone import MISTAKES, Capstone, TrainingJob, train

__all__ = ["DIAGNOSED_AS", "SLOWER_OK", "CapstoneReport", "check_capstone", "planted_by_knobs"]

# labkit.trace.diagnose's kinds, as the capstone's mistakes (host_sync is not planted in the capstone)
DIAGNOSED_AS = {
    "small_collectives": "per_tensor_allreduce",
    "straggler": "straggler",
    "data_loading": "data_loading",
    "sync_collective": "sync_logging",
}
SLOWER_OK = (
    1.2  # the fixed job may take this much longer than the clean one (noise, a different but fair fix)
)
_FIXES = {
    "oom_batch": "keep global_batch; take a smaller micro_batch (gradient accumulation makes up the rest)",
    "per_tensor_allreduce": 'grad_sync="ddp": DDP all-reduces buckets during backward',
    "straggler": "eval_rank=None: every rank evaluates its share of the held-out batch",
    "data_loading": 'tokenize="ahead": tokenize once, before training',
    "sync_logging": 'accuracy="local": a local metric, reduced asynchronously',
}


def planted_by_knobs(job: TrainingJob) -> set[str]:
    """The mistakes `job`'s knobs still plant (all but the OOM, which only a measurement can tell)."""
    out = set()
    if job.grad_sync == "per_tensor":
        out.add("per_tensor_allreduce")
    if job.eval_rank is not None:
        out.add("straggler")
    if job.tokenize == "in_loader":
        out.add("data_loading")
    if job.accuracy == "gathered":
        out.add("sync_logging")
    return out


@dataclass
class CapstoneReport:
    """Per planted mistake: found, fixed and why; the fixed and clean jobs' step (ms) and peak memory (MiB)."""

    rows: list[dict[str, Any]]
    problems: list[str]
    label: str
    fixed_ms: float | None = None
    clean_ms: float | None = None
    fixed_peak_mib: float | None = None
    clean_peak_mib: float | None = None
    memory_mib: float = 0.0
    findings: list[Any] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def table(self) -> str:
        lines = [f"{'planted mistake':22} {'found':6} {'fixed':6} evidence"]
        lines += [
            f"{r['mistake']:22} {'yes' if r['found'] else 'no':6} {'yes' if r['fixed'] else 'no':6} "
            f"{r['evidence']}"
            for r in self.rows
        ]
        if self.fixed_ms is not None and self.clean_ms is not None:
            lines.append(
                f"step: fixed job {self.fixed_ms:.1f} ms, clean job {self.clean_ms:.1f} ms "
                f"(x{self.fixed_ms / self.clean_ms:.2f}); peak memory per rank: fixed "
                f"{self.fixed_peak_mib:.1f} MiB, clean {self.clean_peak_mib:.1f} MiB, of "
                f"{self.memory_mib:.1f} MiB ({self.label})"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        left = (
            "\n".join(f"- {p}" for p in self.problems) or "- nothing: every planted mistake found and fixed"
        )
        return f"{self.table()}\nwhat is left:\n{left}"


def _step_ms(per_rank: list[dict[str, Any]]) -> float:
    return max(r["median_ms"] for r in per_rank)  # the job's step: its slowest rank's


def check_capstone(
    cap: Capstone,
    found: Iterable[str],
    fixed: TrainingJob,
    *,
    cluster: Any = "auto",
    trace_dir: str | Path | None = None,
    timeout_s: float = 120,
) -> CapstoneReport:
    """Run `fixed` and the clean job; raise AssertionError naming what is left, else return the report."""
    from labkit.launcher import RankError, launch
    from labkit.trace.diagnose import findings

    named = set(found)
    unknown = sorted(named - set(MISTAKES))
    if unknown:
        raise ValueError(
            f"found={sorted(named)}: {unknown} are not capstone mistakes; name them from {MISTAKES}"
        )
    if not isinstance(fixed, TrainingJob):
        raise ValueError(
            f"fixed={fixed!r}: pass the fixed TrainingJob, e.g. dataclasses.replace(cap.job, ...)"
        )
    problems: list[str] = []
    if fixed.global_batch != cap.job.global_batch:
        problems.append(
            f"global_batch is {fixed.global_batch}, the job's is {cap.job.global_batch}: the batch the "
            "optimizer sees is the job's contract (its learning rate was tuned for it). Keep it; change "
            "micro_batch, and accumulation makes up the rest"
        )
    trace_dir = Path(trace_dir or tempfile.mkdtemp(prefix="capstone_check_"))
    from labkit.cluster import Cluster

    the_cluster = Cluster.resolve(cluster, cap.world_size)
    report = CapstoneReport([], problems, the_cluster.label, memory_mib=cap.memory_mib)
    try:
        clean, mine = (
            list(run)
            for run in zip(
                *launch(
                    train,
                    cap,
                    [cap.clean, fixed],
                    str(trace_dir),
                    world_size=cap.world_size,
                    cluster=the_cluster,
                    timeout_s=timeout_s,
                    deadline_s=timeout_s * 3,
                )
            )
        )
    except RankError as err:
        if not isinstance(err.__cause__, torch.OutOfMemoryError):
            raise
        for m in cap.planted:
            report.rows.append(
                {
                    "mistake": m,
                    "found": m in named,
                    "fixed": False,
                    "evidence": "the fixed job does not run: OOM" if m == "oom_batch" else "not measured",
                }
            )
        problems.append(
            f"the fixed job runs out of memory ({cap.memory_mib:.1f} MiB per rank): {_FIXES['oom_batch']}. "
            f"The error: {str(err).splitlines()[0]}"
        )
        raise AssertionError(str(report)) from None
    report.fixed_ms, report.clean_ms = _step_ms(mine), _step_ms(clean)
    report.fixed_peak_mib = max(r["peak_mib"] for r in mine)
    report.clean_peak_mib = max(r["peak_mib"] for r in clean)
    report.findings = findings(Path(mine[0]["traces"]))
    seen = {DIAGNOSED_AS[d.kind]: d for d in report.findings if d.kind in DIAGNOSED_AS}
    by_knobs = planted_by_knobs(fixed)
    for m in cap.planted:
        if m == "oom_batch":
            ok, why = True, f"runs in {report.fixed_peak_mib:.1f} of {cap.memory_mib:.1f} MiB per rank"
        elif m in by_knobs:
            ok, why = False, f"the fixed job still plants it ({_FIXES[m]})"
        elif m in seen:
            ok, why = False, f"the knob is fixed, but the trace still shows it: {seen[m].evidence}"
        else:
            ok, why = True, "its knob is fixed and the trace no longer shows it"
        report.rows.append({"mistake": m, "found": m in named, "fixed": ok, "evidence": why})
        if m not in named:
            problems.append(
                f"{m} was planted and not named in found: measure it (the table shows how it was fixed)"
            )
        if not ok:
            problems.append(f"{m} is not fixed: {why}")
    for m in sorted(named - set(cap.planted)):
        problems.append(f"{m} is in found but was not planted: which measurement pointed to it?")
    for m, d in seen.items():
        if m not in cap.planted:
            problems.append(f"the fix brought in {m}: {d.evidence}")
    if report.fixed_ms > SLOWER_OK * report.clean_ms:
        slow = " (activation checkpointing recomputes the forward in backward)" if fixed.checkpointing else ""
        problems.append(
            f"the fixed job's step is {report.fixed_ms:.1f} ms, {report.fixed_ms / report.clean_ms:.2f}x "
            f"the clean job's {report.clean_ms:.1f} ms (at most {SLOWER_OK}x){slow}"
        )
    if problems:
        raise AssertionError(str(report))
    return report
