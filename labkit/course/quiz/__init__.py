"""Certification practice: a question bank over the course's topics, shown as a quiz or a timed mock exam.

    labkit.course.quiz.show(topic="memory")   # widgets in JupyterLab, text under papermill or in a terminal
    labkit.course.quiz.mock_exam(n=20, seed=7)
    labkit.course.quiz.bank()                 # the questions as data

* `bank.py`: `Question`, `TOPICS`, `bank`, `exam`, `grade`, `score`;
* `questions.json`: the multiple-choice questions, as data, each pointing to the lab section that teaches it;
* `generated.py`: numeric questions whose answers come from labkit's own formulas, fresh numbers per seed;
* `show.py`: the widget quiz and the text form;
* `terminal.py`: `labkit quiz`'s terminal loop (practice, or a timed mock exam) and its option checks;
* `scope.py`: which part of the certification exam the course covers, the map to labs and bank topics.
"""

from labkit.course.quiz.bank import TOPICS, Question, bank, exam, grade, score
from labkit.course.quiz.show import mock_exam, show, text_form
from labkit.course.quiz.terminal import run_terminal

__all__ = [
    "TOPICS",
    "Question",
    "bank",
    "exam",
    "grade",
    "mock_exam",
    "run_terminal",
    "score",
    "show",
    "text_form",
]
