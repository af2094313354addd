"""The capstone's check: it says which mistakes were found and fixed, failing with what is left (on real
runs of the emulated cluster)."""

from __future__ import annotations

import dataclasses

import pytest

from labkit import Cluster
from labkit.course.experiments.capstone import draw
from labkit.course.experiments.capstone_checks import check_capstone

CPU = Cluster.emulated(gpus_per_node=2)


def test_the_check_names_what_is_left_and_passes_the_full_fix(tmp_path):
    cap = draw(0)  # oom_batch, per_tensor_allreduce, data_loading
    assert cap.planted == ("oom_batch", "per_tensor_allreduce", "data_loading")
    with pytest.raises(ValueError, match="not capstone mistakes"):
        check_capstone(cap, {"slow_disk"}, cap.job, cluster=CPU)

    with pytest.raises(AssertionError) as info:  # handed back as it came: it does not even run
        check_capstone(cap, set(), cap.job, cluster=CPU, trace_dir=tmp_path / "a")
    assert "runs out of memory (22.0 MiB per rank)" in str(info.value)

    # the data loading left as it was, and the contract changed
    half = dataclasses.replace(cap.job, micro_batch=4, grad_sync="ddp", global_batch=32)
    with pytest.raises(AssertionError) as info:
        check_capstone(
            cap,
            {"oom_batch", "per_tensor_allreduce", "straggler"},
            half,
            cluster=CPU,
            trace_dir=tmp_path / "b",
        )
    left = str(info.value).split("what is left:")[1]
    assert "data_loading is not fixed: the fixed job still plants it" in left
    assert "data_loading was planted and not named in found" in left
    assert "straggler is in found but was not planted" in left
    assert "global_batch is 32, the job's is 16" in left
    assert "oom_batch" not in left and "per_tensor_allreduce" not in left

    fixed = dataclasses.replace(half, tokenize="ahead", global_batch=16)
    report = check_capstone(cap, set(cap.planted), fixed, cluster=CPU, trace_dir=tmp_path / "d")
    assert report.passed and all(r["found"] and r["fixed"] for r in report.rows)
    assert [r["mistake"] for r in report.rows] == list(cap.planted)
    assert report.fixed_ms <= 1.2 * report.clean_ms and report.fixed_peak_mib <= cap.memory_mib
    assert report.findings == [] and "nothing: every planted mistake found and fixed" in str(report)
