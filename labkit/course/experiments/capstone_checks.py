"""The capstone's check: which planted mistakes were found and fixed, and the fixed job against the clean one.

`check_capstone(cap, found, fixed)` runs the learner's fixed job and the clean job (nothing planted) in one
launch (`labkit.course.experiments.capstone.train`), then, for every planted mistake, asks three things: was
it named in `found`; does the fixed job's config no longer plant it (`labkit.course.training.MISTAKES`); and
does the measurement agree (no OOM within the GPU's memory, `labkit.trace.findings` no longer shows it in the
fixed job's traces)? It also fails on a fix that changes the job's contract (its global batch), on a mistake
the fix brought in, and on a fixed job more than `SLOWER_OK` times slower than the clean one. The
`CapstoneReport` it returns (or puts in the AssertionError) has a row per planted mistake and the step time
and memory of both jobs."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labkit.cluster import Cluster
from labkit.course.experiments.capstone import DEALT, Capstone, step_ms, train
from labkit.course.training.job import TrainingJob
from labkit.course.training.loop import JobResult
from labkit.course.training.mistakes import MISTAKES, by_diagnosis, planted_by_knobs
from labkit.course.training.step_time import step_spread_ms, versus_clean
from labkit.errors import RankError
from labkit.machine.launcher import launch
from labkit.trace.diagnose import Diagnosis, findings

__all__ = ["SLOWER_OK", "CapstoneReport", "check_capstone"]

SLOWER_OK = (
    1.2  # the fixed job may take this much longer than the clean one (noise, a different but fair fix)
)


@dataclass
class CapstoneReport:
    """Per planted mistake: found, fixed and why; the fixed and clean jobs' step (ms) and peak memory
    (MiB)."""

    rows: list[dict[str, Any]]
    problems: list[str]
    label: str
    fixed_ms: float | None = None
    clean_ms: float | None = None
    fixed_peak_mib: float | None = None
    clean_peak_mib: float | None = None
    spread_ms: float = 0.0  # how far the two jobs' timed steps spread (labkit.course.training.step_time)
    memory_mib: float = 0.0
    findings: list[Diagnosis] = field(default_factory=list)

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
            lines.append(versus_clean(self.fixed_ms, self.clean_ms, self.spread_ms, self.label))
        return "\n".join(lines)

    def __str__(self) -> str:
        left = (
            "\n".join(f"- {p}" for p in self.problems) or "- nothing: every planted mistake found and fixed"
        )
        return f"{self.table()}\nwhat is left:\n{left}"


def _row(
    name: str, named: set[str], fixed: TrainingJob, seen: dict[str, Diagnosis], report: CapstoneReport
) -> tuple[dict[str, Any], list[str]]:
    """One planted mistake's row of the report, and the problems it leaves."""
    mistake = MISTAKES[name]
    if not mistake.by_knob:
        ok, why = True, f"runs in {report.fixed_peak_mib:.1f} of {report.memory_mib:.1f} MiB per rank"
    elif mistake.planted_in(fixed):
        ok, why = False, f"the fixed job still plants it ({mistake.fix})"
    elif name in seen:
        ok, why = False, f"the knob is fixed, but the trace still shows it: {seen[name].evidence}"
    else:
        ok, why = True, "its knob is fixed and the trace no longer shows it"
    problems = (
        [] if name in named else [f"{name} was planted and not named in found: measure it ({mistake.shows})"]
    )
    if not ok:
        problems.append(f"{name} is not fixed: {why}")
    return {"mistake": name, "found": name in named, "fixed": ok, "evidence": why}, problems


