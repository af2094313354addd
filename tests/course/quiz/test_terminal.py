"""labkit.course.quiz.terminal: `labkit quiz`'s loop. An answer that is not one is asked again, not marked;
the mock exam shows its limit and the time left, ignores an answer after the limit and explains only at the
end; the command's errors write their fix as a command. The loop runs with fake input and a fake clock (no
sleeping); `labkit quiz` itself runs as a subprocess with piped stdin."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from labkit.course import quiz
from labkit.course.cli import main
from labkit.course.quiz.terminal import command_questions, read_answer


def _right(q: quiz.Question) -> str:
    """The right answer as a learner types it."""
    return chr(ord("a") + int(q.answer)) if q.kind == "choice" else repr(q.answer)


def _choice(topic: str = "pipeline") -> quiz.Question:
    return next(q for q in quiz.bank(topic) if q.kind == "choice")


def _numeric(topic: str = "pipeline") -> quiz.Question:
    return next(q for q in quiz.bank(topic) if q.kind == "numeric")


class _Session:
    """Scripted input and a fake monotonic clock: each answer is (seconds spent before typing it, text)."""

    def __init__(self, answers: list[tuple[float, str]]) -> None:
        self.now, self.answers, self.prompts, self.said = 1000.0, list(answers), [], []

    def clock(self) -> float:
        return self.now

    def ask(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.answers:
            raise EOFError
        spent, text = self.answers.pop(0)
        self.now += spent
        return text

    def say(self, text: str) -> None:
        self.said.append(text)

    @property
    def out(self) -> str:
        return "\n".join(self.said)


# ------------------------------------------------------------------ reading an answer


def test_read_answer_takes_a_letter_shown_or_an_options_text_or_a_number():
    q, n = _choice(), _numeric()
    right = int(q.answer)
    letter = chr(ord("a") + right)
    for typed in (letter, letter.upper(), f"{letter})", f"({letter})", f" {q.correct} "):
        assert read_answer(q, typed) == right, typed
    assert read_answer(q, q.correct.upper()) == right
    assert read_answer(n, "12.5") == 12.5 and read_answer(n, f"12.5 {n.unit}") == 12.5
    assert read_answer(q, "") is None and read_answer(n, "   ") is None  # an empty line: skip


@pytest.mark.parametrize("typed", ["x", "42", "1", "e", "ab", "the sum"])
def test_read_answer_refuses_what_is_not_one_of_the_choices_and_says_what_is(typed):
    q = _choice()
    assert len(q.choices) == 4
    with pytest.raises(ValueError, match=r"is not one of the choices: type a letter a-d or an option's text"):
        read_answer(q, typed)


@pytest.mark.parametrize("typed", ["a", "12,5", "lots", "nan", "inf"])
def test_read_answer_refuses_what_is_not_a_number_and_says_what_is(typed):
    n = _numeric()
    with pytest.raises(ValueError, match=rf"not a (finite )?number: type a number, in {n.unit}"):
        read_answer(n, typed)


# ------------------------------------------------------------------ practice


def test_an_invalid_answer_is_not_marked_and_asked_again():
    q, n = _choice(), _numeric()
    s = _Session([(0, "x"), (0, "42"), (0, _right(q)), (0, "a"), (0, _right(n))])
    scores = quiz.run_terminal([q, n], ask=s.ask, say=s.say)
    assert scores["all"] == (2, 2), s.out  # the typos cost nothing
    assert len(s.prompts) == 5 and not s.answers
    assert "'x' is not one of the choices" in s.out and "'a' is not a number" in s.out
    assert s.out.count("(not marked; asking again)") == 3
    assert s.out.count("Right.") == 2  # practice: feedback at once


def test_the_prompt_says_what_it_accepts_and_that_an_empty_line_skips():
    q = _choice()
    s = _Session([(0, "")])
    scores = quiz.run_terminal([q], ask=s.ask, say=s.say)
    assert s.prompts == ["your answer (a letter a-d or an option's text; Enter skips): "]
    assert scores["all"] == (0, 1) and f"Skipped: the answer is {q.correct}" in s.out
    s = _Session([(0, "")])
    quiz.run_terminal([_numeric()], ask=s.ask, say=s.say)
    assert s.prompts == ["your answer (a number, in %; Enter skips): "]


def test_end_of_input_stops_the_loop_for_the_caller():
    s = _Session([(0, "x")])  # then EOF, while asking again
    with pytest.raises(EOFError):
        quiz.run_terminal([_choice()], ask=s.ask, say=s.say)


# ------------------------------------------------------------------ the mock exam


def test_the_exam_shows_its_limit_and_the_time_left_and_explains_only_at_the_end():
    # a paper whose second question has choices (the "zz" below is not one of them)
    seed = next(s for s in range(50) if quiz.exam(3, seed=s)[1].kind == "choice")
    questions = quiz.exam(3, seed=seed)
    s = _Session([(90, _right(questions[0])), (30, "zz"), (15, ""), (60, _right(questions[2]))])
    scores = quiz.run_terminal(questions, ask=s.ask, say=s.say, minutes=10, clock=s.clock)
    out = s.out
    assert out.startswith("Mock exam: 3 questions, time limit 10:00 (min:s).")
    # before each question, the time left on the injected clock: 0 s, 90 s, then 135 s spent
    assert [line for line in s.said if line.startswith("\n[time left")] == [
        "\n[time left 10:00 of 10:00]",
        "\n[time left 8:30 of 10:00]",
        "\n[time left 7:45 of 10:00]",
    ]
    assert "'zz' is not one of the choices" in out  # asked again in the exam too
    during, _, after = out.partition("score by topic:")
    for q in questions:  # no explanation during the exam...
        assert q.explanation not in during
    assert "Right" not in during and "Not quite" not in during and "Skipped" not in during
    assert scores["all"] == (2, 3)
    key = after[after.index("\nAnswers\n") :]  # ...the score by topic, then every answer explained
    assert after.index("all ") < after.index("\nAnswers\n")
    for i, q in enumerate(questions, 1):
        assert f"Q{i} [{q.topic}]" in key and q.correct in key and q.explanation in key
    assert f"Q1 [{questions[0].topic}] Your answer: {_right(questions[0])}, right. The answer: " in key
    q2 = questions[1]
    assert f"Q2 [{q2.topic}] Skipped. The answer: {_right(q2)}) {q2.correct}." in key


def test_an_answer_after_the_limit_is_not_counted_and_ends_the_exam():
    questions = quiz.exam(3, seed=1)
    # the right answer to Q2, typed 2 minutes after the 5-minute limit ran out while Q2 was on screen
    s = _Session([(60, _right(questions[0])), (360, _right(questions[1])), (0, _right(questions[2]))])
    scores = quiz.run_terminal(questions, ask=s.ask, say=s.say, minutes=5, clock=s.clock)
    assert scores["all"] == (1, 3), s.out
    assert "time is up (5 min): that answer came after the limit and is not counted." in s.out
    assert "2 question(s) unanswered count as wrong" in s.out
    assert "Q3 [" not in s.out.split("score by topic:")[0]  # the exam ended: Q3 was never asked
    assert len(s.answers) == 1 and s.out.count("] Not answered. The answer: ") == 2


def test_time_up_is_said_while_the_learner_still_sits_on_a_question():
    """Issue 44: input() blocks, so the limit passing is said by a timer, before any answer comes."""
    questions = quiz.exam(2, seed=1)
    said: list[str] = []
    answered_after: list[int] = []

    def ask(prompt: str) -> str:  # the learner sits on Q1 past the 0.6 s limit, then answers
        for _ in range(200):  # up to 20 s: a loaded machine only delays the timer
            if any("time is up" in line for line in said):
                break
            time.sleep(0.1)
        answered_after.append(len(said))
        return _right(questions[0])

    quiz.run_terminal(questions, ask=ask, say=said.append, minutes=0.01)
    (at,) = answered_after
    assert any(line.startswith("\ntime is up (0.01 min): press Enter") for line in said[:at]), said
    assert "that answer came after the limit and is not counted" in "\n".join(said[at:])


def test_an_invalid_answer_after_the_limit_also_ends_the_exam():
    questions = quiz.exam(2, seed=1)
    s = _Session([(400, "nonsense"), (0, _right(questions[0]))])
    scores = quiz.run_terminal(questions, ask=s.ask, say=s.say, minutes=5, clock=s.clock)
    assert scores["all"] == (0, 2) and "not counted" in s.out and "asking again" not in s.out


# ------------------------------------------------------------------ the command's options


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--exam", "0"], ["--exam 0 must be a number of questions from 1 to", "e.g. labkit quiz --exam 20"]),
        (["--exam", "-2"], ["--exam -2 must be a number of questions from 1 to", "labkit quiz --exam 20"]),
        (["--exam", "1000"], ["--exam 1000 is more than the bank's", "questions: use 1 to"]),
        (
            ["--topic", "memroy"],
            ["--topic memroy is not a topic (did you mean memory?)", "e.g. labkit quiz --topic memory"],
        ),
        (["--topic", "Pipelines"], ["(did you mean pipeline?)", "labkit quiz --topic pipeline"]),
        (["--seed", "-1"], ["--seed -1 must be a whole number >= 0", "labkit quiz --seed 0"]),
        (["--exam", "5", "--minutes", "0"], ["--minutes 0 must be", "labkit quiz --exam 5 --minutes 30"]),
        # issue 44: --minutes without --exam was ignored silently
        (
            ["--minutes", "10"],
            ["--minutes 10 is a mock exam's time limit", "labkit quiz --exam 20 --minutes 10"],
        ),
    ],
)
def test_labkit_quiz_refuses_a_bad_option_in_one_line_with_the_command_that_works(argv, expected, capsys):
    assert main(["quiz", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("labkit quiz: "), err
    assert all(e in err for e in expected), err
    # a command, not Python
    assert "labkit.course.quiz" not in err and "bank(" not in err and "exam(" not in err


def test_the_exam_size_error_names_the_bank_size():
    size = len([q for q in quiz.bank() if not q.practice])  # practice questions are not exam ones
    with pytest.raises(ValueError, match=rf"more than the bank's {size} questions: use 1 to {size}"):
        command_questions(exam_n=size + 1)
    assert len(command_questions(exam_n=size)) == size
    with pytest.raises(ValueError, match="did you mean memory"):
        command_questions(topic="memroy")
    with pytest.raises(ValueError, match=r'labkit\.course\.quiz\.bank\(topic="memory"\)'):
        quiz.bank(topic="memroy")  # the Python API keeps the Python form


# ------------------------------------------------------------------ `labkit quiz` as a real subprocess


def _labkit_quiz(args: list[str], stdin: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "labkit.course.cli", "quiz", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_labkit_quiz_asks_again_after_an_invalid_answer(labkit_env):
    questions = quiz.bank("pipeline")  # choice and numeric questions; seed 0 as the command's default
    typed = "".join(("x\n42\n" if q.kind == "choice" else "a\n") + _right(q) + "\n" for q in questions)
    out = _labkit_quiz(["--topic", "pipeline"], typed, labkit_env)
    assert out.returncode == 0, out.stderr
    assert "'x' is not one of the choices: type a letter a-d or an option's text" in out.stdout
    assert "'a' is not a number: type a number, in %" in out.stdout
    n = len(questions)
    assert f"all            {n}/{n} (100%)" in out.stdout  # nothing was marked for the typos


def test_labkit_quiz_stops_cleanly_at_the_end_of_input(labkit_env):
    out = _labkit_quiz(["--topic", "pipeline"], "x\n", labkit_env)
    assert out.returncode == 1 and "labkit quiz: stopped" in out.stderr and "Traceback" not in out.stderr


def test_labkit_quiz_exam_shows_its_limit_and_time_left_and_the_key_at_the_end(labkit_env):
    questions = quiz.exam(3, seed=1)
    typed = "".join(_right(q) + "\n" for q in questions)
    out = _labkit_quiz(["--exam", "3", "--seed", "1", "--minutes", "45"], typed, labkit_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Mock exam: 3 questions, time limit 45:00 (min:s).")
    assert out.stdout.count("[time left ") == 3 and out.stdout.count(" of 45:00]") == 3
    during, _, after = out.stdout.partition("score by topic:")
    assert all(q.explanation not in during for q in questions) and "Right." not in during
    assert "all            3/3 (100%)" in after and all(q.explanation in after for q in questions)


def test_labkit_quiz_refuses_a_misspelt_topic_without_a_traceback(labkit_env):
    out = _labkit_quiz(["--topic", "memroy"], "", labkit_env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "labkit quiz: --topic memroy is not a topic (did you mean memory?): one of cluster, parallelism, "
        "memory, precision, communication, pipeline, profiling; e.g. labkit quiz --topic memory"
    ]
