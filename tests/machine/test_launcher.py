"""labkit.machine.launcher: results, notebook-defined functions, every failure case, interrupts, leaks.

No assertion here reads the wall clock: each failure case is told apart by what the error says (which
mechanism ended the run: the rank's own raise, gloo's collective timeout, the launcher's deadline or its
straggler grace), and `timeout_s` / `deadline_s` only bound a run that went wrong. How fast the launcher
reacts (raise to RankError, timeout to RankError, interrupt to every rank gone) is measured by
benchmarks/launch_latency.py."""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import Cluster, RankError, launch
from labkit.machine import rank_server

CPU = "cpu"


# -------------------------------------------------------------- worker functions


def _sum_ranks(offset: int) -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item() + offset


def _raise_on_rank1(token: str) -> int:
    if dist.get_rank() == 1:
        raise ValueError(f"bad value on purpose ({token})")
    t = torch.ones(2)
    dist.all_reduce(t)  # rank 0 waits here until it is stopped
    return 0


def _die_on_rank1(how: str) -> None:
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segv":
            ctypes.string_at(0)
    time.sleep(60)


def _skip_collective_on_rank1() -> int:
    t = torch.ones(4)
    dist.broadcast(t, 0)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    return 0


def _shape_mismatch() -> int:
    t = torch.ones(4 if dist.get_rank() == 0 else 8)
    dist.all_reduce(t)
    return 0


def _print_lines(n: int) -> int:
    for i in range(n):
        print(f"line {i} of rank {dist.get_rank()}", flush=i % 2 == 0)
    print("to stderr", file=sys.stderr)
    return dist.get_rank()


def _sleep_and_report_pid(path: str) -> None:
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _gone_eventually(pids: list[int], safety_s: float = 60.0) -> bool:
    """Whether every process in `pids` goes (polled; `safety_s` only ends a wait that would never end)."""
    deadline = time.monotonic() + safety_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _read_pids(base: str, n: int, seconds: float = 60) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            return [int(open(f"{base}.{r}").read()) for r in range(n)]
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError("workers never wrote their pids")


# -------------------------------------------------------------------- results


def test_results_in_rank_order():
    assert launch(_sum_ranks, 10, world_size=2, cluster=CPU) == [13.0, 13.0]
    assert launch(lambda: dist.get_rank() * 10, world_size=3, cluster=CPU) == [0, 10, 20]