def _out_of_memory(
    cap: Capstone, named: set[str], fixed: TrainingJob, report: CapstoneReport, err: RankError
) -> AssertionError:
    for m in cap.planted:
        evidence = "the fixed job does not run: OOM" if m == "oom_batch" else "not measured"
        report.rows.append({"mistake": m, "found": m in named, "fixed": False, "evidence": evidence})
    if "oom_batch" in named and fixed.micro_batch == cap.job.micro_batch:
        # the learner fixed the memory, then a later fix started again from cap.job (issue 27)
        what = (
            f"micro_batch is back to the job as handed's {cap.job.micro_batch}, though oom_batch is in "
            "found: a fix after the memory fix undid it (does fix() start again from cap.job instead of "
            "the job it is given?)"
        )
    else:
        what = MISTAKES["oom_batch"].fix
    report.problems.append(
        f"the fixed job runs out of memory ({cap.memory_mib:.1f} MiB per rank): {what}. The error: "
        f"{str(err).splitlines()[0]}"
    )
    return AssertionError(str(report))


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
    named = set(found)
    unknown = sorted(named - set(DEALT))
    if unknown:
        raise ValueError(
            f"found={sorted(named)}: {unknown} are not capstone mistakes; name them from {DEALT}"
        )
    if not isinstance(fixed, TrainingJob):
        raise ValueError(
            f"fixed={fixed!r}: pass the fixed TrainingJob, e.g. dataclasses.replace(cap.job, ...)"
        )
    the_cluster = Cluster.resolve(cluster, cap.world_size)
    report = CapstoneReport([], [], the_cluster.label, memory_mib=cap.memory_mib)
    if fixed.global_batch != cap.job.global_batch:
        report.problems.append(
            f"global_batch is {fixed.global_batch}, the job's is {cap.job.global_batch}: the batch the "
            "optimizer sees is the job's contract (its learning rate was tuned for it). Keep it; change "
            "micro_batch, and accumulation makes up the rest"
        )
    trace_dir = Path(trace_dir or tempfile.mkdtemp(prefix="capstone_check_"))
    try:
        per_rank = launch(
            train,
            cap,
            [cap.clean, fixed],
            str(trace_dir),
            steps=3,  # a median of 3 ignores one slow step of the host; a median of 2 is a mean
            world_size=cap.world_size,
            cluster=the_cluster,
            timeout_s=timeout_s,
            deadline_s=timeout_s * 3,
        )
    except RankError as err:
        if not isinstance(err.__cause__, torch.OutOfMemoryError):
            raise
        raise _out_of_memory(cap, named, fixed, report, err) from None
    clean: list[JobResult] = [rank[0] for rank in per_rank]
    mine: list[JobResult] = [rank[1] for rank in per_rank]
    report.fixed_ms, report.clean_ms = step_ms(mine), step_ms(clean)
    report.spread_ms = step_spread_ms(mine, clean)
    report.fixed_peak_mib = max(r.peak_mib for r in mine)
    report.clean_peak_mib = max(r.peak_mib for r in clean)
    report.findings = findings(Path(mine[0].traces))
    seen = {m.name: d for d in report.findings if (m := by_diagnosis(d.kind)) is not None}
    for name in cap.planted:
        row, problems = _row(name, named, fixed, seen, report)
        report.rows.append(row)
        report.problems.extend(problems)
    report.problems += [
        f"{m} is in found but was not planted: which measurement pointed to it?"
        for m in sorted(named - set(cap.planted))
    ]
    report.problems += [
        f"the fix brought in {m}: {d.evidence}" for m, d in seen.items() if m not in cap.planted
    ]
    report.problems += [
        f"the fixed job plants {m} ({MISTAKES[m].fix})"
        for m in sorted(planted_by_knobs(fixed) - set(cap.planted) - set(seen))
    ]
    if report.fixed_ms > SLOWER_OK * report.clean_ms:
        slow = " (activation checkpointing recomputes the forward in backward)" if fixed.checkpointing else ""
        report.problems.append(
            f"the fixed job's step is {report.fixed_ms:.1f} ms, {report.fixed_ms / report.clean_ms:.2f}x the "
            f"clean job's {report.clean_ms:.1f} ms (at most {SLOWER_OK}x){slow}"
        )
    if report.problems:
        raise AssertionError(str(report))
    return report
