"""`labkit doctor`: what this machine is, a smoke test of its ranks, where each lab runs here, and a verdict.

`doctor` prints the Python, memory, torch and CUDA versions, this CPU's calibration (`labkit.calibrate`), the
GPUs (`Cluster.detect`), a small all-reduce on the cluster asked for, one line per lab saying where it runs by
default and why (`where_labs_run`, from each lab's `Params`), the labs that also run on a simulated DGX, and a
one-line verdict. The command line (`labkit.cli`) only parses its options.
"""

from __future__ import annotations

import os
import platform
import time

__all__ = ["NOT_READY", "doctor", "where_labs_run"]

NOT_READY = 1  # the exit status of a machine that is not ready (labkit.cli.EXIT_FAILED)




def where_labs_run(gpus: int) -> None:
    """One line per lab: on NCCL when this node has a GPU per rank of its default run (on a one-GPU node the
    ranks it takes there, `Params.for_machine`), else on the emulated cluster, and why."""
    from labkit.experiments import registry

    print("labs      where each runs here by default (its cluster, its ranks):")
    for name in registry.LABS:
        params = registry.params_of(name)().for_machine(gpus)
        ranks = params.ranks or 2
        why = f": {params.ONE_GPU}" if gpus == 1 and params.ONE_GPU else ""
        if params.cluster == "cpu":
            where = f"emulated cluster: {ranks} ranks, its default: {params.ONE_GPU or 'cluster=cpu'}"
        elif gpus >= ranks:
            where = f"GPU{'s' if ranks > 1 else ''}: {ranks} rank{'s' if ranks > 1 else ''} on NCCL{why}"
        elif gpus:
            where = f"emulated cluster: {ranks} ranks, this node has {gpus} GPU{'s' if gpus > 1 else ''}{why}"
        else:
            where = f"emulated cluster: {ranks} ranks, no GPU here"
        print(f"          {name:24} {where}")
    simulable = [name for name in registry.LABS if _runs_simulated(registry.params_of(name))]
    if simulable:
        print(
            f"simulated labs {', '.join(n[:2] for n in simulable)} also run as scripts on a simulated DGX at "
            f"GPU sizes, no GPU needed, e.g. python -m {registry.module_of(simulable[0])} --cluster "
            "sim:dgx-h100 --world-size 8 (README: A simulated DGX)"
        )


def _runs_simulated(params: type) -> bool:
    """Does this lab's script take a simulated machine (its cluster field offers one)?"""
    from labkit.validate import ParamError

    try:
        params.make({"cluster": "sim:dgx-h100"}, "set")
    except ParamError:
        return False
    return True


def _smoke(world_size: int) -> float:
    import torch
    import torch.distributed as dist

    from labkit.runtime import device

    t = torch.full((1024,), float(dist.get_rank() + 1), device=device())
    dist.all_reduce(t)
    return t[0].item()


def doctor(cluster_kind: str = "auto", recalibrate: bool = False) -> int:
    """Print the machine, a smoke test on `cluster_kind` ("auto" | "cpu" | "gpu"), where each lab runs and a
    verdict; 0 when ready, `NOT_READY` when not."""
    import torch

    from labkit.cluster import Cluster
    from labkit.launcher import launch

    print(
        f"python    {platform.python_version()} on {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} CPU cores"
    )
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        print(f"memory    {mem:.1f} GiB")
    except (ValueError, OSError, AttributeError):
        pass
    print(f"torch     {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    from labkit import calibrate

    calibration = calibrate.cpu_gflops(recalibrate=recalibrate)
    print(f"cpu       {calibration.describe()}")
    real = Cluster.detect()
    if real.gpu_count:
        print(real.describe())
    else:
        print("GPUs      none found")
    # two ranks, or one on a node with a single GPU (common: one H200) when its GPU is asked for
    ranks = 1 if cluster_kind == "gpu" and real.gpu_count == 1 else 2
    try:
        cluster = Cluster.resolve(cluster_kind, ranks)
    except ValueError as exc:  # e.g. --cluster gpu on a machine without one: a verdict, not a traceback
        print(f"cluster   {exc}")
        print(f"verdict: NOT READY - no cluster of kind {cluster_kind!r} here; see the line above.")
        return NOT_READY
    print(cluster.describe())
    t0 = time.perf_counter()
    try:
        result = launch(_smoke, ranks, world_size=ranks, cluster=cluster, timeout_s=60)
    except Exception as exc:  # report, do not crash: the verdict is the point
        print(f"smoke test: {ranks}-rank all_reduce FAILED: {exc}")
        print(f"verdict: NOT READY - the {ranks}-rank all-reduce failed; see the error above.")
        return NOT_READY
    seconds = time.perf_counter() - t0
    want = [ranks * (ranks + 1) / 2] * ranks
    ok = result == want
    verdict = "ok" if ok else f"WRONG, expected {want}"
    print(f"smoke test: {ranks}-rank all_reduce -> {result} in {seconds:.1f} s ({verdict})")
    if not ok:
        print("verdict: NOT READY - the all-reduce returned a wrong sum.")
        return NOT_READY
    where_labs_run(real.gpu_count)
    if cluster.is_emulated and real.gpu_count:
        print(
            f"verdict: READY (emulated, {real.gpu_count} GPU) - the smoke test's {ranks} ranks need more "
            "GPUs than this node has, so they ran on the emulated cluster; labs run where the table above "
            "says, and every emulated number is labelled so."
        )
    elif cluster.is_emulated:
        print(
            "verdict: READY (emulated) - no usable GPUs, so labs run on CPU processes with modelled links; "
            "every number they print is labelled emulated."
        )
    else:
        one = (
            (
                " Labs that need several ranks run them on the emulated cluster (cluster='auto' picks it), "
                "single-GPU parts (memory, profiling, one-rank runs) use this GPU."
            )
            if cluster.gpu_count == 1
            else ""
        )
        print(f"verdict: READY (GPU) - {cluster.gpu_count} GPU(s) on NCCL.{one}")
    return 0
