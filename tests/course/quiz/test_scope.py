"""The course's scope in the exam: every map entry points at a section the solutions have, every bank topic is
mapped, and the README, the instructor guide and the mock exam say the same thing."""

from __future__ import annotations

import json

from labkit.course import quiz
from labkit.course.quiz.question import TOPICS
from labkit.course.quiz.scope import COVERED, SCOPE, table


def _headings(repo, lab: str) -> list[str]:
    (path,) = (repo / "solutions").glob(f"{lab}_*.ipynb")
    cells = json.loads(path.read_text())["cells"]
    lines = ("".join(c["source"]).splitlines() for c in cells if c["cell_type"] == "markdown")
    return [line.lstrip("#").strip() for block in lines for line in block if line.startswith("##")]


def test_every_section_the_map_names_is_a_heading_of_its_lab(repo):
    for covered in COVERED:
        for lab, start in covered.sections:
            assert any(h.startswith(start) for h in _headings(repo, lab)), (covered.topic, lab, start)


def test_every_bank_topic_is_mapped_to_an_exam_topic():
    assert sorted(c.bank_topic for c in COVERED) == sorted(TOPICS)


def test_the_readme_and_the_instructor_guide_show_the_map(repo):
    for doc in ("README.md", "docs/instructor_guide.md"):
        pasted = f"{doc}: paste `python -m labkit.course.quiz.scope`'s table"
        assert table() in (repo / doc).read_text(), pasted


def test_the_mock_exam_says_what_it_covers():
    text = quiz.mock_exam(n=3, seed=1, widgets=False)
    assert SCOPE in text.split("Q1 ")[0] and "not quantization" in SCOPE