def test_function_defined_in_a_notebook_cell_travels_by_value():
    # A notebook cell's function lives in __main__ of the kernel, which workers cannot
    # import; exec into a fresh namespace reproduces that.
    ns: dict = {}
    exec(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist
            SCALE = 3.0
            def cell_fn(x):
                t = torch.tensor([x * SCALE])
                dist.all_reduce(t)
                return t.item()
            """
        ),
        ns,
    )
    assert launch(ns["cell_fn"], 2.0, world_size=2, cluster=CPU) == [12.0, 12.0]


def test_tensor_results_and_rank_info():
    def info():
        return {
            "rank": dist.get_rank(),
            "device": str(labkit.device()),
            "emulated": labkit.current_cluster().is_emulated,
        }

    out = launch(info, world_size=2, cluster=CPU)
    assert out == [
        {"rank": 0, "device": "cpu", "emulated": True},
        {"rank": 1, "device": "cpu", "emulated": True},
    ]


def test_output_comes_back_prefixed_in_rank_order(capfd):
    launch(_print_lines, 5, world_size=2, cluster=CPU)
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("[rank")]
    ranks = [int(line.split("]")[0].split()[1]) for line in lines]
    assert ranks == sorted(ranks), "rank 0's lines come before rank 1's"
    for r in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {r}] ")]
        assert [m for m in mine if "line" in m] == [f"[rank {r}] line {i} of rank {r}" for i in range(5)]
        assert f"[rank {r}] to stderr" in mine


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"world_size": 0}, ["world_size=0", ">= 1"]),
        ({"world_size": -2}, ["world_size=-2"]),
        ({"world_size": "2"}, ["world_size='2'"]),
        ({"world_size": 2, "cluster": "tpu"}, ["cluster='tpu'", "'auto'", "'cpu'"]),
        ({"world_size": 2, "timeout_s": 0}, ["timeout_s=0"]),
        ({"world_size": 5, "cluster": "emulated-small"}, ["world_size=5", "2 GPU(s)", "Cluster.emulated"]),
    ],
)
def test_bad_input_fails_before_spawning(kwargs, words):
    # the emulated cluster unless the case names one: the refusal must not depend on the GPUs this machine has
    kwargs = {"cluster": CPU, **kwargs}
    if kwargs["cluster"] == "emulated-small":
        kwargs["cluster"] = Cluster.emulated(
            nodes=1, gpus_per_node=2, intra_node=labkit.Link(1.0), inter_node=labkit.Link(1.0)
        )
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError) as info:
        launch(_sum_ranks, 0, **kwargs)
    for w in words:
        assert w in str(info.value)
    assert set(multiprocessing.active_children()) <= before


def test_more_ranks_than_gpus_is_refused():
    more = Cluster.detect().gpu_count + 1  # one rank more than this machine has GPUs, whatever it has
    with pytest.raises(ValueError, match=r"larger than the .* GPU"):
        launch(_sum_ranks, 0, world_size=more, cluster="gpu")


# ------------------------------------------------------------------ failures


def test_rank_that_raises_is_named_with_type_message_and_traceback():
    token = os.urandom(4).hex()
    with pytest.raises(RankError) as info:
        launch(_raise_on_rank1, token, world_size=2, cluster=CPU, timeout_s=60)
    err = info.value
    assert err.rank == 1 and err.kind == "raised" and err.exc_type == "ValueError"
    assert isinstance(err.__cause__, ValueError) and token in str(err.__cause__)  # this run's own exception
    assert f"rank 1 raised ValueError: bad value on purpose ({token})" in str(err)
    # one short message with the caller's own line; the whole traceback stays on the error
    lines, first = inspect.getsourcelines(_raise_on_rank1)
    line = first + next(i for i, text in enumerate(lines) if "raise ValueError" in text)
    assert 'test_launcher.py", line' not in str(err) and "where: " in str(err)
    assert f"test_launcher.py, line {line}, in _raise_on_rank1: raise ValueError(" in str(err)
    assert "labkit/machine/worker.py" not in str(err) and "labkit/machine/worker.py" in err.remote_traceback
    assert len(str(err).splitlines()) <= 4
    # rank 0, in its all_reduce (60 s timeout), was stopped by the launcher at once, not by its timeout
    assert "rank 0 was stopped while running" in str(err)


def _runtime_error_about_sizes_on_rank1() -> int:
    if dist.get_rank() == 1:
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")
    t = torch.ones(2)
    dist.all_reduce(t)  # rank 0 waits here until it is stopped
    return 0


def test_a_users_runtime_error_is_not_reported_as_a_hang():
    with pytest.raises(RankError) as info:
        launch(_runtime_error_about_sizes_on_rank1, world_size=2, cluster=CPU, timeout_s=60)
    assert info.value.kind == "raised" and info.value.rank == 1
    assert "_runtime_error_about_sizes_on_rank1" in str(info.value)  # the traceback is kept


@pytest.mark.parametrize(
    "how, words", [("exit", "exited with code 3"), ("kill", "SIGKILL"), ("segv", "SIGSEGV")]
)
def test_rank_that_dies_is_named_with_code_or_signal(how, words):
    with pytest.raises(RankError) as info:
        launch(_die_on_rank1, how, world_size=2, cluster=CPU, timeout_s=60)
    assert info.value.rank == 1 and info.value.kind == "died"
    assert "rank 1" in str(info.value) and words in str(info.value)


def test_skipped_collective_names_the_op_and_the_missing_rank():
    with pytest.raises(RankError) as info:  # deadline_s only ends a run the timeout failed to end
        launch(_skip_collective_on_rank1, world_size=2, cluster=CPU, timeout_s=5, deadline_s=120)
    msg = str(info.value)
    assert info.value.kind == "hung" and info.value.rank == 1
    assert "all_reduce #2" in msg and "rank 1 is missing" in msg
    assert "deadline" not in msg  # ended by the collective timeout, not by the safety net


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(RankError) as info:
        launch(_shape_mismatch, world_size=2, cluster=CPU, timeout_s=5)
    msg = str(info.value)
    assert info.value.kind == "hung"
    assert "mismatched" in msg and "float32[4]" in msg and "float32[8]" in msg


def test_interrupt_stops_every_rank_and_next_launch_works(tmp_path):
    base = str(tmp_path / "pid")
    main = threading.main_thread().ident
    # Ctrl-C as Python delivers it: an earlier test's event loop may have left its own SIGINT handler behind
    # (asyncio.Runner's cancels a task instead of raising); this test is about launch, so it sets the default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sent: list[str] = []

    def interrupt_later():
        try:
            _read_pids(base, 2, seconds=60)
        except AssertionError as exc:
            sent.append(f"not sent: {exc}")
            return
        sent.append("sent")
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_later, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(_sleep_and_report_pid, base, world_size=2, cluster=CPU)
    except pytest.fail.Exception as exc:
        raise AssertionError(f"no KeyboardInterrupt; the interrupt was {sent or ['never tried']}") from exc
    finally:
        signal.signal(signal.SIGINT, previous)
    pids = _read_pids(base, 2)
    # launch stopped and reaped every rank before the interrupt reached the caller
    assert [p for p in pids if _alive(p)] == [], "every rank is gone once launch has raised"
    assert launch(_sum_ranks, 0, world_size=2, cluster=CPU) == [3.0, 3.0]


def test_script_without_main_guard_gets_told_how_to_fix_it(tmp_path):
    # Workers run a script's top level again (multiprocessing's rule); an unguarded launch
    # there must end with the fix named, not with a hang or a recursive start. A script starts its own fork
    # server, as a user's does: not the test session's rank server (which runs no main module again).
    script = tmp_path / "unguarded.py"
    script.write_text("import labkit\nprint(labkit.launch(abs, 1, world_size=2, cluster='cpu'))\n")
    env = {k: v for k, v in os.environ.items() if k != rank_server.ENV}
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr + proc.stdout
    assert "RankError: rank" in proc.stderr


def _spin_forever() -> None:
    while True:  # a livelock: no collective, so no collective timeout can end it
        pass


def test_a_deadline_ends_a_run_stuck_outside_any_collective():
    with pytest.raises(RankError, match=r"within its deadline of \d+ s \(deadline_s\)") as info:
        launch(_spin_forever, world_size=2, cluster=CPU, timeout_s=60, deadline_s=3)
    assert info.value.kind == "hung" and "a loop that never ends" in str(info.value)
    with pytest.raises(ValueError, match="deadline_s"):
        launch(_spin_forever, world_size=2, cluster=CPU, deadline_s=0)


def test_a_script_read_from_stdin_is_told_to_use_a_file():
    # multiprocessing would make every rank run "<stdin>" again from a path that does not exist.
    code = "import labkit\nprint(labkit.launch(abs, 1, world_size=2, cluster='cpu'))\n"
    proc = subprocess.run(
        [sys.executable, "-"],
        input=code,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode != 0
    assert "save the script to a file" in proc.stderr and "<stdin>" in proc.stderr
    assert "FileNotFoundError" not in proc.stderr


def test_workers_die_when_the_parent_is_killed(tmp_path):
    base = str(tmp_path / "pid")
    # the ranks' function is the script's own (it travels by value), not imported from this test module
    script = textwrap.dedent(
        f"""
        import os, time
        import torch.distributed as dist
        import labkit

        def sleep_and_report_pid(path):
            with open(f"{{path}}.{{dist.get_rank()}}", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)

        labkit.launch(sleep_and_report_pid, {base!r}, world_size=2, cluster="cpu")
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        pids = _read_pids(base, 2, seconds=60)
    finally:
        parent.kill()
        parent.wait()
    # the ranks sleep 120 s: they are gone before that only because their parent died (how soon:
    # benchmarks/launch_latency.py)
    assert _gone_eventually(pids, safety_s=60.0), "workers die with a SIGKILLed parent"


def _count_listening_sockets() -> int:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    listening = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                listening += 1
    return listening


def _children() -> int:
    me = str(os.getpid())
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            if stat.split(")")[-1].split()[1] == me:
                count += 1
    return count


def test_twenty_launches_leak_nothing():
    launch(_sum_ranks, 0, world_size=2, cluster=CPU)  # starts the fork server
    before = (_children(), len(os.listdir("/proc/self/fd")), _count_listening_sockets())
    for _ in range(20):
        assert launch(_sum_ranks, 0, world_size=2, cluster=CPU) == [3.0, 3.0]
    after = (_children(), len(os.listdir("/proc/self/fd")), _count_listening_sockets())
    assert after == before, f"(children, fds, listening sockets) before {before}, after {after}"


def test_two_launches_at_once_do_not_collide():
    results: list = [None, None]

    def run(i):
        results[i] = launch(_sum_ranks, i, world_size=2, cluster=CPU)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [[3.0, 3.0], [4.0, 4.0]]


def _wait_in_all_reduce_while_rank1_sleeps() -> int:
    t = torch.ones(2)
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.all_reduce(t)
    return 0


def test_rank_that_never_arrives_is_named_after_the_collective_timeout():
    # rank 1 would arrive after 60 s and the all_reduce complete: an error at all means the 3 s timeout
    # ended it (how soon after the timeout: benchmarks/launch_latency.py)
    with pytest.raises(RankError) as info:
        launch(_wait_in_all_reduce_while_rank1_sleeps, world_size=2, cluster=CPU, timeout_s=3)
    msg = str(info.value)
    assert info.value.kind == "hung" and info.value.rank == 1
    assert "all_reduce #1" in msg and "rank 1 is missing" in msg


def test_a_task_of_srun_without_torchrun_is_told_how_to_start(monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    monkeypatch.setenv("SLURM_PROCID", "3")
    with pytest.raises(ValueError, match="task 3 of 16 that srun started, not under torchrun"):
        launch(_sum_ranks, 0, world_size=16, cluster=CPU)


# ---------------------------------------------------------- leaving together


def _rank_only() -> int:
    return dist.get_rank()  # no collective: the ranks only meet in init_process_group


def _spin(seconds: float) -> None:
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        pass


SOAK_LAUNCHES = int(os.environ.get("LABKIT_SOAK_LAUNCHES", "10"))


def test_many_launches_without_a_collective_never_fail_even_on_busy_cores():
    # A rank that returned used to exit while its peer was still joining gloo's full mesh: 1-2 of 40 such
    # launches failed with "Connection closed by peer", until every rank waited for the others to return
    # (worker._leave_together). Since the fork server starts the ranks, that bug no longer shows without the
    # wait either, so this soak guards launches on a loaded runner (and leaks after them) rather than that one
    # bug; LABKIT_SOAK_LAUNCHES=300 for a real soak. One spinner, the parent and the two ranks make four busy
    # processes on the runner's two cores.
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    hog = ctx.Process(target=_spin, args=(600.0,), daemon=True)
    hog.start()
    failures = []
    try:
        launch(_rank_only, world_size=2, cluster=CPU)  # starts the fork server
        before = (_children(), len(os.listdir("/proc/self/fd")), _count_listening_sockets())
        for i in range(SOAK_LAUNCHES):
            try:
                assert launch(_rank_only, world_size=2, cluster=CPU) == [0, 1]
            except Exception as exc:
                failures.append(f"launch {i}: {type(exc).__name__}: {str(exc)[:200]}")
        after = (_children(), len(os.listdir("/proc/self/fd")), _count_listening_sockets())
    finally:
        hog.kill()
        hog.join()
    assert not failures, f"{len(failures)} of {SOAK_LAUNCHES} launches failed:\n" + "\n".join(failures[:5])
    assert after == before, f"(children, fds, listening sockets) before {before}, after {after}"


def _rank1_raises_after_rank0_returned() -> int:
    if dist.get_rank() == 1:
        # wait until rank 0 has returned (its result is written; it waits to leave with rank 1), then fail
        from pathlib import Path

        from labkit.machine import emulate

        returned = Path(os.environ[emulate.RECORD_DIR_ENV]) / "rank0.result"
        while not returned.exists():
            time.sleep(0.01)
        raise ValueError("rank 1 fails")
    return 0


def test_the_error_says_what_each_other_rank_did():
    with pytest.raises(RankError) as info:
        launch(_rank1_raises_after_rank0_returned, world_size=2, cluster=CPU)
    assert info.value.rank == 1 and "rank 0 returned" in str(info.value)


def _rank1_sleeps() -> int:
    if dist.get_rank() == 1:
        time.sleep(120)  # hangs outside any collective
    return 0


def test_a_rank_that_hangs_after_the_others_returned_is_named():
    # rank 1 would return after 120 s: an error means the launcher's grace after rank 0 returned ended it
    with pytest.raises(RankError) as info:
        launch(_rank1_sleeps, world_size=2, cluster=CPU, timeout_s=2)
    assert info.value.rank == 1 and "rank(s) [1] still running" in str(info.value)


# ------------------------------------------------------------------ on GPUs


def _sum_on_gpu(offset: int) -> tuple[float, str, str]:
    from labkit.machine import runtime

    dev = runtime.device()
    t = torch.full((1 << 20,), float(dist.get_rank() + offset), device=dev)
    dist.all_reduce(t)
    return t[0].item(), str(t.device), str(dev)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_all_reduce(world_size):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world_size > gpus:
        pytest.skip(f"{world_size} GPUs asked, {gpus} here")
    results = launch(_sum_on_gpu, 1, world_size=world_size, cluster="gpu", timeout_s=120)
    want = sum(r + 1 for r in range(world_size))
    assert [r[0] for r in results] == [want] * world_size
    assert all(r[1].startswith("cuda") for r in results)


def _resolver_options() -> str | None:
    return os.environ.get("RES_OPTIONS")


def test_a_launch_asks_glibc_to_retry_a_lost_name_lookup_after_1_s_and_puts_the_environment_back(monkeypatch):
    # torch's store looks up the name of every rank's address; a dropped query held the store 5 s
    # (labkit/machine/launcher.py, _quick_name_lookups)
    monkeypatch.delenv("RES_OPTIONS", raising=False)
    assert launch(_resolver_options, world_size=2, cluster=CPU) == ["timeout:1", "timeout:1"]
    assert "RES_OPTIONS" not in os.environ
    monkeypatch.setenv("RES_OPTIONS", "attempts:3")  # the user's own setting wins
    assert launch(_resolver_options, world_size=2, cluster=CPU) == ["attempts:3", "attempts:3"]
    assert os.environ["RES_OPTIONS"] == "attempts:3"
