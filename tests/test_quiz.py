"""The question bank: every question valid and pointing to a section that exists, generated answers equal to the
papers' formulas written out here, the same seed the same paper, grading, the text form, the widget quiz
driven by clicks, the terminal loop and `labkit quiz`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import quiz
from labkit.quiz.bank import TOPICS

ROOT = Path(__file__).resolve().parents[1]


def _headings(stem: str) -> list[str]:
    nb = json.loads((ROOT / "solutions" / f"{stem}.ipynb").read_text())
    return [
        line.lstrip("#").strip()
        for c in nb["cells"]
        if c["cell_type"] == "markdown"
        for line in "".join(c["source"]).splitlines()
        if line.startswith("#")
    ]


def test_at_least_40_valid_questions_over_every_topic():
    questions = quiz.bank()
    assert len(questions) >= 40
    assert len({q.id for q in questions}) == len(questions), "question ids must be unique"
    for topic in TOPICS:
        assert len([q for q in questions if q.topic == topic]) >= 4, (
            f"topic {topic} has fewer than 4 questions"
        )
    for q in questions:
        assert (
            q.topic in TOPICS and q.kind in ("choice", "numeric") and q.text.strip() and q.explanation.strip()
        )
        if q.kind == "choice":
            assert 3 <= len(q.choices) <= 5 and len(set(q.choices)) == len(q.choices), q.id
            assert float(q.answer).is_integer() and 0 <= q.answer < len(q.choices), q.id
        else:
            assert q.unit and math.isfinite(q.answer) and q.answer > 0, q.id
        assert (ROOT / "solutions" / f"{q.reference}.ipynb").exists(), f"{q.id}: no lab {q.reference}"
        assert any(h.startswith(q.section.strip()) for h in _headings(q.reference)), (
            f"{q.id}: no heading starting {q.section!r} in {q.reference}"
        )


def _expected(q: quiz.Question) -> float:
    """Each generated answer from the formula as its source writes it (not through labkit)."""
    p = q.params
    if q.id == "pipeline-gen-bubble":  # Huang et al. 2019
        return 100 * (p["p"] - 1) / (p["m"] + p["p"] - 1)
    if q.id == "cluster-gen-ring":  # Thakur et al. 2005: 2(n-1) steps of nbytes/n
        return 2 * (p["n"] - 1) * (p["mib"] * 2**20 / p["n"]) / (p["bw"] * 1e9) * 1e3
    if q.id == "cluster-gen-busbw":  # nccl-tests PERFORMANCE.md
        return p["algbw"] * 2 * (p["n"] - 1) / p["n"]
    if q.id == "memory-gen-accumulation":
        return p["global_batch"] / (p["micro"] * p["ranks"])
    if q.id == "memory-gen-zero":  # ZeRO, Figure 1: 2 + 2 + 12 bytes, sharded by stage over N_d
        n, d, k = p["billions"] * 1e9, p["gpus"], p["zero_stage"]
        return (
            2 * n / (d if k >= 3 else 1) + 2 * n / (d if k >= 2 else 1) + 12 * n / (d if k >= 1 else 1)
        ) / 2**30
    if q.id == "memory-gen-activations":  # Korthikanti et al. 2022, Table 2
        s, b, h, a, t = p["s"], p["b"], p["h"], p["a"], p["t"]
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) / 2**30
    if q.id == "parallelism-gen-tp":  # Shoeybi et al. 2019: 4 all-reduces of b·s·h per layer
        t = p["tp"]
        return p["layers"] * 4 * 2 * (t - 1) / t * p["mb"] * p["seq"] * p["h"] * 2 / (p["bw"] * 1e9) * 1e3
    raise AssertionError(f"no formula for {q.id}")


@pytest.mark.parametrize("seed", range(12))
def test_generated_answers_equal_the_formulas(seed):
    generated = [q for q in quiz.bank(seed=seed) if q.kind == "numeric"]
    assert len(generated) >= 7
    for q in generated:
        assert math.isclose(q.answer, _expected(q), rel_tol=1e-3), (q.id, q.params, q.answer)


def test_a_seed_reproduces_a_paper_and_another_draws_new_numbers():
    a, b = quiz.bank(seed=3), quiz.bank(seed=3)
    assert [q.text for q in a] == [q.text for q in b]
    texts = {tuple(q.text for q in quiz.bank(seed=s) if q.kind == "numeric") for s in range(6)}
    assert len(texts) > 1
    exam = quiz.exam(14, seed=1)
    assert len(exam) == 14 and {q.topic for q in exam} == set(TOPICS)  # two per topic
    with pytest.raises(ValueError, match="topic"):
        quiz.bank(topic="gpus")


def test_grading_says_why_and_where():
    q = next(q for q in quiz.bank() if q.kind == "choice")
    ok, text = quiz.grade(q, int(q.answer))
    assert ok and text.startswith("Right") and q.reference in text
    ok, text = quiz.grade(q, (int(q.answer) + 1) % len(q.choices))
    assert not ok and q.correct in text
    n = next(q for q in quiz.bank() if q.kind == "numeric")
    assert quiz.grade(n, n.answer * 1.01)[0] and not quiz.grade(n, n.answer * 1.5)[0]
    assert not quiz.grade(n, "lots")[0]
    assert quiz.score([(q, True), (n, False)])["all"] == (1, 2)


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


def test_labkit_quiz_in_the_terminal():
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "quiz", "--topic", "profiling", "--print"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "Answers" in out.stdout
    n = len(quiz.bank("cluster"))
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "quiz", "--topic", "cluster"],
        input="a\n" * n,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "score by topic" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "quiz", "--topic", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "topic" in out.stderr
