"""Every lab's experiment runs as a script under torchrun (and as plain Python) and writes its records."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from labkit.experiments import script

# Small parameters: the whole suite must stay under 15 minutes on 2 cores (all seven labs: ~20 s).
SMALL = {
    "cluster_tour": {"sizes_kib": [4, 64], "iters": 3},
    "parallelism_choice": {
        "n_layers": 2,
        "d_model": 32,
        "n_heads": 4,
        "vocab_size": 256,
        "seq_len": 16,
        "global_batch": 8,
        "micro_batches": [2, 4],
        "steps": 1,
    },
    "oom_batch": {
        "n_layers": 2,
        "d_model": 32,
        "vocab_size": 256,
        "seq_len": 16,
        "global_batch": 16,
        "memory_mib": 1.3,
    },
    "unoverlapped_comms": {"n_layers": 2, "d_model": 32, "seq_len": 16, "batch_size": 4, "steps": 2},
    "imbalanced_pipeline": {
        "n_layers": 4,
        "d_model": 32,
        "vocab_size": 1024,
        "seq_len": 16,
        "batch_size": 8,
        "few_micro_batches": 2,
        "steps": 1,
    },
    "unprofiled_run": {"steps": 2},
    "capstone": {"steps": 1, "trace_steps": 2},
}


def _argv(module: str, out: Path) -> list[str]:
    argv = ["--out", str(out / f"{module}.json")]
    for key, value in SMALL[module].items():
        argv += ["--set", key, json.dumps(value)]
    return argv


def _torchrun(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def _check_common(rec: dict, lab: str, *, torchrun: bool) -> None:
    for key in ("before", "after", "limit", "unit", "meaning", "metric"):
        assert key in rec, f"{lab}: no {key!r}"
    assert rec["lab"] == lab and rec["torchrun"] is torchrun and rec["world_size"] == 2
    assert isinstance(rec["before"], float) and isinstance(rec["after"], float) and rec["after"] > 0
    assert set(rec["meaning"]) == {"before", "after", "limit"}


def test_every_lab_runs_under_torchrun_and_writes_its_records(tmp_path):
    """One torchrun job runs every lab's `main` in turn (the same code path as `-m`, without seven startups)."""
    driver = tmp_path / "every_lab.py"
    runs = {name: _argv(name, tmp_path) for name in SMALL}
    # Lab 00 as `-m` runs it (runpy, as __main__, argv from the command line): the module's own entry point.
    driver.write_text(
        textwrap.dedent(f"""
        import importlib, runpy, sys
        runs = {runs!r}
        sys.argv = ["labkit.experiments.cluster_tour", *runs.pop("cluster_tour")]
        try:
            runpy.run_module("labkit.experiments.cluster_tour", run_name="__main__", alter_sys=True)
        except SystemExit as done:
            assert done.code == 0, done.code
        for name, argv in runs.items():
            assert importlib.import_module("labkit.experiments." + name).main(argv) == 0, name
    """)
    )
    proc = _torchrun(str(driver), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(
        proc.stdout.count(f"lab {lab}: before") == 1 for lab in ("00_cluster_tour", "06_capstone")
    )  # rank 0
    rec = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in SMALL}
    labs = dict(
        zip(
            SMALL,
            (
                "00_cluster_tour",
                "01_parallelism_choice",
                "02_oom_batch",
                "03_unoverlapped_comms",
                "04_imbalanced_pipeline",
                "05_unprofiled_run",
                "06_capstone",
            ),
        )
    )
    for name, lab in labs.items():
        _check_common(rec[name], lab, torchrun=True)
        assert rec[name]["emulated"] is False and "torchrun on CPU" in rec[name]["where"]
    # No wall-clock comparisons here (a unit test never asserts speed): what the records must hold anywhere.
    tour = rec["cluster_tour"]
    assert tour["limit"] is None and "no published link figure" in tour["meaning"]["limit"]
    assert [r["size_bytes"] for r in tour["sweep"]] == [4096, 65536]
    choice = rec["parallelism_choice"]
    assert {r["layout"] for r in choice["sweep"]} == {"dp2 x tp1 x pp1", "dp1 x tp2 x pp1", "dp1 x tp1 x pp2"}
    assert choice["pick"] in {r["layout"] for r in choice["sweep"]}
    assert choice["limit"] == min(r["measured_ms"] for r in choice["sweep"])
    oom = rec["oom_batch"]  # MemTracker's peaks: the same on any CPU
    assert (
        oom["fits"] is True
        and oom["after"] <= oom["limit"] < oom["before"]
        and oom["peak_source"] == "MemTracker"
    )
    comms = rec["unoverlapped_comms"]
    assert comms["max_abs_diff"] < 1e-5 and comms["collectives_after"] < comms["collectives_before"]
    pipe = rec["imbalanced_pipeline"]
    assert pipe["max_abs_diff"] < 1e-5 and sum(pipe["sizes_after"]) == sum(pipe["sizes_before"]) == 6
    mystery = rec["unprofiled_run"]
    assert mystery["planted"] == "data_loading" and mystery["diagnosed"] and mystery["evidence"]
    cap = rec[
        "capstone"
    ]  # seed 0's batch does not fit: the emulated budget is in the rank under torchrun too
    assert cap["oom_at_start"] is True and "oom_batch" in cap["found"]
    assert cap["peak_mib"]["fixed"] <= cap["peak_mib"]["memory"] and cap["job_fixed"]["global_batch"] == 16


