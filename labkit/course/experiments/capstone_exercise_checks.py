"""The capstone's two exercises checked on their own, before the end-to-end run (`capstone_checks`).

`check_fit_memory(fn, cap)` calls the learner's `fit_memory(job, model, memory_mib, world_size)` on budgets
built from `labkit.memory.estimate` so that each usual wrong rule (no headroom, the smallest micro-batch that
fits, one that does not divide the share, `keep_grads` ignored or always on, a world size of its own) answers
differently from the right one, and names the rule whose answers the learner's match. `check_fix(fn, cap)`
calls the learner's `fix(job, finding)` on small synthetic jobs, each planting one kind of mistake (or two, of
which the finding names one), with knobs that differ from both the job as handed and the clean one, so that a
fix that starts again from `cap.job` (undoing the memory fix) or copies `cap.clean` shows; the kinds are
planted whatever the learner's seed deals. Both refuse labkit's own answer (`own_answer.refusing`)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from labkit.course.experiments.capstone import MODEL, Capstone, _fit_memory, clean_job
from labkit.course.experiments.own_answer import Reference, names_used, refusing
from labkit.course.training.job import TrainingJob
from labkit.course.training.mistakes import MISTAKES, Mistake
from labkit.memory import estimate
from labkit.models import GPTConfig
from labkit.trace.diagnose import Diagnosis

__all__ = ["FIT_MEMORY_REFERENCE", "FIX_REFERENCE", "check_fit_memory", "check_fix"]

_MIB = 2**20
HEADROOM = 0.9  # the exercise's: fit within 90 % of the GPU's memory

FIT_MEMORY_REFERENCE = Reference(
    _fit_memory,
    "labkit.course.experiments.capstone._fit_memory",
    "loop over the divisors of the share yourself, largest first, with labkit.memory.estimate",
)
FIX_REFERENCE = Reference(
    Mistake.fixed,
    "labkit.course.training.MISTAKES[...].fixed",
    "set the one knob behind the finding with dataclasses.replace(job, knob=value), as the course taught",
)


# ------------------------------------------------------------------------------------------ exercise 1


def _need_mib(model: GPTConfig, m: int, keep_grads: bool) -> float:
    return (
        estimate(model=model, micro_batch=m, optimizer="adam", precision="fp32", keep_grads=keep_grads).peak
        / _MIB
    )


def _largest(
    job: TrainingJob,
    model: GPTConfig,
    memory_mib: float,
    world_size: int,
    *,
    headroom: float = HEADROOM,
    keep: Callable[[int, int], bool] = lambda m, share: m < share,
    candidates: Callable[[int], list[int]] = lambda share: [d for d in range(share, 0, -1) if share % d == 0],
) -> int | None:
    """The micro-batch a rule picks: the first of `candidates(share)` whose estimate (`keep` deciding
    keep_grads) fits `headroom` of the memory; None when none does (the right rule raises ValueError)."""
    share = job.global_batch // world_size
    for m in candidates(share):
        if _need_mib(model, m, keep(m, share)) <= headroom * memory_mib:
            return m
    return None


@dataclass(frozen=True)
class _Budget:
    """One call of fit_memory: a job (its micro-batch the whole share, as planted), a model, a memory and
    ranks."""

    what: str
    job: TrainingJob
    model: GPTConfig
    memory_mib: float
    world_size: int

    @property
    def share(self) -> int:
        return self.job.global_batch // self.world_size

    def call(self) -> str:
        return (
            f"fit_memory(global_batch={self.job.global_batch} on world_size={self.world_size} (a share of "
            f"{self.share} per rank), memory_mib={self.memory_mib:.2f}) [{self.what}]"
        )

    def table(self) -> str:
        """Each divisor's estimate, as the exercise asks for it."""
        rows = [
            f"{m}: {_need_mib(self.model, m, m < self.share):.2f}"
            for m in range(self.share, 0, -1)
            if self.share % m == 0
        ]
        return (
            f"estimates in MiB by micro-batch, keep_grads below the share, against 90 % of memory_mib = "
            f"{HEADROOM * self.memory_mib:.2f}: " + ", ".join(rows)
        )


