"""`labkit quiz` in a terminal: practice with feedback at once, or a timed mock exam reviewed at the end.

`run_terminal(questions, ask=input, say=print, minutes=None, clock=time.monotonic)` asks each question in
turn. An answer is a letter shown (or an option's text) for a multiple-choice question, a number (its unit
may follow) for a numeric one; anything else is not marked: the loop says why in one line and asks again.
An empty line skips the question, as the prompt says, and counts as not right. EOF and Ctrl-C propagate
(EOFError, KeyboardInterrupt), so that the caller can stop cleanly.

Without `minutes` it is practice: each answer is graded at once, with its explanation. With `minutes` it is
a mock exam: the time limit and the number of questions first, the time left before each question, no
answers until the end; an answer given after the limit does not count and ends the exam. Then the score by
topic and every question's answer and explanation. `clock` (seconds, monotonic) is injected so that tests
need no sleeping.

`command_questions(topic, exam_n, seed, minutes)` checks `labkit quiz`'s options and returns its questions;
its errors write the fix as the command to type.
"""

from __future__ import annotations

import difflib
import math
import threading
import time
from collections.abc import Callable

from labkit.course.quiz.bank import TOPICS, Question, bank, exam, exam_questions, grade, score
from labkit.course.quiz.scope import SCOPE
from labkit.course.quiz.show import question_lines

__all__ = ["EXAM_MINUTES", "command_questions", "read_answer", "run_terminal"]

EXAM_MINUTES = 30.0  # a mock exam's time limit unless --minutes says otherwise

_Answer = int | float | None  # a choice's index, a number, or None: skipped


def _letters(q: Question) -> list[str]:
    return [chr(ord("a") + i) for i in range(len(q.choices))]


def _accepted(q: Question) -> str:
    """What the prompt accepts for `q`, in words."""
    if q.kind == "choice":
        letters = _letters(q)
        return f"a letter {letters[0]}-{letters[-1]} or an option's text"
    return f"a number, in {q.unit}" if q.unit else "a number"


def read_answer(q: Question, raw: str) -> _Answer:
    """The answer typed for `q`: a choice's index (from a letter shown, or an option's text, any case), a
    number (a numeric question; its unit may follow), or None for an empty line (skip).

    Raises ValueError saying in one line why `raw` is not an answer and what is accepted."""
    text = raw.strip()
    if not text:
        return None
    if q.kind == "choice":
        letters = _letters(q)
        key = text.lower().strip("().")  # "b", "B", "b)" and "(b)" all mean b
        if key in letters:
            return letters.index(key)
        for i, choice in enumerate(q.choices):
            if text.casefold() == choice.casefold():
                return i
        raise ValueError(f"{text!r} is not one of the choices: type {_accepted(q)}")
    example = "4" if q.tolerance == 0 else "12.5"  # a whole number where only one is right
    number = text
    if q.unit and number.lower().endswith(q.unit.lower()):  # "12.5 GiB", "40%"
        number = number[: -len(q.unit)].strip()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a number: type {_accepted(q)}, e.g. {example}") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number: type {_accepted(q)}, e.g. {example}")
    return value


def _ask(
    q: Question, ask: Callable[[str], str], say: Callable[[str], None], late: Callable[[], bool]
) -> tuple[_Answer, bool]:
    """(the answer, given in time?): asks until the input is an answer (or a skip). `late()` is checked after
    every input, so an exam ends on the first input after its limit, valid or not."""
    prompt = f"your answer ({_accepted(q)}; Enter skips): "
    while True:
        raw = ask(prompt)
        if late():
            return None, False
        try:
            return read_answer(q, raw), True
        except ValueError as why:
            say(f"{why} (not marked; asking again)")


def _graded(q: Question, answer: _Answer) -> tuple[bool, str]:
    """(right?, feedback) for an answer or a skip."""
    if answer is None:
        return False, f"Skipped: the answer is {q.correct}. {q.explanation} (See {q.where}.)"
    return grade(q, answer)


def _mmss(seconds: float) -> str:
    s = max(0, math.ceil(seconds))  # rounded up: "0:00" only once no time is left
    return f"{s // 60}:{s % 60:02d}"


def run_terminal(
    questions: list[Question],
    ask: Callable[[str], str] = input,
    say: Callable[[str], None] = print,
    minutes: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, tuple[int, int]]:
    """Ask each question and print the score by topic; returns it (topic and "all": (right, asked)).

    Practice (no `minutes`): feedback after each answer. Mock exam (`minutes`): time left before each
    question, nothing graded until the end, then the score by topic and each question's answer and
    explanation; questions left when the time runs out count as wrong."""
    if minutes is None:
        results, review = _practice(questions, ask, say), ""
    else:
        results, review = _review(questions, _exam(questions, ask, say, minutes, clock))
    scores = score(results)
    say(_score_lines(scores))
    if review:
        say(review)
    return scores


def _practice(
    questions: list[Question], ask: Callable[[str], str], say: Callable[[str], None]
) -> list[tuple[Question, bool]]:
    """Each question, its answer graded and explained at once."""
    results = []
    for i, q in enumerate(questions, 1):
        say("\n".join(question_lines(q, i)))
        answer, _ = _ask(q, ask, say, late=lambda: False)
        ok, feedback = _graded(q, answer)
        say(feedback + "\n")
        results.append((q, ok))
    return results


