"""Benchmark: how fast `labkit.launch` reacts when a run goes wrong, medians over several runs (wall clock).

The unit tests (tests/machine/test_launcher.py, tests/machine/test_torchrun.py) check which mechanism ends
each failing run, from what the error says; none of them reads the wall clock. How soon each one fires depends
on the machine and its load, so it is measured here, as medians, against the bounds the course promises:

    python3 benchmarks/launch_latency.py               # 3 runs of each case, a table
    python3 benchmarks/launch_latency.py --check       # exit 1 when a median misses its bound

case                    measured                                                bound
raise                   a rank raises -> RankError in the caller                2 s
never arrives           rank 0 enters its all_reduce -> RankError (timeout 3)   timeout_s + 5 s
skipped collective      the whole launch (timeout_s=5)                          timeout_s + 10 s
deadline                the whole launch of a livelock (deadline_s=3)           10 s
straggler after return  the whole launch (timeout_s=2)                          timeout_s + 15 s
interrupt               SIGINT -> KeyboardInterrupt in the caller, ranks gone   5 s
parent killed           SIGKILL of the caller -> both ranks gone                5 s
torchrun error          a torchrun job whose rank 1 raises, start to end        60 s (its timeout)

Run it alone: other work on the machine is what it measures.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import labkit
from labkit import RankError

CPU = "cpu"


def _raises_on_rank1() -> int:
    if dist.get_rank() == 1:
        raise ValueError(f"raised at {time.time()!r}")
    t = torch.ones(2)
    dist.all_reduce(t)  # rank 0 waits here until it is stopped
    return 0


def _rank1_never_arrives(stamp: str) -> int:
    t = torch.ones(2)
    if dist.get_rank() == 1:
        time.sleep(60)
    Path(stamp).write_text(repr(time.time()))
    dist.all_reduce(t)
    return 0


def _skips_a_collective_on_rank1() -> int:
    t = torch.ones(4)
    dist.broadcast(t, 0)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    return 0


def _spins_forever() -> None:
    while True:
        pass


def _rank1_sleeps() -> int:
    if dist.get_rank() == 1:
        time.sleep(120)
    return 0


def _sleeps_and_reports_pid(path: str) -> None:
    Path(f"{path}.{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def _pids(base: str, n: int, limit_s: float = 60) -> list[int]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            return [int(Path(f"{base}.{r}").read_text()) for r in range(n)]
        except (OSError, ValueError):
            time.sleep(0.02)
    raise RuntimeError("the ranks never wrote their pids")


def _gone_after(pids: list[int], t0: float, limit_s: float = 60) -> float:
    while any(_alive(p) for p in pids):
        if time.monotonic() - t0 > limit_s:
            return float("inf")
        time.sleep(0.01)
    return time.monotonic() - t0


def raise_s() -> float:
    try:
        labkit.launch(_raises_on_rank1, world_size=2, cluster=CPU, timeout_s=60)
    except RankError as err:
        return time.time() - float(str(err.__cause__).split(" at ")[1])
    raise RuntimeError("no RankError")


def never_arrives_s(timeout_s: float = 3) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = str(Path(tmp) / "entered")
        try:
            labkit.launch(_rank1_never_arrives, stamp, world_size=2, cluster=CPU, timeout_s=timeout_s)
        except RankError:
            return time.time() - float(Path(stamp).read_text())
    raise RuntimeError("no RankError")


def _whole_launch_s(fn, **kwargs) -> float:
    t0 = time.monotonic()
    try:
        labkit.launch(fn, world_size=2, cluster=CPU, **kwargs)
    except RankError:
        return time.monotonic() - t0
    raise RuntimeError("no RankError")


def interrupt_s() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "pid")
        main = threading.main_thread().ident
        sent: list[float] = []

        def later() -> None:
            _pids(base, 2)
            sent.append(time.monotonic())
            signal.pthread_kill(main, signal.SIGINT)

        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=later, daemon=True).start()
        try:
            labkit.launch(_sleeps_and_reports_pid, base, world_size=2, cluster=CPU)
        except KeyboardInterrupt:
            return _gone_after(_pids(base, 2), sent[0])
        finally:
            signal.signal(signal.SIGINT, previous)
    raise RuntimeError("no KeyboardInterrupt")


def parent_killed_s() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "pid")
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
            pids = _pids(base, 2)
        finally:
            t0 = time.monotonic()
            parent.kill()
            parent.wait()
        return _gone_after(pids, t0)


def torchrun_error_s() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "fails.py"
        script.write_text(
            textwrap.dedent(
                """
                import torch.distributed as dist
                import labkit

                def fails_on_rank_1():
                    if dist.get_rank() == 1:
                        raise ValueError("boom on rank 1")
                    return 0

                if __name__ == "__main__":
                    try:
                        labkit.launch(fails_on_rank_1, world_size=2, timeout_s=60)
                    except labkit.RankError:
                        pass
                """
            )
        )
        t0 = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(script),
            ],
            capture_output=True,
            timeout=300,
            cwd=tmp,
        )
        return time.monotonic() - t0


CASES = {
    "raise": (raise_s, 2.0),
    "never arrives": (never_arrives_s, 3 + 5.0),
    "skipped collective": (lambda: _whole_launch_s(_skips_a_collective_on_rank1, timeout_s=5), 5 + 10.0),
    "deadline": (lambda: _whole_launch_s(_spins_forever, timeout_s=60, deadline_s=3), 10.0),
    "straggler after return": (lambda: _whole_launch_s(_rank1_sleeps, timeout_s=2), 2 + 15.0),
    "interrupt": (interrupt_s, 5.0),
    "parent killed": (parent_killed_s, 5.0),
    "torchrun error": (torchrun_error_s, 60.0),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--case", choices=list(CASES), action="append", help="only these cases (repeatable)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a median misses its bound")
    args = ap.parse_args(argv)
    labkit.launch(abs, 1, world_size=2, cluster=CPU)  # start the fork server first: not part of any case
    print(f"{'case':<24} {'median s':>9} {'bound s':>8}  runs (s)")
    missed = []
    for name in args.case or list(CASES):
        fn, bound = CASES[name]
        runs = [fn() for _ in range(args.runs)]
        med = statistics.median(runs)
        print(f"{name:<24} {med:9.2f} {bound:8.1f}  {[round(r, 2) for r in runs]}")
        if med > bound:
            missed.append(f"{name}: median {med:.2f} s > {bound:.1f} s")
    print("\nmissed: " + "; ".join(missed) if missed else "\nevery median within its bound")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
