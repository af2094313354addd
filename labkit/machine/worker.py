"""One launched rank, from start to exit: what `labkit.launch` runs in each worker process.

`main` ties the rank to its parent (it dies with it, even on SIGKILL), sends its output to
a per-rank log the parent prints in rank order, sets the rank's environment as torchrun
would, initialises its process group (`labkit.machine.runtime`), runs the user's function (under
the emulated memory budget when the cluster has one), writes the result or the exception
to a file, and leaves with `os._exit`, without interpreter teardown. The parent side, its
supervision and its errors, is `labkit.launch`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from labkit.cluster import Cluster
from labkit.machine import _torch_compat as compat
from labkit.machine import emulate, rank_setup, runtime

__all__ = ["main", "to_cpu"]


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _watch_launcher(pid: int) -> None:
    """Exit when the launching process is gone (covers the fork server's own parent)."""

    def loop() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
            time.sleep(0.5)

    threading.Thread(target=loop, name="labkit-watchdog", daemon=True).start()


def to_cpu(value: Any) -> Any:
    """Detach tensors and move them to the CPU so the parent can unpickle without CUDA: in lists, tuples,
    dicts (pytree's containers) and dataclasses (a result type such as `DPResult`), at any depth."""

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().cpu()
        if dataclasses.is_dataclass(v) and not isinstance(v, type):  # pytree does not walk these
            return dataclasses.replace(
                v, **{f.name: to_cpu(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
            )
        return v

    return compat.tree_map(leaf, value)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _finish_record(status: str) -> None:
    if dist.is_initialized() and isinstance(dist.group.WORLD, emulate.EmulatedProcessGroup):
        dist.group.WORLD.record.finish(status)


def _redirect_output(run_dir: Path, rank: int) -> None:
    """One log per rank at the file-descriptor level, so C++ warnings are captured too. A rank whose launch's
    folder is already gone was abandoned while it started (Ctrl-C: the launcher stopped the ranks and removed
    the folder before the fork server got to this one): it leaves quietly instead of a traceback."""
    try:
        log_fd = os.open(run_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except FileNotFoundError:
        os._exit(1)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)


def _rank_env(
    rank: int, world_size: int, cluster: Cluster, cluster_json: str, run_dir: str
) -> dict[str, str]:
    """The environment of a rank, as torchrun would set it, plus what labkit's ranks read."""
    per_node = max(1, cluster.gpus_per_node)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(min(world_size, per_node)),
        runtime.CLUSTER_ENV: cluster_json,
        emulate.TOPOLOGY_ENV: emulate.topology_to_env(cluster.topology()),
        emulate.RECORD_DIR_ENV: run_dir,
        emulate.CLOCK_ENV: cluster.clock,
    }


def _rank_device(cluster: Cluster, rank: int) -> contextlib.AbstractContextManager:
    """What stands in for the rank's GPU around its function: the simulated card (tensors without storage,
    each operator timed on the described GPU, its memory), an emulated memory budget, or nothing."""
    if cluster.is_simulated:
        compat.real_object_collectives()  # pickled objects travel as real bytes
        stack = contextlib.ExitStack()
        stack.enter_context(compat.fake_tensor_mode())
        stack.enter_context(emulate.SimulatedDevice(cluster.gpu_spec(), emulate.rank_clock(), rank=rank))
        return stack
    if cluster.is_emulated and cluster.memory_gib:
        return emulate.MemoryBudget(int(cluster.memory_gib * 2**30), rank=rank)
    return contextlib.nullcontext()


def _leave_together(store: dist.Store | None, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait until every rank has returned from fn, then leave.

    A rank that exits while a peer is still joining gloo's full mesh makes that peer fail with
    "Connection closed by peer" (measured: 1-2 in 40 launches of a collective-free function).
    Meeting in the launch's store first means no user function needs a barrier of its own. A
    peer that raised is stopped by the parent; one that hangs is the parent's to report.
    """
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(f"labkit/returned/{rank}", "1")
        # Longer than the parent's deadline for stragglers (timeout_s + a few seconds after the
        # first rank returned): the parent stops a hung peer, and this rank with it, first.
        store.wait([f"labkit/returned/{r}" for r in range(world_size)], timedelta(seconds=timeout_s + 30))


def _failure_info(exc: BaseException) -> dict[str, Any]:
    """What the parent needs to re-raise a rank's exception (the exception itself if it pickles)."""
    try:
        pickled = cloudpickle.dumps(exc)
        cloudpickle.loads(pickled)
    except Exception:
        pickled = None
    return {
        "ok": False,
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc),
        "traceback": traceback.format_exc(),
        "exception": pickled,
    }


def main(
    rank: int,
    world_size: int,
    payload: bytes,
    port: int,
    run_dir: str,
    launcher_pid: int,
    cluster_json: str,
    timeout_s: float,
    env: dict[str, str],
) -> None:
    _set_parent_death_signal()
    _watch_launcher(launcher_pid)
    out = Path(run_dir)
    _redirect_output(out, rank)
    cluster = Cluster.from_json(cluster_json)
    os.environ.update(env)  # the fork server started with an older environment
    os.environ.update(_rank_env(rank, world_size, cluster, cluster_json, run_dir))
    status, store = 1, None
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        rank_setup.init_launched_rank(cluster, rank, world_size, store, timeout)
        fn, args, kwargs = cloudpickle.loads(payload)
        with _rank_device(cluster, rank):
            result = fn(*args, **kwargs)
        _write_atomic(out / f"rank{rank}.result", cloudpickle.dumps({"ok": True, "value": to_cpu(result)}))
        status = 0
    except BaseException as exc:
        _write_atomic(out / f"rank{rank}.result", cloudpickle.dumps(_failure_info(exc)))
    finally:
        with contextlib.suppress(Exception):
            _finish_record("returned" if status == 0 else "raised")
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if status == 0:  # one process for alike ranks (emulate/alike.py): none to wait for
            _leave_together(store, rank, 1 if os.environ.get(emulate.ALIKE_ENV) else world_size, timeout_s)
            with contextlib.suppress(Exception):
                emulate.close_groups()
        # Leave without interpreter teardown: completion threads and gloo sockets still
        # open at teardown made workers abort (DESIGN.md, measured facts).
        os._exit(status)
