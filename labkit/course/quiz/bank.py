"""The question bank: multiple-choice questions kept as data, numeric ones generated from labkit's formulas.

The multiple-choice questions are `questions.json` in this package: a list of objects with `id` (kebab-case,
starting with its topic), `topic` (one of `TOPICS`), `text`, `choices` (3 to 5, exactly one right, never
"all of the above"), `answer` (the right choice's index), `explanation` (why, naming the paper or document a
fact comes from), `reference` (the lab notebook's stem) and `section` (the start of a heading in it), and
`practice: true` on a question about how this course's own code works, which no exam asks: the labs' quizzes
keep it, the mock exam leaves it out. They
are about what holds on real GPUs (NCCL, CUDA, PyTorch), not the emulated cluster's modelling choices;
arithmetic is left to the generators.

`Question` is one question; `bank(topic=None, seed=0)` returns the multiple-choice questions
and one fresh instance of every numeric generator (`labkit.course.quiz.generated`),
drawn with `seed`, so the same seed gives the same paper and another seed new numbers (and the choices of
each multiple-choice question in another order); `exam(n, seed)` a
mixed mock exam balanced over the topics; `grade(question, answer)` says whether an answer is right and
why; `score(results)` scores by topic. Every question points to the lab section that teaches it.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from importlib import resources

from labkit import validate
from labkit.course.quiz.generated import GENERATORS
from labkit.course.quiz.question import TOPICS, Question

__all__ = ["TOPICS", "Question", "bank", "choice_questions", "exam", "exam_questions", "grade", "score"]


def _choice(d: dict) -> Question:
    return Question(
        d["id"],
        d["topic"],
        "choice",
        d["text"],
        d["answer"],
        d["explanation"],
        d["reference"],
        d["section"],
        tuple(d["choices"]),
        practice=d.get("practice", False),
    )


def choice_questions() -> list[dict]:
    """The multiple-choice questions as stored (`questions.json`)."""
    stored = resources.files("labkit.course.quiz").joinpath("questions.json")
    return json.loads(stored.read_text(encoding="utf-8"))


def bank(topic: str | None = None, seed: int = 0) -> list[Question]:
    """Every multiple-choice question and one instance of each numeric generator (numbers drawn with
    `seed`), of one topic or all."""

    if topic is not None:
        validate.one_of("topic", topic, tuple(TOPICS), 'labkit.course.quiz.bank(topic="memory")')
    validate.non_negative_int("seed", seed, "labkit.course.quiz.bank(seed=0)")
    rng = random.Random(seed)
    questions = [_shuffled(_choice(d), seed) for d in choice_questions()] + [make(rng) for make in GENERATORS]
    return [q for q in questions if topic is None or q.topic == topic]


def _shuffled(question: Question, seed: int) -> Question:
    """`question` with its choices in an order drawn from (`seed`, its id), its `answer` following the key:
    where the key stands tells a learner nothing, and another seed gives another order."""
    order = list(range(len(question.choices)))
    random.Random(f"{seed}:{question.id}").shuffle(order)  # a str seed: the same order in every process
    choices = tuple(question.choices[i] for i in order)
    return replace(question, choices=choices, answer=order.index(int(question.answer)))


def exam_questions(topic: str | None = None, seed: int = 0) -> list[Question]:
    """`bank(topic, seed)` without the practice questions: what a mock exam draws from."""
    return [q for q in bank(topic, seed) if not q.practice]


def exam(n: int = 20, seed: int = 0) -> list[Question]:
    """A mock exam of `n` questions, taking the topics in turn (each topic's questions shuffled by `seed`)."""
    validate.positive_int("n", n, "labkit.course.quiz.exam(n=20)")
    rng = random.Random(seed)
    pools = {t: exam_questions(t, seed) for t in TOPICS}
    for pool in pools.values():
        rng.shuffle(pool)
    total = sum(len(p) for p in pools.values())
    if n > total:
        raise ValueError(f"n={n} is more than the bank's {total} questions: use n <= {total}")
    picked: list[Question] = []
    while len(picked) < n:
        for pool in pools.values():
            if pool and len(picked) < n:
                picked.append(pool.pop())
    rng.shuffle(picked)
    return picked


def grade(question: Question, answer: object) -> tuple[bool, str]:
    """(right?, feedback): the right answer, the explanation and where the course teaches it."""
    if question.kind == "choice":
        try:
            ok = int(answer) == int(question.answer)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            ok = answer == question.correct
    else:
        try:
            value = float(answer)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return (
                False,
                f"{answer!r} is not a number; the answer is {question.correct}. {question.explanation}",
            )
        ok = math.isclose(value, question.answer, rel_tol=question.tolerance, abs_tol=1e-12)
    verdict = "Right" if ok else f"Not quite: the answer is {question.correct}"
    slip = "" if ok or question.kind == "choice" else unit_slip(question, value)
    return ok, f"{verdict}.{slip} {question.explanation} (See {question.where}.)"


# A binary unit and its decimal twin: 1 GiB = 2**30 bytes = 1.0737 GB, 1 MiB = 1.0486 MB (IEC 80000-13).
_TWINS = {"GiB": ("GB", 2**30 / 1e9), "MiB": ("MB", 2**20 / 1e6), "GB/s": ("GiB/s", 1e9 / 2**30)}
_TWINS.update({other: (unit, 1 / factor) for unit, (other, factor) in list(_TWINS.items())})


def unit_slip(question: Question, value: float) -> str:
    """ " Your number is the answer in GB, not GiB (...)." where `value` is the answer in the unit's decimal
    (or binary) twin; "" otherwise."""
    if question.unit not in _TWINS:
        return ""
    other, factor = _TWINS[question.unit]
    if not math.isclose(value, question.answer * factor, rel_tol=max(question.tolerance, 1e-3)):
        return ""
    one = f"1 {question.unit} = {factor:.4g} {other}"
    return f" Your number is the answer in {other}, not {question.unit} ({one}): a unit slip."


def score(results: list[tuple[Question, bool]]) -> dict[str, tuple[int, int]]:
    """Per topic (and "all"): (right, asked)."""
    out: dict[str, tuple[int, int]] = {}
    for q, ok in results:
        for key in (q.topic, "all"):
            right, asked = out.get(key, (0, 0))
            out[key] = (right + int(ok), asked + 1)
    return out
