"""Showing questions: an ipywidgets quiz in JupyterLab, plain text where widgets cannot render, a terminal
loop.

`show(topic=None, seed=0, n=None)` renders widgets when it runs in a Jupyter kernel that a browser is
looking at, and the plain-text form otherwise (`labkit.course.widgets.widgets_can_render`: a terminal, or
papermill under `labkit run`, which sets `LABKIT_TEXT_ONLY=1` for the kernel). The text form prints the
questions, then the answers with their explanations, so an executed notebook is a worksheet with its key.
`mock_exam(n, seed, minutes)` is the timed exam over every topic, scored by topic (widgets: an answer after
the time limit no longer counts). `question_lines(q, number)` is one question as text, as the text form and
`labkit quiz`'s terminal loop (`labkit.course.quiz.terminal`) print it.
"""

from __future__ import annotations

import time

from labkit.course.quiz.bank import TOPICS, Question, bank, exam, grade, score
from labkit.course.quiz.scope import SCOPE
from labkit.course.widgets import displayed, widgets_can_render

__all__ = ["mock_exam", "question_lines", "show", "text_form"]


def question_lines(q: Question, number: int) -> list[str]:
    """Question `number` as text lines: its topic and text, then the lettered choices or what to give."""
    lines = [f"Q{number} [{q.topic}] {q.text}"]
    if q.kind == "choice":
        lines += [f"   {chr(ord('a') + i)}) {c}" for i, c in enumerate(q.choices)]
    else:
        lines.append(
            f"   (a number, in {q.unit}; within {q.tolerance:.0%})"
            if q.tolerance
            else f"   (a whole number of {q.unit})"
        )
    return lines


def text_form(questions: list[Question]) -> str:
    """The questions, then the key: each answer, its explanation and where the course teaches it."""
    lines = []
    for i, q in enumerate(questions, 1):
        lines += [*question_lines(q, i), ""]
    lines.append("Answers")
    for i, q in enumerate(questions, 1):
        lines.append(f"Q{i}: {q.correct}. {q.explanation} (See {q.where}.)")
    return "\n".join(lines)


def show(topic: str | None = None, seed: int = 0, n: int | None = None, widgets: bool | None = None):
    """The bank's questions (of one topic) as a quiz: widgets in JupyterLab (displayed), else the text form
    (printed). Returns the widget, or the text."""
    questions = bank(topic, seed)[:n]
    if not (widgets_can_render() if widgets is None else widgets):
        text = text_form(questions)
        print(text)
        return text
    return displayed(_quiz_widget(questions))


def mock_exam(n: int = 20, seed: int = 0, minutes: float = 30.0, widgets: bool | None = None):
    """A timed mock exam over every topic, scored by topic: widgets in JupyterLab, else the text form."""
    questions = exam(n, seed)
    if not (widgets_can_render() if widgets is None else widgets):
        head = f"Mock exam: {n} questions, {minutes:g} minutes, topics: {', '.join(TOPICS)}\n{SCOPE}\n\n"
        text = head + text_form(questions)
        print(text)
        return text
    return displayed(_quiz_widget(questions, minutes=minutes, scope=SCOPE))


def _quiz_widget(questions: list[Question], minutes: float | None = None, scope: str = ""):
    """One box per question (choices or a number, a check button, feedback), and the score by topic."""
    import ipywidgets as w

    answered: dict[int, bool] = {}
    total = w.HTML(f"<b>score: 0/{len(questions)}</b>")
    start = time.monotonic()

    def update() -> None:
        scores = score([(questions[i], ok) for i, ok in answered.items()])
        per = ", ".join(f"{t} {r}/{a}" for t, (r, a) in scores.items() if t != "all")
        total.value = f"<b>score: {sum(answered.values())}/{len(questions)}</b> {per}"

    boxes = []
    for i, q in enumerate(questions):
        if q.kind == "choice":
            entry = w.RadioButtons(
                options=[(c, k) for k, c in enumerate(q.choices)], value=None, layout=w.Layout(width="auto")
            )
        else:
            entry = w.Text(placeholder=f"a number, in {q.unit}")
        button = w.Button(description="Check", button_style="primary")
        feedback = w.HTML()

        def check(_, i=i, q=q, entry=entry, feedback=feedback, button=button) -> None:
            if minutes is not None and time.monotonic() - start > minutes * 60:
                feedback.value = f"<i>time is up ({minutes:g} min)</i>"
                return
            ok, text = grade(q, entry.value)
            answered.setdefault(i, ok)  # the first answer counts
            feedback.value = f"<span style='color:{'green' if ok else 'firebrick'}'>{text}</span>"
            button.disabled = True
            update()

        button.on_click(check)
        boxes.append(
            w.VBox([w.HTML(f"<b>Q{i + 1}</b> <i>[{q.topic}]</i> {q.text}"), entry, button, feedback])
        )
    header = (
        [w.HTML(f"<b>Mock exam</b>: {len(questions)} questions, {minutes:g} minutes from now"), w.HTML(scope)]
        if minutes
        else []
    )
    return w.VBox(header + boxes + [total])