def _exam(
    questions: list[Question],
    ask: Callable[[str], str],
    say: Callable[[str], None],
    minutes: float,
    clock: Callable[[], float],
) -> dict[int, _Answer]:
    """The answers given in time, by question index (absent: not reached, or answered after the limit);
    nothing is graded or explained here."""
    limit = minutes * 60
    say(
        f"Mock exam: {len(questions)} questions, time limit {_mmss(limit)} (min:s). "
        "Answers and explanations come at the end."
    )
    say(SCOPE)
    start = clock()

    def late() -> bool:
        return clock() - start > limit

    answers: dict[int, _Answer] = {}
    for i, q in enumerate(questions):
        if late():  # the limit passed between two questions
            say(f"time is up ({minutes:g} min).")
            break
        left = limit - (clock() - start)
        say(f"\n[time left {_mmss(left)} of {_mmss(limit)}]")
        say("\n".join(question_lines(q, i + 1)))
        # said the moment the limit passes, not only once an answer comes (input() blocks until then)
        alarm = threading.Timer(
            left,
            say,
            [f"\ntime is up ({minutes:g} min): press Enter for your score (an answer now is not counted)."],
        )
        alarm.daemon = True
        alarm.start()
        try:
            answer, in_time = _ask(q, ask, say, late)
        finally:
            alarm.cancel()
        if not in_time:
            say(f"time is up ({minutes:g} min): that answer came after the limit and is not counted.")
            break
        answers[i] = answer
    unanswered = len(questions) - len(answers)
    if unanswered:
        say(f"The exam has ended: {unanswered} question(s) unanswered count as wrong.\n")
    else:
        say("The exam has ended.\n")
    return answers


def _review(
    questions: list[Question], answers: dict[int, _Answer]
) -> tuple[list[tuple[Question, bool]], str]:
    """The exam graded: (question, right?) for the score, and the key: for every question what was given,
    the right answer and its explanation."""
    results, lines = [], ["", "Answers"]
    for i, q in enumerate(questions):
        if i not in answers:
            ok, given = False, "Not answered"
        elif answers[i] is None:
            ok, given = False, "Skipped"
        else:
            ok = grade(q, answers[i])[0]
            given = f"Your answer: {_given(q, answers[i])}, {'right' if ok else 'wrong'}"
        results.append((q, ok))
        key = f"{_letters(q)[int(q.answer)]}) {q.correct}" if q.kind == "choice" else q.correct
        lines.append(f"Q{i + 1} [{q.topic}] {given}. The answer: {key}. {q.explanation} (See {q.where}.)")
    return results, "\n".join(lines)


def _given(q: Question, answer: int | float) -> str:
    """An answer as the learner typed it: a choice's letter, or the number and its unit."""
    if q.kind == "choice":
        return _letters(q)[int(answer)]
    return f"{answer:g} {q.unit}".strip()


def _score_lines(scores: dict[str, tuple[int, int]]) -> str:
    rows = [f"{topic:<14} {right}/{asked}" for topic, (right, asked) in scores.items() if topic != "all"]
    right, asked = scores.get("all", (0, 0))
    return "\n".join(["score by topic:", *rows, f"{'all':<14} {right}/{asked} ({right / max(asked, 1):.0%})"])


def command_questions(
    topic: str | None = None, exam_n: int | None = None, seed: int = 0, minutes: float | None = None
) -> list[Question]:
    """`labkit quiz`'s questions: the bank (of `topic`), or a mock exam of `exam_n` questions.

    Raises ValueError, in one line, naming the option and its value, what it must be, and the command that
    works (`labkit quiz --topic memory`), for the command line to print."""
    if seed < 0:
        raise ValueError(f"--seed {seed} must be a whole number >= 0; e.g. labkit quiz --seed 0")
    if exam_n is None and minutes is not None:
        raise ValueError(
            f"--minutes {minutes:g} is a mock exam's time limit, and practice has none: add --exam N, "
            f"e.g. labkit quiz --exam 20 --minutes {minutes:g}"
        )
    if exam_n is not None:
        minutes = EXAM_MINUTES if minutes is None else minutes
        size = len(exam_questions(seed=seed))
        if exam_n < 1:
            raise ValueError(
                f"--exam {exam_n} must be a number of questions from 1 to {size} (the bank's for exams); "
                f"e.g. labkit quiz --exam {min(20, size)}"
            )
        if exam_n > size:
            raise ValueError(
                f"--exam {exam_n} is more than the bank's {size} questions: use 1 to {size}; "
                f"e.g. labkit quiz --exam {size}"
            )
        if not (math.isfinite(minutes) and minutes > 0):
            raise ValueError(
                f"--minutes {minutes:g} must be a time limit above 0; "
                f"e.g. labkit quiz --exam {exam_n} --minutes 30"
            )
        return exam(exam_n, seed)
    if topic is not None and topic not in TOPICS:
        close = difflib.get_close_matches(topic.lower(), list(TOPICS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(
            f"--topic {topic} is not a topic{hint}: one of {', '.join(TOPICS)}; "
            f"e.g. labkit quiz --topic {close[0] if close else 'memory'}"
        )
    return bank(topic, seed)
