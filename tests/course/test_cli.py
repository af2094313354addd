"""labkit.course.cli: `labkit doctor`'s verdict where the GPUs asked for are missing, and `labkit quiz` in a
terminal."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from labkit.course import quiz
from labkit.course.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_doctor_gives_a_verdict_where_there_is_no_gpu(capsys):
    assert main(["doctor", "--cluster", "gpu"]) == 1
    assert "verdict: NOT READY" in capsys.readouterr().out


def test_labkit_quiz_in_the_terminal(labkit_env):
    out = subprocess.run(
        [sys.executable, "-m", "labkit.course.cli", "quiz", "--topic", "profiling", "--print"],
        capture_output=True,
        text=True,
        timeout=60,
        env=labkit_env,
    )
    assert out.returncode == 0 and "Answers" in out.stdout
    answers = "".join(("a" if q.kind == "choice" else "1") + "\n" for q in quiz.bank("cluster"))
    out = subprocess.run(
        [sys.executable, "-m", "labkit.course.cli", "quiz", "--topic", "cluster"],
        input=answers,
        capture_output=True,
        text=True,
        timeout=60,
        env=labkit_env,
    )
    assert out.returncode == 0 and "score by topic" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "labkit.course.cli", "quiz", "--topic", "nope"],
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
        "labkit.course.cli",
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
    (run_dir,) = (tmp_path / "runs").iterdir()  # one lab: a folder of its own; `latest` is for full runs
    assert (run_dir / "report.md").exists() and (run_dir / "00_cluster_tour.html").exists()
    assert "runs/latest is made by the first run of every lab that passes" in proc.stdout
    # the lab's figure is kept in the run's lab folder, which the report links (and nowhere else)
    assert (run_dir / "00_cluster_tour" / "00_cluster_tour_busbw.png").exists()
    report = (run_dir / "report.md").read_text()
    assert "00_cluster_tour/00_cluster_tour_busbw.png" in report
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
        # issue 44: a word for the ranks names the lab's field for them, not a look-alike (vocab_size)
        (["--lab", "04", "-p", "world_size", "3"], "the ranks are set by -p stages 3"),
        # issue 44: a suggestion never repeats a value the suggested parameter refuses
        (["--lab", "04", "-p", "stagse", "four"], "did you mean -p stages 4 (stages='four' would fail"),
        # issue 44: what the notebook's Params.resolve refuses is refused here, with what the user typed
        (["--lab", "04", "-p", "stages", "3"], "stages=3 must be a divisor of global_batch=32"),
        (["--lab", "03", "-p", "world_size", "1"], "world_size=1 must be a whole number with >= 2"),
        # issue 44: raised in the kernel, this said the script's "pass world_size=16"
        (
            ["--lab", "01", "-p", "cluster", "sim:dgx-h100", "-p", "world_size", "32"],
            "world_size=32 must be at most 8 x nodes=2 (a H100-SXM5-80GB node holds 8 GPUs); set it with -p",
        ),
        (["--lab", "03", "--cluster", "sim:dgx-h1000"], "'sim:dgx-h1000' is not a simulated machine"),
        (["--lab", "03", "--cluster", "tpu"], "'tpu' is not a cluster: use auto, cpu, gpu or sim:<preset>"),
    ],
)
def test_labkit_run_checks_the_parameters_before_a_kernel_starts(
    repo, tmp_path, monkeypatch, capsys, args, message
):
    monkeypatch.chdir(repo)
    try:  # in this process: the same main() as the command, without a new interpreter per case
        code = main(["run", "--quiet", "--out", str(tmp_path / "runs"), *args])
    except SystemExit as stop:  # argparse's own refusals (--cluster)
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err[-2000:]
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_the_command_refuses_a_value_a_notebook_would_with_exit_2_and_no_traceback(
    repo, labkit_env, tmp_path
):
    cmd = [sys.executable, "-m", "labkit.course.cli", "run", "--quiet", "--out", str(tmp_path / "runs")]
    proc = subprocess.run(
        [*cmd, "--lab", "04", "-p", "stages", "3"],
        cwd=repo,
        env=labkit_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("labkit run: lab 04_imbalanced_pipeline: stages=3 must be"), proc.stderr


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
    assert (
        "its default: its mistake is tensor parallelism across the link between two nodes"
        in (lines["01_parallelism_choice"])
    )
    assert "the layers also profiled on a GPU" in lines["04_imbalanced_pipeline"]


def _fake_lab(outcomes: dict[str, str]):
    """A stand-in for `labkit.course.cli._run_lab` that 'runs' a lab instantly with the outcome given per lab
    (passed, failed, or interrupted: Ctrl-C in its cell 7, after writing a partial copy)."""
    from labkit.course.execute import Interrupted

    def fake(nb, counter, params, out, args):
        outcome = outcomes.get(nb.stem[:2], "passed")
        if outcome == "interrupted":
            (out / nb.name).write_text("{}")
            raise Interrupted(out / nb.name, 7, 30)
        entry = {
            "lab": nb.stem,
            "notebook": str(out / nb.name),
            "parameters": params,
            "status": outcome,
            "seconds": 1.0,
            "records": {},
        }
        return {**entry, "error": "cell 3: AssertionError: x"} if outcome == "failed" else entry

    return fake


def test_latest_moves_only_for_a_run_of_every_lab_that_passed(repo, tmp_path, monkeypatch, capsys):
    """A failed run, or a one-lab run, keeps its own folder and says where `latest` still points: the last
    good full report stays one path away (issue 28, point 8)."""
    import labkit.course.cli as cli

    runs = tmp_path / "runs"
    args = ["run", "--root", str(repo), "--out", str(runs), "--quiet"]
    monkeypatch.setattr(cli, "_run_lab", _fake_lab({}))
    assert main(args) == 0
    latest = runs / "latest"
    good = latest.resolve()
    assert latest.is_symlink() and "points to it" in capsys.readouterr().out
    for outcomes, extra, status in (({"03": "failed"}, [], 1), ({}, ["--lab", "02"], 0)):
        monkeypatch.setattr(cli, "_run_lab", _fake_lab(outcomes))
        assert main(args + extra) == status
        assert latest.resolve() == good, outcomes
        said = capsys.readouterr().out
        assert f"still points to {good.name}, the last run of every lab that passed" in said
    assert len([p for p in runs.iterdir() if not p.is_symlink()]) == 3


def test_ctrl_c_in_a_lab_says_where_and_what_was_kept_in_one_line(repo, tmp_path, monkeypatch, capsys):
    import json

    import labkit.course.cli as cli

    monkeypatch.setattr(cli, "_run_lab", _fake_lab({"02": "interrupted"}))
    code = main(["run", "--root", str(repo), "--out", str(tmp_path / "runs"), "--quiet"])
    err = capsys.readouterr().err.strip()
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir()]
    assert code == 130 and len(err.splitlines()) == 1, err
    assert err == (
        f"labkit run: interrupted (Ctrl-C) in cell 7 of 30 in 02_oom_batch; kept {run_dir} (the report of "
        f"lab(s) 00, 01, the partly run 02_oom_batch.ipynb); {tmp_path / 'runs' / 'latest'} is made by the "
        "first run of every lab that passes"
    )
    labs = json.loads((run_dir / "report.json").read_text())["labs"]
    statuses = [(e["lab"][:2], e["status"]) for e in labs]
    assert statuses == [("00", "passed"), ("01", "passed"), ("02", "interrupted")]


def test_ctrl_c_during_labkit_run_ends_it_in_one_line_with_no_process_left(repo, labkit_env, tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the foreground process group) while lab 01's ranks run: exit
    status 130, one line and no traceback, the run folder kept, no kernel or rank left behind."""
    import os
    import signal
    import time

    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "labkit.course.cli", "run", "--lab", "01", "--quiet", "--out", str(runs)]
    proc = subprocess.Popen(
        cmd,
        cwd=repo,
        env=labkit_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as a terminal's shell starts a foreground command: a suite started in the background (`cmd &` in a
        # script) ignores SIGINT, and a process that starts with SIGINT ignored never sees Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not list(runs.glob("*/01_parallelism_choice.ipynb")):
            assert proc.poll() is None and time.monotonic() < deadline, "the lab never started"
            time.sleep(0.2)
        time.sleep(3)  # into the lab's cells (it runs for half a minute and more)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and len(lines) == 1 and "Traceback" not in out + err, out + err
    assert lines[0].startswith("labkit run: interrupted (Ctrl-C) ")
    assert "in 01_parallelism_choice; kept " in lines[0] and not (runs / "latest").exists()
    # the kernel and its ranks leave when their parent goes (JPY_PARENT_PID, PR_SET_PDEATHSIG): within seconds
    deadline = time.monotonic() + 30
    while (left := _session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left


def _session(sid: int) -> str:
    """The processes left in session `sid` (the labkit run a test started and its children), a line each."""
    ps = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(sid)], capture_output=True, text=True)
    return ps.stdout.strip()


