"""`launch` inside a process that torchrun started: this process is one rank; run here, gather every result.

torchrun (`torch.distributed.run`) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, the rendezvous
(MASTER_ADDR / MASTER_PORT) and TORCHELASTIC_RUN_ID. `launch` then calls `run` instead of starting ranks:

* the default group is "cpu:gloo,cuda:nccl" on a CUDA machine (NCCL for CUDA tensors, gloo for the CPU
  tensors a lab also reduces: NCCL alone refuses them), bound to this rank's GPU (`device_id`), after
  checking that the node has a GPU for every local rank;
* a `cluster=` it cannot honour is refused: the emulated cluster (links, virtual clock, memory budget)
  exists only for ranks that `launch` starts itself; a GPU cluster's `memory_gib` is applied as a memory
  fraction above the warm process's baseline (`labkit.rank_setup`), as `launch` does;
* a rank that raises still joins the gather, so every rank raises one `RankError` naming it at once, instead
  of the others waiting for a collective until the NCCL watchdog ends them;
* NCCL's flight recorder dumps into `./nccl_dumps/` when a collective times out (unless its variables are
  set): `python -m labkit.flight_recorder nccl_dumps --world-size N` names the operation and the rank
  afterwards;
* the group made for the first launch stays for the next ones (destroyed at exit);
* a process that another launcher started as one of several ranks (srun, mpirun) without torchrun is refused
  with the fix (`external_ranks`): launching here would start a whole job on this node alone.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from labkit import rank_setup
from labkit.errors import RankError
from labkit.worker import to_cpu

__all__ = ["check_cluster", "external_ranks", "leave", "run", "under_torchrun"]


def under_torchrun() -> bool:
    """True in a process that torchrun started (its rendezvous variables are set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


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
    world_size: int,
    timeout_s: float,
    cluster: Any = "auto",
) -> list[Any]:
    """Run `fn` on this torchrun rank and return every rank's result, in rank order (see the module
    docstring)."""
    if world_size != int(os.environ["WORLD_SIZE"]):
        raise ValueError(
            f"launch(world_size={world_size}) under torchrun, which started "
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} ranks; pass the same number (torchrun's --nnodes x "
            "--nproc-per-node)."
        )
    check_cluster(cluster)
    # The group outlives this launch: a script's next launch reuses it. Destroying and re-creating it at once
    # raced in gloo's rendezvous (a rank read its peer's address from the old group: "Connection refused").
    if rank_setup.init_torchrun_rank(timedelta(seconds=timeout_s), getattr(cluster, "memory_gib", None)):
        atexit.register(_destroy)
    try:
        outcome: tuple[bool, Any] = (True, to_cpu(fn(*args, **kwargs)))
        error = None
    except Exception as exc:  # join the gather anyway: the other ranks learn of it now, not at a timeout
        outcome, error = (False, (type(exc).__name__, str(exc), traceback.format_exc())), exc
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    failed = [(rank, info) for rank, (ok, info) in enumerate(gathered) if not ok]
    if failed:
        rank, (name, message, remote) = failed[0]
        raise RankError(
            f"rank {rank} raised {name}: {message}\n\n{remote}",
            rank=rank,
            kind="raised",
            exc_type=name,
            remote_traceback=remote,
        ) from error
    return [value for _, value in gathered]


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def leave(status: int) -> NoReturn:
    """End this torchrun rank with `status`: destroy its group, flush its output, and exit without the
    interpreter's teardown. Left to teardown, gloo's threads and sockets sometimes outlived their objects and
    aborted the process ("terminate called without an active exception", SIGABRT: 1 of 8 runs of lab 02's
    script on 4 CPU ranks, measured), as they did for launched ranks (`labkit.worker` leaves the same way)."""
    try:
        _destroy()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
