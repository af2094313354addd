"""Each lab fits an hour: what a learner reads top to bottom (the markdown outside the deep-dive blocks a
learner may open, `<details>`) is at most 2,500 words, so the running, the exercise and the quiz keep their
time; its sentences are short."""

from __future__ import annotations

import json
import re

import pytest

from labkit.course.experiments import registry

MAIN_PATH_WORDS = (
    2500  # the course review's bound (issue 46): about 12 minutes of reading at 200 words a minute
)
SENTENCE_WORDS = 25  # the review's bound on the main path's mean sentence length


def main_path(repo, lab: str) -> str:
    """The solution's markdown with its `<details>` blocks left out."""
    cells = json.loads((repo / "solutions" / f"{lab}.ipynb").read_text(encoding="utf-8"))["cells"]
    text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.sub(r"<details>.*?</details>", "", text, flags=re.S)


def mean_sentence_words(text: str) -> float:
    """Words per sentence of the prose: tables, code blocks and headings left out; a sentence ends at . ? or !
    before a space or a line's end."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = [ln for ln in prose.splitlines() if not ln.lstrip().startswith(("|", "#"))]
    # a paragraph, and each item of a list, ends a sentence even without a full stop
    blocks = re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", "\n".join(lines))
    items = (re.sub(r"^\s*(?:[-*]|\d+\.)\s+", "", b) for b in blocks)  # a list item without its marker
    split = (re.split(r"[.?!](?:\s|$)", " ".join(b.split())) for b in items)
    sentences = [s for parts in split for s in parts if len(s.split()) > 2]
    return sum(len(s.split()) for s in sentences) / len(sentences)


@pytest.mark.parametrize("lab", registry.LABS)
def test_the_main_path_of_each_lab_fits_its_hour(repo, lab):
    text = main_path(repo, lab)
    words = len(text.split())
    assert words <= MAIN_PATH_WORDS, f"{lab}: {words} words outside <details>; move internals into deep dives"
    assert mean_sentence_words(text) < SENTENCE_WORDS, (
        f"{lab}: {mean_sentence_words(text):.1f} words a sentence"
    )


def test_a_deep_dive_is_left_out_of_the_count_and_a_table_out_of_the_sentences():
    text = "Short one. <details><summary>Deep dive</summary>\n\nmany words " * 3 + "</details>"
    assert len(re.sub(r"<details>.*?</details>", "", text, flags=re.S).split()) == 2
    assert mean_sentence_words("One two three. Four five six seven.\n| a | b | c | d |\n") == 3.5
    assert mean_sentence_words("Items:\n- one two three\n- four five six seven\n") == 3.5
