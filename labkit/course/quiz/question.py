"""One question of the bank, and the course's topics: what `bank.py` serves and `generated.py` makes."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TOPICS", "Question"]

# topic -> (what it covers, the lab that teaches it)
TOPICS: dict[str, tuple[str, str]] = {
    "cluster": ("ranks, collectives and bus bandwidth", "00_cluster_tour"),
    "parallelism": (
        "data, tensor and pipeline parallelism, and choosing between them",
        "01_parallelism_choice",
    ),
    # the caching allocator's fragmentation (empty_cache, expandable_segments, max_split_size_mb) is memory,
    # not number formats
    "memory": ("model states, ZeRO, activations, the batch and allocator fragmentation", "02_oom_batch"),
    "precision": ("bf16, fp16 with loss scaling, and fp8", "02_oom_batch"),
    "communication": ("gradient buckets, overlap and no_sync", "03_unoverlapped_comms"),
    "pipeline": ("the bubble, schedules and balancing stages", "04_imbalanced_pipeline"),
    "profiling": ("traces, stragglers, data loading and host syncs", "05_unprofiled_run"),
}


@dataclass(frozen=True)
class Question:
    """One question. `kind` "choice": `answer` is the index of the right one of `choices`; "numeric":
    `answer` is the value in `unit`, right within `tolerance` (relative)."""

    id: str
    topic: str
    kind: str
    text: str
    answer: float
    explanation: str
    reference: str  # the lab notebook's stem
    section: str  # the start of a heading in that notebook
    choices: tuple[str, ...] = ()
    unit: str = ""
    tolerance: float = 0.02
    params: dict = field(default_factory=dict, compare=False)  # a generated question's inputs
    # course practice only: it tests how this course's code works, which no exam asks; not in the mock exam
    practice: bool = False

    @property
    def where(self) -> str:
        return f'lab {self.reference}, section "{self.section.strip()}..."'

    @property
    def correct(self) -> str:
        """The right answer, as a learner would write it."""
        if self.kind == "choice":
            return self.choices[int(self.answer)]
        return f"{self.answer:.4g} {self.unit}".strip()
