"""labkit.course.quiz.show: the text form (as papermill and terminals show it), the terminal loop, and the
widget quiz driven by clicks."""

from __future__ import annotations

from labkit.course import quiz


def test_text_form_and_the_terminal_loop():
    questions = quiz.bank("pipeline")
    text = quiz.text_form(questions)
    assert "Answers" in text and all(q.correct in text for q in questions)
    answers = iter(["a" if q.kind == "choice" else str(q.answer) for q in questions])
    said: list[str] = []
    scores = quiz.run_terminal(questions, ask=lambda _: next(answers), say=said.append)
    assert scores["all"][1] == len(questions) and "score by topic" in said[-1]
    assert quiz.show("pipeline") == text  # LABKIT_TEXT_ONLY is set for the tests (conftest)


def test_the_widget_quiz_responds_to_answers():
    import ipywidgets as w

    questions = quiz.bank("memory")
    box = quiz.show("memory", widgets=True)
    assert isinstance(box, w.VBox) and len(box.children) == len(questions) + 1
    first, total = box.children[0], box.children[-1]
    _, entry, button, feedback = first.children
    q = questions[0]
    entry.value = int(q.answer) if q.kind == "choice" else str(q.answer)
    button.click()
    assert feedback.value and "Right" in feedback.value and button.disabled
    assert total.value.startswith("<b>score: 1/")
    exam = quiz.mock_exam(7, seed=2, minutes=20, widgets=True)
    assert "Mock exam" in exam.children[0].value
