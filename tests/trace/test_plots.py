"""labkit.trace.plots: a timeline of two lanes per rank, a pipeline step as a Gantt chart, and a diagnosis
marked on the timeline."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from labkit.trace import Diagnosis, mark_diagnosis, plot_pipeline, plot_timeline, read_trace, typical_step


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def _two_steps(tmp_path: Path) -> Path:
    """Two 10 ms steps (4 and 5): compute, then an all-reduce on gloo's thread."""
    events = [
        _x("ProfilerStep#4", 0, 10_000, "user_annotation"),
        _x("ProfilerStep#5", 10_000, 10_000, "user_annotation"),
        _x("aten::mm", 0, 6_000),
        _x("gloo:all_reduce", 6_000, 3_000, "user_annotation", tid=2),
        _x("aten::mm", 10_000, 6_000),
        _x("gloo:all_reduce", 16_000, 3_000, "user_annotation", tid=2),
    ]
    path = tmp_path / "two_steps.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0}}))
    return path


def test_plot_timeline_draws_two_lanes_per_rank(tmp_path):
    tr = read_trace(_two_steps(tmp_path))
    fig = plot_timeline({0: tr, 1: tr}, title="synthetic", step=4)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 compute",
        "rank 0 comm",
        "rank 1 compute",
        "rank 1 comm",
    ]
    assert ax.get_title() == "synthetic"
    assert "ms" in ax.get_xlabel()
    plt.close(fig)
    with pytest.raises(ValueError, match="got no traces"):
        plot_timeline([])


def test_a_diagnosis_is_marked_and_named_in_the_title(tmp_path):
    tr = read_trace(_two_steps(tmp_path))
    fig = plot_timeline([tr], title="job")
    patches = len(fig.axes[0].collections)
    found = Diagnosis(kind="sync_collective", rank=None, evidence="a blocking all-gather", breakdown=[])
    mark_diagnosis(fig, [tr], found)
    assert fig.axes[0].get_title() == "job\ndiagnosis: sync_collective (marked in red)"
    assert len(fig.axes[0].collections) == patches + 1  # the collective of the last step, outlined
    plt.close(fig)


def test_plot_pipeline_draws_every_rank():
    spans = [[("F", 0, 0, 0.0, 1.0), ("B", 0, 0, 3.0, 5.0)], [("F", 1, 0, 1.0, 2.0), ("B", 1, 0, 2.0, 3.0)]]
    fig = plot_pipeline(spans, 5.0)
    assert len(fig.axes[0].get_yticks()) == 2
    with pytest.raises(ValueError, match="no ranks"):
        plot_pipeline([])


def _three_steps(tmp_path: Path, name: str, ms: list[float]) -> Path:
    """Steps 1, 2, 3 of the given lengths (ms), back to back, each one matmul long."""
    events, t = [], 0.0
    for n, d in enumerate(ms, 1):
        events += [_x(f"ProfilerStep#{n}", t, d * 1000, "user_annotation"), _x("aten::mm", t, d * 1000)]
        t += d * 1000
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_the_typical_step_is_the_median_on_the_slowest_rank_and_the_record_is_marked(tmp_path):
    # rank 0's steps 10, 30, 20 ms; rank 1's 25, 5, 5: slowest per step 25, 30, 20 -> median 25, step 1
    ranks = [_three_steps(tmp_path, "r0.json", [10, 30, 20]), _three_steps(tmp_path, "r1.json", [25, 5, 5])]
    assert typical_step(ranks) == 1
    assert typical_step(ranks[:1]) == 3  # 10, 30, 20 alone: the median is 20 ms, step 3
    fig = plot_timeline(ranks, step=1, recorded_ms=24.0)
    ax = fig.axes[0]
    assert any(line.get_label() == "recorded 24.0 ms" for line in ax.get_lines())
    assert ax.get_xlim()[1] >= 25.0
    plt.close(fig)
    with pytest.raises(ValueError, match="got no traces"):
        typical_step([])