def _budgets(cap: Capstone) -> list[_Budget]:
    """Budgets on which each wrong rule of `_RULES` answers differently from the right one (the capstone's
    own model and memory last)."""

    def job(global_batch: int, world_size: int) -> TrainingJob:
        base = clean_job(world_size)
        return dataclasses.replace(base, global_batch=global_batch, micro_batch=global_batch // world_size)

    def e(m: int, keep: bool) -> float:
        return _need_mib(MODEL, m, keep)

    return [
        _Budget("micro-batch 4 fits in 90 %, 8 does not", job(16, 2), MODEL, e(4, True) / HEADROOM * 1.01, 2),
        _Budget("micro-batch 4 fits only without headroom", job(16, 2), MODEL, e(4, True) / 0.95, 2),
        _Budget(
            "micro-batch 2 fits only without its kept gradients",
            job(16, 2),
            MODEL,
            (e(2, False) / HEADROOM + e(2, True)) / 2,
            2,
        ),
        _Budget(
            "5 fits, 6 does not, and 5 does not divide 12",
            job(24, 2),
            MODEL,
            (e(5, True) + e(6, True)) / 2 / HEADROOM,
            2,
        ),
        _Budget("one micro-batch of 4 fits on 4 ranks", job(16, 4), MODEL, e(4, False) / HEADROOM * 1.05, 4),
        _Budget(
            "one micro-batch of 4 fits, nothing accumulates",
            job(8, 2),
            MODEL,
            e(4, False) / HEADROOM * 1.05,
            2,
        ),
        _Budget("not even one sequence fits", job(16, 2), MODEL, e(1, True) / 2, 2),
        _Budget("the capstone's own job", cap.job, cap.model, cap.memory_mib, cap.world_size),
    ]


# Each wrong rule: what it answers for a budget, and what the hint says of it.
_RULES: dict[str, tuple[Callable[[_Budget], int | None], str]] = {
    "no headroom": (
        lambda b: _largest(b.job, b.model, b.memory_mib, b.world_size, headroom=1.0),
        "it fits the estimate in all of memory_mib, with no headroom. The estimate leaves out the "
        "evaluation's and the logging's buffers and the allocator's rounding: fit within 90 % of memory_mib",
    ),
    "smallest": (
        lambda b: _largest(
            b.job,
            b.model,
            b.memory_mib,
            b.world_size,
            candidates=lambda s: [d for d in range(1, s + 1) if s % d == 0],
        ),
        "it returns the smallest micro-batch that fits, not the largest: each extra micro-batch is one more "
        "smaller pass through the model, slower on the same work. Try the divisors largest first",
    ),
    "not a divisor": (
        lambda b: _largest(
            b.job, b.model, b.memory_mib, b.world_size, candidates=lambda s: list(range(s, 0, -1))
        ),
        "its micro-batch does not divide the rank's share of the global batch, so the accumulation steps "
        "(share / micro_batch) are not whole: try only the divisors of the share",
    ),
    "keep_grads ignored": (
        lambda b: _largest(b.job, b.model, b.memory_mib, b.world_size, keep=lambda m, s: False),
        "it leaves out keep_grads: while it accumulates (micro_batch < share) the gradients live beside the "
        "next micro-batch's activations; estimate(..., keep_grads=m < share)",
    ),
    "keep_grads always": (
        lambda b: _largest(b.job, b.model, b.memory_mib, b.world_size, keep=lambda m, s: True),
        "it keeps the gradients even with one micro-batch per step (micro_batch == share), when nothing "
        "accumulates and backward's gradients are the last thing made: keep_grads=m < share",
    ),
    "its own world size": (
        lambda b: _largest(b.job, b.model, b.memory_mib, 2),
        "it takes a rank's share with a world size of its own (p.world_size or 2?), not the world_size it is "
        "given: share = job.global_batch // world_size",
    ),
}


def _outcome(fn: Callable[..., Any], b: _Budget) -> Any:
    """What `fn` gave for budget `b`: its job, or the ValueError it raised."""
    with refusing(fn, [FIT_MEMORY_REFERENCE]):
        try:
            return fn(b.job, b.model, b.memory_mib, b.world_size)
        except ValueError as err:
            return err


def _answer(b: _Budget, got: Any) -> int | None:
    """The micro-batch of the job `fn` returned for `b` (None for a ValueError), or AssertionError when it
    is not the job with only its micro-batch changed."""
    if isinstance(got, ValueError):
        return None
    if not isinstance(got, TrainingJob):
        raise AssertionError(f"{b.call()} returned {got!r}: return the job, dataclasses.replace(job, ...)")
    if got.global_batch != b.job.global_batch:
        raise AssertionError(
            f"{b.call()} changed global_batch to {got.global_batch}: it is the job's contract (the "
            "learning rate was tuned for it); change micro_batch only, accumulation makes up the rest"
        )
    changed = [
        f.name
        for f in dataclasses.fields(TrainingJob)
        if f.name != "micro_batch" and getattr(got, f.name) != getattr(b.job, f.name)
    ]
    if changed:
        raise AssertionError(f"{b.call()} changed {', '.join(changed)}: change micro_batch only")
    return got.micro_batch


def _named_rule(b: _Budget, answer: int, budgets: list[_Budget], answers: list[int | None]) -> str:
    """The wrong rule behind `answer` for `b`: the one that answers every budget as the learner did, else
    one that answers `b` so."""
    if answer == b.share and _RULES["no headroom"][0](b) != answer:
        return (
            "it returns the whole share, which does not fit: is a unit mixed up? estimate(...).peak is in "
            "bytes: compare it with memory_mib * 2**20"
        )
    same = [hint for rule, hint in _RULES.values() if [rule(x) for x in budgets] == answers]
    near = [hint for rule, hint in _RULES.values() if rule(b) == answer]
    return (same or near or [f"try the divisors of {b.share}, largest first; keep the first that fits"])[0]


def check_fit_memory(fn: Callable[..., TrainingJob], cap: Capstone) -> int:
    """Lab 06, exercise 1: `fn(job, model, memory_mib, world_size)` returns `job` with the largest
    micro-batch that divides the rank's share of the global batch and whose `estimate` (keep_grads while it
    accumulates) fits 90 % of memory_mib, nothing else changed; ValueError when none fits. AssertionError
    naming the rule that failed; returns the budgets checked."""
    budgets = _budgets(cap)
    outcomes = [_outcome(fn, b) for b in budgets]
    answers = [_answer(b, got) for b, got in zip(budgets, outcomes, strict=True)]
    for b, got, answer in zip(budgets, outcomes, answers, strict=True):
        right = _largest(b.job, b.model, b.memory_mib, b.world_size)
        if answer == right:
            continue
        if right is None:
            raise AssertionError(
                f"{b.call()} returned micro_batch {answer}, but not even one sequence fits ({b.table()}): "
                "raise ValueError saying so, with what to try next (checkpointing, bf16, sharding)"
            )
        if answer is None:
            raise AssertionError(
                f"{b.call()} raised ValueError ({got}), but micro-batch {right} fits ({b.table()}). Is a "
                "unit mixed up? estimate(...).peak is in bytes: compare it with memory_mib * 2**20"
            )
        raise AssertionError(
            f"{b.call()} returned micro_batch {answer}, expected {right}: "
            f"{_named_rule(b, answer, budgets, answers)}. ({b.table()})"
        )
    return len(budgets)


# ------------------------------------------------------------------------------------------ exercise 2

# The finding each mistake shows as, and the knob values a right fix may set.
_KINDS = {m.diagnosed_as: m for m in MISTAKES.values() if m.diagnosed_as and m.name != "host_sync"}
_RIGHT = {"grad_sync": ("ddp", "overlapped")}


_SYNTHETIC = ("micro_batch", "lr", "seed", "bucket_cap_mb")  # the knobs _synthetic sets


def _synthetic(cap: Capstone) -> TrainingJob:
    """The clean job with knobs a learner's job may have by the time it is fixed (a memory fix's
    micro-batch, its own lr, seed and buckets), all different from the job as handed and the clean one."""
    base = clean_job(cap.world_size)

    def differ(choices: tuple[Any, ...], *others: Any) -> Any:
        return next(x for x in choices if all(x != o for o in others))

    return dataclasses.replace(
        base,
        micro_batch=differ((2, 1), cap.job.micro_batch, base.micro_batch),
        lr=differ((1e-3, 5e-4), cap.job.lr, base.lr),
        seed=differ((7, 8), cap.job.seed, base.seed),
        bucket_cap_mb=differ((4.0, 2.0), cap.job.bucket_cap_mb, base.bucket_cap_mb),
    )


def _cases(cap: Capstone) -> list[tuple[TrainingJob, Diagnosis, Mistake, Mistake | None]]:
    """(planted job, its finding, the mistake it points to, a second mistake planted beside it or None):
    each kind alone, then each with another planted that the finding does not point to."""
    base, rng = _synthetic(cap), random.Random(2027)
    cases = []
    mistakes = list(_KINDS.values())
    for i, m in enumerate(mistakes):
        job = m.plant(base, cap.world_size, rng)
        rank = job.eval_rank if m.name == "straggler" else None
        cases.append((job, Diagnosis(m.diagnosed_as, rank, f"{m.shows} (a job of the check's)", []), m, None))
        other = mistakes[(i + 1) % len(mistakes)]
        both = other.plant(job, cap.world_size, rng)
        cases.append(
            (both, Diagnosis(m.diagnosed_as, rank, f"{m.shows} (a job of the check's)", []), m, other)
        )
    return cases


def _reads_the_key(fn: Callable[..., Any]) -> str | None:
    """What `fn` reads that the exercise must not: the capstone's answer key, or the course's fixes."""
    names = names_used(fn)
    if names & {"planted", "clean"}:
        return (
            f"{getattr(fn, '__name__', 'fix')}() reads cap.{sorted(names & {'planted', 'clean'})[0]}, the "
            "answer key: fix what the finding names, from the job you are given"
        )
    if "right" in names and names & {"MISTAKES", "by_diagnosis"}:
        return (
            f"{getattr(fn, '__name__', 'fix')}() reads the right values from "
            "labkit.course.training.MISTAKES, the course's answer table: write each kind's knob and value "
            "yourself"
        )
    return None


def check_fix(fn: Callable[[TrainingJob, Diagnosis], TrainingJob], cap: Capstone) -> int:
    """Lab 06, exercise 2: `fn(job, finding)` returns `job` with the knob behind `finding.kind` set the
    way the course taught and nothing else changed, for each kind a capstone deals (whatever `cap`'s seed
    planted). AssertionError naming the mistake; returns the cases checked."""
    if (why := _reads_the_key(fn)) is not None:
        raise AssertionError(why)
    cases = _cases(cap)
    for job, finding, mistake, other in cases:
        with refusing(fn, [FIX_REFERENCE]):
            got = fn(job, finding)
        call = f"fix(job, Diagnosis(kind={finding.kind!r}, rank={finding.rank}))"
        if not isinstance(got, TrainingJob):
            raise AssertionError(
                f"{call} returned {got!r}: return the fixed TrainingJob, dataclasses.replace(job, ...)"
            )
        knobs = {mistake.knob} | ({"eval_samples"} if mistake.name == "straggler" else set())
        if got == cap.clean:
            raise AssertionError(f"{call} returned cap.clean, the answer key: fix the job you are given")
        changed = [
            f.name
            for f in dataclasses.fields(TrainingJob)
            if f.name not in knobs and getattr(got, f.name) != getattr(job, f.name)
        ]
        if changed:
            raise AssertionError(f"{call}: {_why_changed(got, job, cap, changed, other, mistake)}")
        if got == job:
            raise AssertionError(
                f"{call} returned the job unchanged. The finding measured that {mistake.shows}. Which of "
                "the job's knobs makes that? print(job) shows them; section 1's table says what each sets"
            )
        _check_knob(call, got, job, mistake)
    return len(cases)


def _why_changed(
    got: TrainingJob,
    job: TrainingJob,
    cap: Capstone,
    changed: list[str],
    other: Mistake | None,
    mistake: Mistake,
) -> str:
    """Why knobs the finding does not point to changed: a second mistake fixed too, a fresh start from
    cap.job, the clean job copied, or just changed; `mistake`: the one the finding does point to."""
    was = ", ".join(f"{k} {getattr(job, k)!r} -> {getattr(got, k)!r}" for k in changed)
    if other is not None and other.knob in changed and not other.planted_in(got):
        return (
            f"it also fixed {other.name} ({was}), which this finding does not point to: one fix per "
            "finding, then measure again (the next finding will name it, if it still costs anything)"
        )
    # the check's job differs from both of cap's in these knobs: matching one of them says where it came from
    telling = [k for k in changed if k in _SYNTHETIC]
    if telling and all(getattr(got, k) == getattr(cap.job, k) for k in changed):
        undone = " (micro_batch is the memory fix)" if "micro_batch" in changed else ""
        return (
            f"it changed {was}, back to the job as handed: it starts again from cap.job instead of the job "
            f"it is given, which undoes every fix made before it{undone}. Use dataclasses.replace(job, ...) "
            "on the job passed in"
        )
    if telling and all(getattr(got, k) == getattr(cap.clean, k) for k in changed):
        return f"it changed {was}, to the clean job's values: cap.clean is the answer key; fix the job given"
    # the evidence first (choosing the knob from the measurement is the exercise), then the knob (issue 44)
    knobs = [mistake.knob] + (["eval_samples"] if mistake.name == "straggler" else [])
    behind = " and ".join(f"job.{k} (now {getattr(job, k)!r})" for k in knobs)
    return (
        f"it changed {was}, which does not make what this finding measured ({mistake.shows}): put it back; "
        f"the knob that makes it is {behind}"
    )


def _check_knob(call: str, got: TrainingJob, job: TrainingJob, mistake: Mistake) -> None:
    """AssertionError unless `got` no longer plants `mistake`, fixed the course's way."""
    if mistake.name == "straggler":
        if got.eval_samples != job.eval_samples:
            raise AssertionError(
                f"{call} set eval_samples to {got.eval_samples}: the held-out evaluation is part of the job; "
                "share it out instead (eval_rank=None: every rank evaluates its part)"
            )
        if got.eval_rank is not None:
            raise AssertionError(
                f"{call} moved the whole evaluation from rank {job.eval_rank} to rank {got.eval_rank}: one "
                "rank still evaluates all of it while the others wait. eval_rank=None shares it out"
            )
        return
    value = getattr(got, mistake.knob)
    if value not in _RIGHT.get(mistake.knob, (mistake.right,)):
        raise AssertionError(
            f"{call} left {mistake.knob}={value!r}"
            + (" (unchanged)" if value == getattr(job, mistake.knob) else "")
            + f": {mistake.fix}"
        )