def test_without_torchrun_a_lab_script_runs_on_the_emulated_cluster(tmp_path, capsys):
    from labkit.experiments import cluster_tour

    assert (
        cluster_tour.main(["--cluster", "cpu", *_argv("cluster_tour", tmp_path)]) == 0
    )  # launch starts the ranks
    rec = json.loads((tmp_path / "cluster_tour.json").read_text())
    _check_common(rec, "00_cluster_tour", torchrun=False)
    assert rec["emulated"] is True and rec["where"] == "emulated" and rec["limit"] > 0
    out = capsys.readouterr().out
    assert 'labkit-record {"key": "before"' in out  # read_records reads these lines from a notebook cell
    assert out.count("lab 00_cluster_tour: before") == 1


def test_an_unknown_parameter_is_refused_with_the_list(capsys):
    from labkit.experiments import oom_batch

    with pytest.raises(SystemExit) as info:
        oom_batch.main(["--set", "memory", "16"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--set memory: not a parameter of lab 02_oom_batch" in err and "memory_mib=28" in err


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


def test_a_parameter_the_lab_cannot_run_with_ends_with_its_fix(capsys):
    from labkit.experiments import capstone, cluster_tour

    assert capstone.main(["--world-size", "1"]) == 2  # before any rank starts
    assert (
        "lab 06_capstone: world_size=1: the capstone is a data-parallel job; use 2 or more"
        in capsys.readouterr().err
    )
    assert cluster_tour.main(["--world-size", "1"]) == 2
    assert "use --world-size 2, or torchrun --nproc-per-node 2" in capsys.readouterr().err


def test_two_nodes_under_torchrun_count_the_bytes_that_cross_between_them(tmp_path):
    """`torchrun --nnodes 2` on one host (two torchrun agents meeting at a c10d rendezvous), one rank each: the
    records know the two nodes, and lab 01's tensor-parallel mistake sends its all-reduces over the link between."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "two-nodes",
                "-m",
                "labkit.experiments.parallelism_choice",
                *_argv("parallelism_choice", tmp_path),
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outs = [a.communicate(timeout=180)[0] for a in agents]
    finally:  # a hung agent: SIGTERM first, which torchrun passes on to its worker, so no rank is left behind
        for a in agents:
            if a.poll() is None:
                a.terminate()
                try:
                    a.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    a.kill()
    assert [a.returncode for a in agents] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    rec = json.loads((tmp_path / "parallelism_choice.json").read_text())
    assert rec["nodes"] == 2 and "2 processes on 2 node(s)" in rec["where"]
    sweep = {r["layout"]: r for r in rec["sweep"]}
    assert sweep["dp1 x tp2 x pp1"]["inter_MiB"] > 0 and sweep["dp1 x tp2 x pp1"]["intra_MiB"] == 0