def test_doctor_names_the_labs_that_run_on_a_simulated_machine(capsys):
    from labkit.course.doctor import where_labs_run

    where_labs_run(0)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("simulated"))
    assert "labs 00, 01, 02, 03, 04, 05, 06 " in line and "--cluster sim:dgx-h100" in line


def _lab_lines(out: str) -> dict[str, str]:
    """The doctor's line for each lab, by the lab's name."""
    return {line.split()[0]: line for line in out.splitlines() if line.startswith("          0")}


# the labs whose lesson is about several ranks: every GPU of an 8-GPU node (lab 01: its 8 emulated ranks)
ALL_EIGHT = [
    "00_cluster_tour",
    "01_parallelism_choice",
    "03_unoverlapped_comms",
    "05_unprofiled_run",
    "06_capstone",
]


def _describe_only(monkeypatch) -> None:
    """`labkit doctor --as` describes: it must not look for GPUs, calibrate this CPU or start a rank."""
    from labkit import calibrate
    from labkit.cluster import Cluster
    from labkit.machine import launcher

    def refuse(*args, **kwargs):
        raise AssertionError("labkit doctor --as ran something")

    monkeypatch.setattr(Cluster, "detect", classmethod(refuse))
    monkeypatch.setattr(launcher, "launch", refuse)
    monkeypatch.setattr(calibrate, "cpu_gflops", refuse)


