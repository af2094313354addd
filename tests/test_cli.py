"""labkit.cli: `labkit doctor`'s verdict where the GPUs asked for are missing, and `labkit quiz` in a
terminal."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from labkit import quiz
from labkit.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_doctor_gives_a_verdict_where_there_is_no_gpu(capsys):
    assert main(["doctor", "--cluster", "gpu"]) == 1
    assert "verdict: NOT READY" in capsys.readouterr().out


def test_labkit_quiz_in_the_terminal(labkit_env):
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "quiz", "--topic", "profiling", "--print"],
        capture_output=True,
        text=True,
        timeout=60,
        env=labkit_env,
    )
    assert out.returncode == 0 and "Answers" in out.stdout
    n = len(quiz.bank("cluster"))
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "quiz", "--topic", "cluster"],
        input="a\n" * n,
        capture_output=True,
        text=True,
        timeout=60,
        env=labkit_env,
    )
    assert out.returncode == 0 and "score by topic" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "quiz", "--topic", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        env=labkit_env,
    )
    assert out.returncode == 2 and "topic" in out.stderr


def test_labkit_run_writes_a_report_in_a_folder_of_its_own(repo, labkit_env, tmp_path):
    """The README's main job, on one small lab: a run folder, runs/latest, a report with the lab's parameters
    and their docs, no kernel noise."""
    cmd = [
        sys.executable,
        "-m",
        "labkit.cli",
        "run",
        "--lab",
        "00",
        "--quiet",
        "--out",
        str(tmp_path / "runs"),
        "--cluster",
        "cpu",
        "-p",
        "sizes_kib",
        "[4, 256]",
    ]
    proc = subprocess.run(cmd, cwd=repo, env=labkit_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "without encryption" not in proc.stdout + proc.stderr
    latest = tmp_path / "runs" / "latest"
    assert (
        latest.is_symlink() and (latest / "report.md").exists() and (latest / "00_cluster_tour.html").exists()
    )
    report = (latest / "report.md").read_text()
    assert "Run on " in report and "- **limit**:" in report and "| 00_cluster_tour |" in report
    assert "| sizes_kib | [4, 256] | message sizes (KiB)" in report


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--lab", "00", "-p", "sizes_kib", "64"],
            "sizes_kib=64 must be a list of numbers or None; set it with -p",
        ),
        (["--lab", "02", "-p", "memory_mib", '"lots"'], "memory_mib='lots' must be a number"),
        (["--lab", "04", "-p", "stages", "four"], "stages='four' must be a whole number"),
        (["-p", "no_such", "1"], "no_such=1 must be a parameter of any of the labs run"),
    ],
)
def test_labkit_run_checks_the_parameters_before_a_kernel_starts(repo, labkit_env, tmp_path, args, message):
    cmd = [sys.executable, "-m", "labkit.cli", "run", "--quiet", "--out", str(tmp_path / "runs"), *args]
    proc = subprocess.run(cmd, cwd=repo, env=labkit_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[
        -2000:
    ]
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_doctor_on_a_node_with_one_gpu_says_which_labs_use_it(capsys, monkeypatch):
    # One H200: auto runs the two-rank smoke test on the emulated cluster; the verdict must not say "no usable
    # GPUs", and each lab's line says where it runs and why
    from labkit.cluster import GPU, Cluster
    from labkit.links import Link

    one = Cluster(
        "gpu", 1, 1, Link(450.0, 5.0, "NVLink"), Link(50.0, 5.0, "IB"), gpus=(GPU(0, "NVIDIA H200", 141.0),)
    )
    monkeypatch.setattr(Cluster, "detect", classmethod(lambda cls: one))
    real_resolve = Cluster.resolve.__func__
    monkeypatch.setattr(Cluster, "resolve", classmethod(lambda cls, spec, n: real_resolve(cls, "cpu", n)))
    assert main(["doctor", "--cluster", "auto"]) == 0
    out = capsys.readouterr().out
    assert "no usable GPUs" not in out and "verdict: READY (emulated, 1 GPU)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("          0")}
    three = lines["03_unoverlapped_comms"]
    assert "this node has 1 GPU: its lesson is gradient communication between ranks" in three
    # lab 02 takes one rank there and runs it on the GPU; lab 01 stays on its emulated two nodes
    assert "GPU: 1 rank on NCCL: its lessons are one rank's memory" in lines["02_oom_batch"]
    assert "its default: it needs two nodes" in lines["01_parallelism_choice"]
    assert "profiles the layers on this GPU" in lines["04_imbalanced_pipeline"]
