"""Run one function on N ranks, from a notebook cell or a script, and get the results back.

    results = labkit.launch(fn, x, world_size=2, cluster="auto", timeout_s=30)

Each rank is a fresh process with the default process group initialised (NCCL on a GPU
node, the emulated link over gloo otherwise); `fn(*args, **kwargs)` runs on every rank
and the return values come back in rank order. What the ranks print comes back too,
prefixed with the rank, after the ranks end, rank 0 first: ranks never print over each other.

How the failure cases are handled:

* A function defined in a notebook cell travels by value (cloudpickle); workers start from
  a fork server that has imported torch but never touched CUDA, so starting is fast and
  CUDA-safe (a forked CUDA context is unusable; see the CUDA semantics notes in PyTorch).
* Ranks meet through a TCPStore that the parent binds on port 0 (the kernel picks a free
  port, so there is no bind-then-close race and parallel launches cannot collide).
* A rank that raises writes its exception and traceback and exits; the parent stops the
  other ranks at once and raises `RankError` naming the rank, the original type, message
  and traceback (the original exception is the `__cause__`).
* A rank that dies (exit code, signal) is named with its code or signal.
* A collective that never completes (one rank skipped it, or the shapes differ) ends in
  gloo's timeout; each emulated rank leaves a record of its collectives (`labkit.machine.emulate.record`),
  on NCCL the flight recorder's dump (`labkit.machine.flight_recorder`), and the error names the operation
  and the rank that is missing or mismatched. If the other
  ranks have already ended, the stragglers get `timeout_s` plus a few seconds, then are stopped.
* Ctrl-C / a kernel interrupt kills every rank before the exception propagates. Workers
  also die with the parent, even on SIGKILL: PR_SET_PDEATHSIG plus a watchdog thread.

Under `torchrun` (RANK, WORLD_SIZE and the rendezvous variables are set), `launch` runs `fn` in
the current process instead (`labkit.machine.torchrun`), so the same experiment scales to several nodes with
torchrun's rendezvous.

What each rank runs, from start to exit, is `labkit.machine.worker`; inside a rank, `labkit.machine.runtime`.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from labkit import validate
from labkit.cluster import Cluster
from labkit.errors import RankError
from labkit.machine import emulate, flight_recorder, rank_server, torchrun, worker
from labkit.machine.emulate import diagnose_hang

__all__ = ["RankError", "launch"]

_GRACE_S = 3.0  # what stragglers get beyond timeout_s once another rank has ended


# -------------------------------------------------------------------- the parent


@dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any = None
    info: dict | None = None
    exitcode: int | None = None


def _mp_context() -> Any:
    """Where the ranks start from: the session's rank server (`rank_server`), else this process's own fork
    server, which imports what every rank imports once (`rank_server.preload`)."""
    served = rank_server.served_context()
    if served is not None:
        return served
    if sys.platform.startswith("linux") and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(rank_server.preload())
        _start_fork_server_deaf_to_ctrl_c()
        return ctx
    return mp.get_context("spawn")


def _start_fork_server_deaf_to_ctrl_c() -> None:
    """Start the fork server (once per process) ignoring SIGINT, and so the ranks it forks.

    A notebook's kernel and everything it starts share one process group, to which Jupyter sends SIGINT for
    the Stop button and before every shutdown (jupyter_client's `_async_shutdown_kernel`). A fork server
    still importing torch printed a KeyboardInterrupt traceback into the run's output. The ranks need no
    SIGINT: the launching process gets it and stops every rank itself (`_stop`). A disposition of SIG_IGN is
    inherited through fork and exec, and Python installs its own SIGINT handler only where SIGINT was not
    ignored at start-up (Python's signal module docs)."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread: the server starts as before
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


def _validate(fn: Any, timeout_s: Any) -> None:
    if not callable(fn):
        raise TypeError(f"launch(fn=...) needs a function, got {type(fn).__name__}: {fn!r}")
    validate.positive_number("timeout_s", timeout_s, "launch(fn, timeout_s=30), in seconds")
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if (
        main_file is not None
        and getattr(sys.modules["__main__"].__spec__, "name", None) is None
        and not os.path.isfile(main_file)
    ):
        # multiprocessing makes each worker run the main script again from its path; a script
        # read from standard input has none, and every rank would die before it starts.
        raise RuntimeError(
            f"labkit.launch cannot start ranks from a script without a file (__main__ is {main_file!r}, e.g. "
            "`python3 - <<EOF`): save the script to a file and run that, or use a notebook, `python3 -c` "
            "or an interactive session."
        )
    if getattr(mp.current_process(), "_inheriting", False):
        # multiprocessing runs a script's top level again in every worker it starts; a launch
        # there would start workers from inside a worker. Say so instead of a pile of tracebacks.
        raise RuntimeError(
            "labkit.launch was called while a rank was importing your script's main module: "
            'put the call under `if __name__ == "__main__":` (a notebook cell needs nothing).'
        )


def _stop(procs: list, grace_s: float = 1.0) -> None:
    """SIGTERM every live rank, then SIGKILL what is left after `grace_s`."""
    procs = [p for p in procs if p.pid is not None]  # a failed start leaves some unstarted
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
            p.join(5)


def _read_outcome(rank: int, proc, run_dir: Path) -> _Outcome:
    path = run_dir / f"rank{rank}.result"
    if path.exists():
        data = cloudpickle.loads(path.read_bytes())
        if data["ok"]:
            return _Outcome(rank, True, value=data["value"], exitcode=proc.exitcode)
        return _Outcome(rank, False, info=data, exitcode=proc.exitcode)
    return _Outcome(rank, False, info=None, exitcode=proc.exitcode)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "was stopped"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} ({-code})"
    return f"exited with code {code}"


_COMM_ERROR_TYPES = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


def _failed_in_collective(info: dict, record: dict | None) -> bool:
    """Did this rank raise from inside a collective (so a peer may be the cause)?

    Decided by the rank's own collective record, not by words in the message: a user's
    RuntimeError about a tensor size must not be reported as a hang.
    """
    return info.get("type") in _COMM_ERROR_TYPES and bool(record and record.get("pending"))


def _error_for(first: _Outcome, records: dict[int, dict], world_size: int, others: list[str]) -> RankError:
    tail = f"\n(other ranks: {'; '.join(others)})" if others else ""
    info = first.info
    if info is None:
        exited = _describe_exit(first.exitcode)
        header = f"rank {first.rank} {exited} without returning a result (see its output above)."
    else:
        header = f"rank {first.rank} raised {info['type']}: {info['message']}"
    # A rank that died, or whose collective failed, may be the victim of a peer that skipped
    # or mismatched a collective: the records say which.
    in_collective = info is None or _failed_in_collective(info, records.get(first.rank))
    diag = diagnose_hang(records, world_size) if in_collective else None
    trace = info["traceback"] if info else ""
    if diag is not None:
        text, culprit = diag
        return RankError(
            f"collective hang or mismatch.\n{text}\n\n{header}{tail}",
            rank=culprit if culprit is not None else first.rank,
            kind="hung",
            exc_type=info["type"] if info else None,
            remote_traceback=trace,
        )
    if info is None:
        return RankError(header + tail, rank=first.rank, kind="died")
    where = _your_frame(trace)
    msg = header + (f"\n  where: {where}" if where else "")
    return RankError(
        f"{msg}{tail}\n(the rank's whole traceback is in this error's .remote_traceback)",
        rank=first.rank,
        kind="raised",
        exc_type=info["type"],
        remote_traceback=trace,
    )


_NOT_YOURS = (
    str(Path(__file__).resolve().parent),
    str(Path(torch.__file__).resolve().parent),
    str(Path(os.__file__).resolve().parent),
    "site-packages",
    "<frozen",
)
_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def _your_frame(trace: str) -> str | None:
    """The innermost frame of a rank's traceback in the caller's code (not labkit, torch or Python's
    own), with its source line when the rank could read it: where a learner looks first."""
    lines, found = trace.splitlines(), None
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m and not any(part in m["path"] for part in _NOT_YOURS):
            code = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") else ""
            found = f"{m['path']}, line {m['line']}, in {m['func']}" + (f": {code}" if code else "")
    return found


def _print_logs(run_dir: Path, world_size: int, stream) -> None:
    for r in range(world_size):
        path = run_dir / f"rank{r}.log"
        if not path.exists():
            continue
        text = path.read_text(errors="replace")
        for line in text.splitlines():
            print(f"[rank {r}] {line}", file=stream)
    stream.flush()


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    cluster: Cluster | str = "auto",
    timeout_s: float = 30.0,
    deadline_s: float | None = None,
    alike: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return their results in rank order.

    `cluster`: "auto" (NCCL if this machine has enough GPUs, else emulated), "cpu", "gpu",
    or a `labkit.Cluster`. `timeout_s` bounds every collective and the rendezvous;
    `deadline_s` (None: none) bounds the whole run, so that a rank stuck outside any
    collective (a loop that never ends) is stopped and named too. `alike=True` says every rank runs the
    same operators (data and tensor parallelism, no pipeline): on a simulated cluster one process then runs
    rank 0 and stands for the others, whose results are copies of its own (`labkit.machine.emulate.alike`);
    elsewhere it changes nothing.
    Raises `RankError` when a rank raises, dies or hangs; bad arguments raise before any
    process starts.
    """
    _validate(fn, timeout_s)
    if not isinstance(alike, bool):
        raise ValueError(f"alike={alike!r} must be True or False; e.g. launch(fn, world_size=8, alike=True)")
    if deadline_s is not None:
        validate.positive_number("deadline_s", deadline_s, "launch(fn, deadline_s=60), in seconds, or None")
    if isinstance(cluster, Cluster) and cluster.kind == "described":  # planning only: resolve says so
        Cluster.resolve(cluster, world_size)
    if torchrun.under_torchrun():  # the ranks are torchrun's: world_size must be theirs
        if world_size != torchrun.started_ranks():
            raise ValueError(
                f"launch(world_size={world_size}) under torchrun, which started WORLD_SIZE="
                f"{torchrun.started_ranks()} ranks; pass the same number (torchrun's --nnodes x "
                "--nproc-per-node)."
            )
        return torchrun.run(fn, args, kwargs, float(timeout_s), cluster)
    if (other := torchrun.external_ranks()) is not None:
        launcher, task, tasks = other
        raise ValueError(
            f"this process is task {task} of {tasks} that {launcher} started, not under torchrun: "
            f"launch would start {world_size} more ranks here, on this node alone. Start the tasks with "
            "torchrun (inside srun: one torchrun per node, see the SLURM example in the README)."
        )
    resolved = Cluster.resolve(cluster, world_size)  # checks world_size: a positive int the cluster holds
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"launch could not send fn and its arguments to the ranks ({exc}); "
            "pass plain data, tensors and functions, not open files or locks."
        ) from exc

    with _quick_name_lookups():
        results = _start_and_supervise(
            payload, world_size, resolved, float(timeout_s), deadline_s, alike and resolved.is_simulated
        )
    return results + [copy.deepcopy(results[0]) for _ in range(world_size - len(results))]


# torch's TCPStore names the address of every connection it makes (c10d `formatSockAddr` -> `getnameinfo`,
# in each client's `SocketImpl` and in the server's `LibUVStoreDaemon::onConnect`, which runs in this
# process). The ranks connect over the IPv4-mapped ::ffff:127.0.0.1, which glibc's files backend does not
# match against /etc/hosts' 127.0.0.1, so each is a reverse DNS query; where the resolver drops one, glibc
# asks again after resolv.conf(5)'s default timeout of 5 s, and the store serves no rank meanwhile: a launch
# stalls 5 s. A launch asks glibc to retry after 1 s instead, unless RES_OPTIONS is set.
_RESOLVER_OPTIONS = "timeout:1"


@contextlib.contextmanager
def _quick_name_lookups() -> Iterator[None]:
    """RES_OPTIONS=timeout:1 in this process and its ranks while a launch runs, unless the user set it.

    glibc reads RES_OPTIONS when a thread first resolves a name, so the store's server thread, made by the
    launch, and the ranks take it; it is put back before the launch returns."""
    if "RES_OPTIONS" in os.environ:
        yield
        return
    os.environ["RES_OPTIONS"] = _RESOLVER_OPTIONS
    try:
        yield
    finally:
        os.environ.pop("RES_OPTIONS", None)


def _start_and_supervise(
    payload: bytes,
    world_size: int,
    resolved: Cluster,
    timeout_s: float,
    deadline_s: float | None,
    alike: bool = False,
) -> list[Any]:
    """Start the ranks around a store of this process, supervise them, and clean up (`launch`). With
    `alike`, rank 0 alone, in a world of `world_size`: its result alone comes back."""
    ctx = _mp_context()
    processes = 1 if alike else world_size
    run_dir = Path(tempfile.mkdtemp(prefix="labkit-launch-"))
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=float(timeout_s))
    )
    env = dict(os.environ)
    env.pop(emulate.ALIKE_ENV, None)
    if alike:
        env[emulate.ALIKE_ENV] = "1"
    # collectives on NCCL: not on the emulated cluster, nor on CI's fake CUDA machine (emulated backend)
    nccl = not (resolved.is_emulated or resolved.is_fake_cuda)
    if nccl:  # NCCL's flight recorder: what a hang or a skipped collective leaves to read
        env.update(flight_recorder.env_for(run_dir))
    procs = [
        ctx.Process(
            target=worker.main,
            name=f"labkit-rank{r}",
            daemon=True,
            args=(
                r,
                world_size,
                payload,
                store.port,
                str(run_dir),
                os.getpid(),
                resolved.to_json(),
                float(timeout_s),
                env,
            ),
        )
        for r in range(processes)
    ]
    try:
        for p in procs:
            p.start()
        deadline = None if deadline_s is None else time.monotonic() + float(deadline_s)
        outcomes = _supervise(procs, run_dir, processes, float(timeout_s), deadline, nccl=nccl)
    except BaseException:
        _stop(procs, grace_s=0.5)
        raise
    finally:
        _stop(procs)
        _print_logs(run_dir, processes, sys.stdout)
        for p in procs:
            with contextlib.suppress(Exception):
                p.close()
        del store
        shutil.rmtree(run_dir, ignore_errors=True)
    return outcomes


def _records(run_dir: Path, world_size: int, nccl: bool) -> dict[int, dict]:
    """Each rank's collective record: the emulated group's files, or NCCL's flight-recorder dumps."""
    if not nccl:
        return emulate.read_collective_records(run_dir)
    # Once one rank's watchdog has dumped (a collective timed out), the others dump at about the same time:
    # give them a moment. Without any dump (a rank simply raised) there is nothing to wait for.
    deadline = time.monotonic() + 5.0
    while 0 < len(flight_recorder.dumped_ranks(run_dir)) < world_size and time.monotonic() < deadline:
        time.sleep(0.2)
    return flight_recorder.read_collective_records(run_dir)


def _supervise(
    procs: list,
    run_dir: Path,
    world_size: int,
    timeout_s: float,
    deadline: float | None = None,
    nccl: bool = False,
) -> list[Any]:
    outcomes: dict[int, _Outcome] = {}
    started = time.monotonic()
    first_end: float | None = None
    by_sentinel = {p.sentinel: r for r, p in enumerate(procs)}
    while len(outcomes) < world_size:
        alive = [p.sentinel for r, p in enumerate(procs) if r not in outcomes]
        ready = mp.connection.wait(alive, timeout=0.1)
        for s in ready:
            r = by_sentinel[s]
            procs[r].join()
            outcomes[r] = _read_outcome(r, procs[r], run_dir)
            first_end = first_end or time.monotonic()
        if first_end is None and any((run_dir / f"rank{r}.result").exists() for r in range(world_size)):
            first_end = time.monotonic()  # a rank returned (and waits to leave with the others)
        failed = [o for o in outcomes.values() if not o.ok]
        if failed:
            first = failed[0]
            _stop([p for r, p in enumerate(procs) if r not in outcomes], grace_s=0.2)
            records = _records(run_dir, world_size, nccl)
            others = [
                f"rank {o.rank} "
                + (
                    "returned"
                    if o.ok
                    else f"failed ({o.info['type']})"
                    if o.info
                    else _describe_exit(o.exitcode)
                )
                for o in sorted(outcomes.values(), key=lambda o: o.rank)
                if o is not first
            ]
            for r in (r for r in range(world_size) if r not in outcomes):
                returned = _read_outcome(r, procs[r], run_dir).ok  # waiting to leave with the others
                others.append(f"rank {r} {'returned' if returned else 'was stopped while running'}")
            err = _error_for(first, records, world_size, others)
            original = None
            if first.info is not None and first.info.get("exception") is not None:
                with contextlib.suppress(Exception):
                    original = cloudpickle.loads(first.info["exception"])
            raise err from original
        if deadline is not None and time.monotonic() > deadline:
            alive = [r for r in range(world_size) if r not in outcomes]
            running = [r for r in alive if not (run_dir / f"rank{r}.result").exists()] or alive
            _stop([procs[r] for r in alive], grace_s=0.2)
            diag = diagnose_hang(_records(run_dir, world_size, nccl), world_size)
            raise RankError(
                f"the run did not finish within its deadline of {deadline - started:.0f} s (deadline_s): "
                f"rank(s) {running} were still running and were stopped"
                + (f".\n{diag[0]}" if diag else ", outside any collective: look for a loop that never ends."),
                rank=running[0],
                kind="hung",
            )
        if first_end is not None and time.monotonic() - first_end > timeout_s + _GRACE_S:
            # Some ranks returned long ago; the rest are stuck where gloo's timeout did not fire.
            alive = [r for r in range(world_size) if r not in outcomes]
            waiting = [r for r in alive if not (run_dir / f"rank{r}.result").exists()] or alive
            _stop([procs[r] for r in alive], grace_s=0.2)
            records = _records(run_dir, world_size, nccl)
            diag = diagnose_hang(records, world_size)
            text = diag[0] if diag else "no collective record was left"
            raise RankError(
                f"rank(s) {waiting} still running {timeout_s + _GRACE_S:.0f} s after the other ranks "
                f"returned; they were stopped.\n{text}",
                rank=waiting[0],
                kind="hung",
            )
    return [outcomes[r].value for r in range(world_size)]