def test_doctor_as_dgx_h100_says_where_each_lab_would_run_on_its_8_gpus(capsys, monkeypatch):
    _describe_only(monkeypatch)
    assert main(["doctor", "--as", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    assert "1 node(s) x 8 H100" in out
    lines = _lab_lines(out)
    assert sorted(lines) == sorted([*ALL_EIGHT, "02_oom_batch", "04_imbalanced_pipeline"])  # one line each
    for lab in ALL_EIGHT:
        assert " 8 ranks" in lines[lab], lines[lab]
    for lab in ("00_cluster_tour", "03_unoverlapped_comms", "05_unprofiled_run", "06_capstone"):
        assert "GPUs: 8 ranks on NCCL: " in lines[lab], lines[lab]
    lab01 = lines["01_parallelism_choice"]
    assert "emulated cluster: 8 ranks, its default: its mistake is tensor parallelism" in lab01
    assert "GPUs: 8 ranks on NCCL: a stage per rank" in lines["04_imbalanced_pipeline"]
    assert "GPUs: 2 ranks on NCCL: its lessons are one rank's memory" in lines["02_oom_batch"]
    assert "--cluster sim:dgx-h100 --world-size 8" in out
    assert "nodes     " not in out  # one node: nothing to say about torchrun across nodes


def test_doctor_as_a_preset_of_two_nodes_runs_notebooks_on_one_and_names_torchrun_for_both(
    capsys, monkeypatch
):
    _describe_only(monkeypatch)
    assert main(["doctor", "--as", "dgx-a100-80gb:2"]) == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 8 A100" in out
    lines = _lab_lines(out)
    for lab in ALL_EIGHT:
        assert " 8 ranks" in lines[lab], lines[lab]
    (nodes,) = [line for line in out.splitlines() if line.startswith("nodes     ")]
    assert "all 16 GPUs of the 2 nodes" in nodes and "torchrun --nnodes 2 --nproc-per-node 8" in nodes


def test_doctor_on_a_node_of_8_gpus_says_its_labs_use_them(capsys):
    from labkit.course.doctor import where_labs_run

    where_labs_run(8)
    lines = _lab_lines(capsys.readouterr().out)
    for lab in ALL_EIGHT:
        assert " 8 ranks" in lines[lab], lines[lab]
    where = lines["00_cluster_tour"].split(None, 1)[1]
    assert where.startswith("GPUs: 8 ranks on NCCL: its lesson is the link"), where


@pytest.mark.parametrize("spec", ["dgx-h1000", "dgx-h100:0", "dgx-h100:two", "sim:dgx-h100"])
def test_doctor_as_an_unknown_machine_exits_2_with_the_value_the_known_presets_and_the_fix(
    spec, capsys, monkeypatch
):
    _describe_only(monkeypatch)
    assert main(["doctor", "--as", spec]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.startswith(f"labkit doctor: --as {spec!r} is not a machine labkit knows")
    assert "dgx-a100-80gb, dgx-h100, dgx-h200" in err and "e.g. --as dgx-h100" in err
