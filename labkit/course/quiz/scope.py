"""What part of the certification exam this course covers, and what it leaves to other material.

The NVIDIA-Certified Professional: Generative AI LLMs exam (NCP-GENL; its topic areas are listed on NVIDIA's
certification page, https://www.nvidia.com/en-us/learn/certification/generative-ai-llm-professional/) spans
the life of an LLM, from its architecture to deployment. This course covers one part of it: training on
several GPUs, within the area of GPU acceleration and optimization. `COVERED` maps that part's topics to the
labs, their sections and the bank's question topics; `NOT_COVERED` names what a learner must study elsewhere.
`SCOPE` is the one line the mock exam prints; `table()` is the map the README and the instructor guide show
(tests/course/quiz/test_scope.py holds both documents to it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COVERED", "NOT_COVERED", "SCOPE", "Covered", "table"]


@dataclass(frozen=True)
class Covered:
    """One exam topic the course teaches: the sections that teach it, as (lab, the start of a heading),
    and the bank topic whose questions ask about it."""

    topic: str
    sections: tuple[tuple[str, str], ...]
    bank_topic: str

    def where(self) -> str:
        """The sections, lab by lab: "02: 2 · Explain; 7 · Out of memory"."""
        labs = dict.fromkeys(lab for lab, _ in self.sections)
        return "; ".join(f"{lab}: " + ", ".join(h for n, h in self.sections if n == lab) for lab in labs)


COVERED = (
    Covered(
        "collectives, NCCL and the links between GPUs",
        (("00", "2 · Your first all-reduce"), ("00", "3 · How fast is the link?")),
        "cluster",
    ),
    Covered(
        "choosing data, tensor and pipeline parallelism",
        (("01", "1 · Mistake one"), ("01", "2 · Mistake two"), ("01", "3 · The fix"), ("01", "6 · At scale")),
        "parallelism",
    ),
    Covered(
        "GPU memory: model states, activations, ZeRO, accumulation, checkpointing, fragmentation",
        (
            ("02", "2 · Explain: where the memory goes"),
            ("02", "3 · Fix 1"),
            ("02", "4 · Fix 2"),
            ("02", "5 · Fix 3"),
            ("02", "7 · Out of memory with memory free"),
        ),
        "memory",
    ),
    Covered(
        "mixed precision: bf16, fp16 with loss scaling, FP8",
        (("02", "4 · Fix 2"), ("02", "FP16 instead of bf16")),
        "precision",
    ),
    Covered(
        "overlapping gradient communication with backward",
        (
            ("03", "3 · Why: two separate costs"),
            ("03", "6 · How big should a bucket be?"),
            ("03", "8 · On a real cluster"),
        ),
        "communication",
    ),
    Covered(
        "pipeline schedules: the bubble, balance, GPipe, 1F1B, interleaving",
        (
            ("04", "3 · Why: the slowest stage"),
            ("04", "5 · Fix, part 2"),
            ("04", "7 · GPipe or 1F1B"),
            ("04", "8 · Interleaved 1F1B"),
        ),
        "pipeline",
    ),
    Covered(
        "profiling a distributed run: traces, stragglers, MFU",
        (
            ("05", "3 · Read the traces"),
            ("05", "4 · Let the trace name it"),
            ("05", "7 · On GPUs"),
            ("06", "4 · Let the traces point"),
        ),
        "profiling",
    ),
)

NOT_COVERED = (
    "quantization (post-training and quantization-aware, INT8 / INT4 / FP8 inference)",
    "inference serving and its batching, the KV cache at serving time",
    "TensorRT-LLM, Triton Inference Server and NIM",
    "MIG and GPU partitioning",
    "fine-tuning methods (LoRA and other parameter-efficient methods), prompt engineering, RAG",
    "data preparation, evaluation, safety and compliance",
)

SCOPE = (
    "This course covers the exam's multi-GPU training, within GPU acceleration and optimization (topics: "
    + ", ".join(c.bank_topic for c in COVERED)
    + "); not "
    + "; ".join(NOT_COVERED)
    + "."
)


def table() -> str:
    """The map of the exam topics the course covers, as a markdown table, then what it does not cover."""
    rows = [
        "| exam topic (GPU acceleration and optimization) | lab: sections | bank topic |",
        "| --- | --- | --- |",
        *(f"| {c.topic} | {c.where()} | `{c.bank_topic}` |" for c in COVERED),
    ]
    return "\n".join(rows) + "\n\nNot covered (study these elsewhere): " + "; ".join(NOT_COVERED) + "."


if __name__ == "__main__":
    print(table())
