"""A lab's measurement as a script (labkit.course.experiments.script): without torchrun it runs on the
emulated cluster; a parameter it cannot take ends it with exit status 2 and the fix, never a traceback. (Each
lab's script under torchrun: tests/labs/.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labkit.course.experiments import script

SMOKE_00 = ["--set", "sizes_kib", "[4, 64]", "--set", "iters", "3"]


def test_without_torchrun_a_lab_script_runs_on_the_emulated_cluster(tmp_path, capsys):
    out = tmp_path / "00.json"
    assert (
        script.run_lab(
            "labkit.course.experiments.cluster_tour", ["--cluster", "cpu", "--out", str(out), *SMOKE_00]
        )
        == 0
    )
    rec = json.loads(out.read_text())
    assert rec["lab"] == "00_cluster_tour" and rec["torchrun"] is False and rec["world_size"] == 2
    assert rec["emulated"] is True and rec["where"] == "emulated" and rec["limit"] > 0
    assert rec["params"]["sizes_kib"] == [4, 64] and rec["params"]["iters"] == 3
    printed = capsys.readouterr().out
    assert "labkit-record" not in printed  # the records are in the file; people read the summary
    before = f"{rec['before']:.4g}"
    assert printed.count(f"  before {before:>9} GB/s (bus bandwidth)  all_reduce bus bandwidth") == 1
    assert f"records in {out}" in printed


def test_print_records_prints_each_record_as_a_line_read_records_reads(tmp_path, capsys):
    out = tmp_path / "00.json"
    argv = ["--cluster", "cpu", "--out", str(out), "--print-records", *SMOKE_00]
    assert script.run_lab("labkit.course.experiments.cluster_tour", argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("labkit-record ")]
    assert {json.loads(line.split(" ", 1)[1])["key"] for line in lines} == set(json.loads(out.read_text()))


def test_the_summary_rounds_to_four_significant_digits():
    result = script.LabRecords(
        186.30027599999988, 0.02907, None, "ms", script.Meaning("b", "a", "l"), "step time"
    )
    text = script.summary(result, "emulated", "03_x")
    assert text.splitlines() == [
        "lab 03_x (emulated): step time",
        "  before     186.3 ms  b",
        "  after    0.02907 ms  a",
        "  limit          - ms  l",
    ]


def test_help_lists_every_parameter_with_its_doc(capsys):
    with pytest.raises(SystemExit) as info:
        script.run_lab("labkit.course.experiments.oom_batch", ["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "memory_mib = 28" in text and "memory of each rank" in text and "--set KEY VALUE" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--set", "memory", "16"],
            "memory=16 must be a parameter of lab 02_oom_batch; its parameters: cluster='auto'",
        ),
        (
            ["--set", "n_layers", "0"],
            "n_layers=0 must be a whole number with >= 1; set it with --set n_layers 4",
        ),
        (["--set", "memory_mib", '"lots"'], "memory_mib='lots' must be a number"),
        (["--set", "global_batch", "65"], "global_batch=65 must be a multiple of 2"),
        (
            ["--set", "stages", "4"],
            "stages=4 must be a parameter of lab 02_oom_batch (its ranks are world_size: --world-size N sets "
            "it, or torchrun's --nproc-per-node)",
        ),
    ],
)
def test_a_parameter_the_lab_cannot_take_ends_with_status_2_and_the_fix(argv, message, capsys):
    assert script.run_lab("labkit.course.experiments.oom_batch", argv) == 2  # before any rank starts
    err = capsys.readouterr().err
    assert f"lab 02_oom_batch: {message}" in err and "Traceback" not in err


def test_a_lab_that_needs_two_ranks_refuses_one(capsys):
    assert script.run_lab("labkit.course.experiments.capstone", ["--world-size", "1"]) == 2
    assert (
        "world_size=1 must be a whole number with >= 2; set it with --set world_size 2"
        in capsys.readouterr().err
    )
    assert script.run_lab("labkit.course.experiments.cluster_tour", ["--world-size", "1"]) == 2
    assert "lab 00_cluster_tour: world_size=1 must be a whole number with >= 2" in capsys.readouterr().err


def test_as_a_module_a_refusal_is_exit_status_2_without_a_traceback(tmp_path, labkit_env):
    proc = subprocess.run(
        [sys.executable, "-m", "labkit.course.experiments.imbalanced_pipeline", "--set", "steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=labkit_env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "steps=0 must be a whole number with >= 1; set it with --set steps 3" in proc.stderr


def test_under_torchrun_the_emulated_cluster_is_refused(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="under torchrun: the emulated cluster"):
        script.where("cpu", 2)
    for other in ("gpu", "bogus"):  # no GPU here; not a cluster
        with pytest.raises(ValueError, match=f"--cluster {other} under torchrun: use auto"):
            script.where(other, 2)
    w = script.where("auto", 8)  # torchrun's world size wins
    assert w.torchrun and w.world_size == 2 and w.cluster == "auto"
