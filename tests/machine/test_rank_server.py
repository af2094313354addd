"""labkit.machine.rank_server: the session's fork server. The test session runs one per xdist worker
(tests/conftest.py), so every launch in the suite goes through it unless its client differs; the launcher's
own tests (failures, signals, interrupts, hangs, leaks) run through it too. Here: the ranks are the server's
children, a client that differs starts its own, a client that goes away leaves no rank, and the server ends
with its owner."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import Cluster, launch
from labkit.machine import rank_server, worker


def _parent_command() -> str:
    return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_the_ranks_of_a_launch_are_the_session_servers_children():
    assert rank_server.served_context() is not None
    parents = launch(_parent_command, world_size=2, cluster="cpu")
    assert all("labkit.machine.rank_server" in p for p in parents), parents


def test_a_client_on_fake_cuda_or_of_another_build_starts_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_FAKE_CUDA", "2")  # the server was started without it
    assert rank_server.served_context() is None
    monkeypatch.delenv("LABKIT_FAKE_CUDA")
    (tmp_path / "build").write_text("another labkit | another torch | another Python")
    monkeypatch.setenv(rank_server.ENV, str(tmp_path / "ranks.sock"))
    assert rank_server.served_context() is None
    monkeypatch.setenv(rank_server.ENV, str(tmp_path / "gone" / "ranks.sock"))
    assert rank_server.served_context() is None


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False


def test_a_rank_whose_client_goes_away_is_killed(tmp_path):
    served = rank_server.served_context()
    assert served is not None
    # a rank that waits 60 s for a store nobody serves (port 9), as the rank of a kernel that died might
    cluster = Cluster.resolve("cpu", 2).to_json()
    args = (0, 2, b"", 9, str(tmp_path), os.getpid(), cluster, 60.0, {})
    proc = served.Process(target=worker.main, name="labkit-rank0", args=args)
    proc.start()
    assert proc.is_alive() and Path(f"/proc/{proc.pid}").exists()
    proc.close()  # the client goes away without waiting
    assert _gone(proc.pid, within_s=10), f"rank {proc.pid} outlived its client"


def test_only_launchs_worker_is_served():
    served = rank_server.served_context()
    assert served is not None
    with pytest.raises(ValueError, match=r"runs labkit\.machine\.worker\.main only"):
        served.Process(target=print, args=())


_OWNER = """
import os, sys, time
from labkit.machine import rank_server
with rank_server.RankServer(modules=["labkit.machine.worker"]) as server:
    print(server._proc.pid, flush=True)
    time.sleep(120)
"""


def test_the_server_ends_with_its_owner():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(owner.stdout.readline())
        assert Path(f"/proc/{server_pid}").exists()
    finally:
        owner.kill()
        owner.wait()
    assert _gone(server_pid, within_s=10), "the rank server outlived its owner"


def test_serving_reuses_the_named_server_or_names_one_of_its_own_for_the_block(monkeypatch):
    named = os.environ[rank_server.ENV]
    with rank_server.serving() as server:  # the session's server is usable here: kept
        assert server is None and os.environ[rank_server.ENV] == named
    monkeypatch.delenv(rank_server.ENV)
    with rank_server.serving() as server:
        assert server is not None and os.environ[rank_server.ENV] == server.address
        assert launch(_parent_command, world_size=2, cluster="cpu")[0].count("labkit.machine.rank_server")
    assert rank_server.ENV not in os.environ and not Path(server.address).exists()
