"""labkit.machine.torchrun: `launch` in a process torchrun started runs there and gathers every rank's result;
the group stays for the next launch, a rank's error reaches every rank at once, an emulated cluster is
refused, and a task another launcher started without torchrun is told how to start."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from labkit.machine import torchrun
from labkit.machine.launcher import launch


def test_under_torchrun_launch_runs_on_the_torchrun_ranks(tmp_path, labkit_env):
    script = tmp_path / "experiment.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist
            import labkit

            def fn(x):
                t = torch.tensor([float(dist.get_rank() + x)])
                dist.all_reduce(t)
                return t.item()

            def fails_on_rank_1():
                if dist.get_rank() == 1:
                    raise ValueError("boom on rank 1")
                return 0

            if __name__ == "__main__":
                rank = int(__import__("os").environ["RANK"])
                results = labkit.launch(fn, 1, world_size=2)
                if rank == 0:  # the group stays for the script's next launches
                    print("RESULTS", results, "group kept" if dist.is_initialized() else "group gone",
                    flush=True)
                def say(line):  # one write per line: the two ranks share this stdout
                    __import__("os").write(1, (line + "\\n").encode())

                try:  # every rank hears of it at once, not when a collective times out
                    labkit.launch(fails_on_rank_1, world_size=2, timeout_s=60)
                except labkit.RankError as err:
                    say(f"RANKERROR on {rank}: rank {err.rank} {err.exc_type} " + str(err).splitlines()[0])
                try:
                    labkit.launch(fn, 1, world_size=2, cluster="cpu")
                except ValueError as err:
                    say(f"REFUSED on {rank}: " + str(err)[:60])
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=labkit_env,  # this checkout's labkit, wherever (or whether) it is pip-installed
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULTS [3.0, 3.0] group kept" in proc.stdout
    for rank in (0, 1):
        assert (
            f"RANKERROR on {rank}: rank 1 ValueError rank 1 raised ValueError: boom on rank 1" in proc.stdout
        )
        assert f"REFUSED on {rank}: launch(cluster='cpu') under torchrun: the emulated cluster" in proc.stdout
    # rank 0 heard of rank 1's error through the gather at once: had it waited for a collective's 60 s
    # timeout, its error would be that timeout's, not a RankError naming rank 1's ValueError


def test_a_raise_under_torchrun_is_reported_while_a_peer_is_blocked_in_a_collective(tmp_path, labkit_env):
    # rank 0 raises before the all-reduce that rank 1 waits in: a gather behind it would wait for the
    # collective's 90 s timeout (the NCCL watchdog's on GPUs). Through the store rank 0 reports at once,
    # exits 2, and torchrun's agent stops rank 1: the run ends well inside subprocess.run's 60 s.
    script = tmp_path / "blocked.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch, torch.distributed as dist
            import labkit
            from labkit.machine import torchrun

            def fn():
                if dist.get_rank() == 0:
                    raise ValueError("boom before the all-reduce")
                dist.all_reduce(torch.ones(1))  # never joined by rank 0
                return 1

            if __name__ == "__main__":
                try:
                    labkit.launch(fn, world_size=2, timeout_s=90)
                except labkit.RankError as err:
                    os.write(1, f"RANKERROR on {dist.get_rank()}: {str(err).splitlines()[0]}\\n".encode())
                    torchrun.leave(2)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=labkit_env,
    )
    assert proc.returncode != 0
    assert "RANKERROR on 0: rank 0 raised ValueError: boom before the all-reduce" in proc.stdout, proc.stderr[
        -3000:
    ]


def test_an_emulated_cluster_is_refused_under_torchrun():
    from labkit import Cluster

    for cluster in ("cpu", "emulated", Cluster.emulated(gpus_per_node=2)):
        with pytest.raises(ValueError, match="under torchrun: the emulated cluster"):
            torchrun.check_cluster(cluster)
    torchrun.check_cluster("auto")
    torchrun.check_cluster("gpu")


def test_tasks_of_srun_or_mpirun_are_recognised(monkeypatch):
    for var in (
        "SLURM_NTASKS",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "PMI_SIZE",
        "PMI_RANK",
    ):
        monkeypatch.delenv(var, raising=False)
    assert torchrun.external_ranks() is None
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # one task: nothing to refuse
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert torchrun.external_ranks() is None
    # a batch script or a Jupyter inside an 8-task allocation: the allocation's count, one process
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert torchrun.external_ranks() is None
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")  # task 3 of an srun step of 16
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert torchrun.external_ranks() == ("srun", 3, 16)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    assert torchrun.external_ranks() == ("mpirun", 2, 4)


def test_a_world_size_other_than_torchruns_is_refused(monkeypatch):
    for name, value in (("TORCHELASTIC_RUN_ID", "job"), ("RANK", "0"), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError, match=r"launch\(world_size=2\) under torchrun, which started WORLD_SIZE=4"
    ):
        launch(abs, 1, world_size=2)
