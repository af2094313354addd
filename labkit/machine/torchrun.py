"""`launch` inside a process that torchrun started: this process is one rank; run here, gather every result.

torchrun (`torch.distributed.run`) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, the rendezvous
(MASTER_ADDR / MASTER_PORT) and TORCHELASTIC_RUN_ID. `launch` then calls `run` instead of starting ranks:

* the default group is "cpu:gloo,cuda:nccl" on a CUDA machine (NCCL for CUDA tensors, gloo for the CPU
  tensors a lab also reduces: NCCL alone refuses them), bound to this rank's GPU (`device_id`), after
  checking that the node has a GPU for every local rank;
* a `cluster=` it cannot honour is refused: the emulated cluster (links, virtual clock, memory budget)
  exists only for ranks that `launch` starts itself; a GPU cluster's `memory_gib` is applied as a memory
  fraction above the warm process's baseline (`labkit.machine.rank_setup`), as `launch` does;
* every rank reports its outcome (its result or its error) through the rendezvous store, not a collective, so
  every rank that can raises one `RankError` naming the first rank that raised within seconds; a peer
  blocked in an NCCL operation the failed rank never issued cannot hold the report up until the watchdog
  (the failed rank exits, and torchrun's agent stops the rest);
* NCCL's flight recorder dumps into `./nccl_dumps/` when a collective times out (unless its variables are
  set): `python -m labkit.machine.flight_recorder nccl_dumps --world-size N` names the operation and the
  rank afterwards;
* the group made for the first launch stays for the next ones (destroyed at exit);
* a process that another launcher started as one of several ranks (srun, mpirun) without torchrun is refused
  with the fix (`external_ranks`): launching here would start a whole job on this node alone.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from labkit.errors import RankError
from labkit.machine import _torch_compat, rank_setup
from labkit.machine.worker import to_cpu

__all__ = ["check_cluster", "external_ranks", "leave", "run", "started_ranks", "under_torchrun"]

_GRACE_S = 3.0  # once a rank has failed, how long the others get to report theirs
_POLL_S = 0.02


def under_torchrun() -> bool:
    """True in a process that torchrun started (its rendezvous variables are set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def started_ranks() -> int:
    """How many ranks torchrun started (its --nnodes x --nproc-per-node: WORLD_SIZE)."""
    return int(os.environ["WORLD_SIZE"])


def external_ranks() -> tuple[str, int, int] | None:
    """(launcher, this task, tasks) when srun or mpirun started this process as one of several, else None.

    For SLURM the step's task count (`SLURM_STEP_NUM_TASKS`, set by srun for the tasks of a step), not the
    allocation's (`SLURM_NTASKS`): a batch script, or a Jupyter started inside `salloc --ntasks 8`, inherits
    SLURM_NTASKS=8 and SLURM_PROCID=0 while it is one process (srun(1), OUTPUT ENVIRONMENT VARIABLES).
    """
    for launcher, rank_var, size_var in (
        ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
        ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("mpirun", "PMI_RANK", "PMI_SIZE"),
    ):
        size = os.environ.get(size_var, "")
        if size.isdigit() and int(size) > 1 and rank_var in os.environ:
            return launcher, int(os.environ[rank_var]), int(size)
    return None


def check_cluster(cluster: Any) -> None:
    """Raise ValueError for a `cluster=` that ranks torchrun started cannot be: an emulated one."""
    kind = getattr(cluster, "kind", cluster)
    if kind in ("cpu", "emulated"):
        raise ValueError(
            f"launch(cluster={cluster if isinstance(cluster, str) else 'Cluster.emulated(...)'!r}) under "
            "torchrun: the emulated cluster (modelled links, virtual clock, memory budget) needs the ranks "
            "labkit.launch starts itself, and torchrun has started them. Run the script without torchrun "
            "for the emulated cluster, or pass cluster='auto' (NCCL on GPUs, plain gloo on CPUs) under "
            "torchrun."
        )


def run(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    timeout_s: float,
    cluster: Any = "auto",
) -> list[Any]:
    """Run `fn` on this torchrun rank and return every rank's result, in rank order (see the module
    docstring). The ranks are torchrun's: `launch` has checked that its world_size is `started_ranks()`."""
    check_cluster(cluster)
    # The group outlives this launch: a script's next launch reuses it. Destroying and re-creating it at once
    # raced in gloo's rendezvous (a rank read its peer's address from the old group: "Connection refused").
    if rank_setup.init_torchrun_rank(timedelta(seconds=timeout_s), getattr(cluster, "memory_gib", None)):
        atexit.register(_destroy)
    try:
        outcome: tuple[bool, Any] = (True, to_cpu(fn(*args, **kwargs)))
        error = None
    except Exception as exc:  # report it anyway: the other ranks learn of it now, not at a timeout
        outcome, error = (False, (type(exc).__name__, str(exc), traceback.format_exc())), exc
    gathered = _exchange(
        _torch_compat.default_store(), dist.get_rank(), dist.get_world_size(), outcome, timeout_s
    )
    failed = [(rank, got[1]) for rank, got in enumerate(gathered) if got is not None and not got[0]]
    if failed:
        rank, (name, message, remote) = failed[0]
        raise RankError(
            f"rank {rank} raised {name}: {message}\n\n{remote}",
            rank=rank,
            kind="raised",
            exc_type=name,
            remote_traceback=remote,
        ) from error
    missing = [rank for rank, got in enumerate(gathered) if got is None]
    if missing:
        raise RankError(
            f"rank(s) {missing} did not return from this launch within {timeout_s:g} s (timeout_s): "
            "blocked in a collective, or still computing. NCCL's flight recorder names the collective "
            "(python -m labkit.machine.flight_recorder nccl_dumps --world-size N)",
            rank=missing[0],
            kind="hung",
        ) from error
    return [got[1] for got in gathered if got is not None]


def _exchange(
    store: dist.Store, rank: int, world_size: int, outcome: tuple[bool, Any], timeout_s: float
) -> list[tuple[bool, Any] | None]:
    """Every rank's outcome of this launch, through the rendezvous store: None for a rank that gave none.

    Not a collective: a rank that raised may have left a peer blocked in an NCCL operation it never issued,
    and a gather behind it would wait for the watchdog. Once any rank has failed, the others get `_GRACE_S`
    to report (so every rank names the same first failure) and then the launch ends; a successful launch
    waits up to `timeout_s` for the slowest rank. Each rank counts its launches, in the same order on every
    rank, so a script's next launch reads fresh keys."""
    n = store.add(f"labkit/launches/rank{rank}", 1)
    keys = [f"labkit/launch{n}/rank{r}" for r in range(world_size)]
    store.set(keys[rank], pickle.dumps(outcome))
    got: list[tuple[bool, Any] | None] = [None] * world_size
    got[rank] = outcome
    deadline = time.monotonic() + timeout_s
    while True:
        for r in range(world_size):
            if got[r] is None and store.check([keys[r]]):
                got[r] = pickle.loads(store.get(keys[r]))
        failed = any(g is not None and not g[0] for g in got)
        if all(g is not None for g in got):
            return got
        if failed:
            deadline = min(deadline, time.monotonic() + _GRACE_S)
        if time.monotonic() >= deadline:
            return got
        time.sleep(_POLL_S)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def leave(status: int) -> NoReturn:
    """End this torchrun rank with `status`: destroy its group, flush its output, and exit without the
    interpreter's teardown. Left to teardown, gloo's threads and sockets sometimes outlived their objects and
    aborted the process ("terminate called without an active exception", SIGABRT: 1 of 8 runs of lab 02's
    script on 4 CPU ranks, measured), as they did for launched ranks (`labkit.machine.worker` leaves the same
    way)."""
    try:
        _destroy()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
