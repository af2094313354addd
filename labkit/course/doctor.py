"""`labkit doctor`: what this machine is, a smoke test of its ranks, where each lab runs here, and a verdict.

`doctor` prints the Python, memory, torch and CUDA versions, this CPU's calibration (`labkit.calibrate`), the
GPUs (`Cluster.detect`), a small all-reduce on the cluster asked for, one line per lab saying where it runs by
default, on how many ranks and why (`where_labs_run`: each lab's `Params.for_machine` rule and its
`RANKS_WHY`), the labs that also run on a simulated DGX, and a one-line verdict. `describe_machine` prints the
same table for a machine you do not have (`labkit doctor --as dgx-h100`, `machine_named`), without a GPU and
without starting a rank. The command line (`labkit.course.cli`) only parses its options.
"""

from __future__ import annotations

import os
import platform
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.cluster import Cluster
    from labkit.course.experiments.params import LabParams

__all__ = ["NOT_READY", "describe_machine", "doctor", "lab_line", "machine_named", "where_labs_run"]

NOT_READY = 1  # the exit status of a machine that is not ready (labkit.course.cli.EXIT_FAILED)
_INDENT = " " * 10  # under the first column's words ("labs      ")


def machine_named(spec: str) -> Cluster:
    """`labkit doctor --as`: a preset of `labkit.cluster.PRESETS`, optionally `:NODES` ("dgx-h100",
    "dgx-a100-80gb:2"), as a described cluster; ValueError with the value, the known names and the fix."""
    from labkit.cluster import PRESETS, Cluster

    name, _, nodes = spec.partition(":")
    if name not in PRESETS or (nodes and not (nodes.isdigit() and int(nodes) >= 1)):
        raise ValueError(
            f"--as {spec!r} is not a machine labkit knows; use a cluster preset, optionally with :NODES (1 "
            f"or more), among {', '.join(sorted(PRESETS))}: e.g. --as dgx-h100, or --as dgx-h100:2 for two "
            "nodes"
        )
    return Cluster.preset(name, nodes=int(nodes) if nodes else 1)


def lab_line(params_class: type[LabParams], gpus: int, here: bool = True) -> str:
    """Where lab `params_class` runs by default on a machine with `gpus` GPUs (`Params.for_machine`): on NCCL
    when it has a GPU per rank, else on the emulated cluster, with the lab's why (`RANKS_WHY`). `here`:
    this machine; else a described one ("there")."""
    params = params_class().for_machine(gpus)
    ranks = params.ranks or 2
    why = params.RANKS_WHY or "its default"
    if params.cluster == "cpu":  # lab 01: the emulated cluster whatever the GPUs
        return f"emulated cluster: {ranks} ranks, its default: {why}"
    if gpus >= ranks:  # what Cluster.resolve("auto", ranks) picks: NCCL, one process per GPU
        plural = "s" if ranks > 1 else ""
        return f"GPU{plural}: {ranks} rank{plural} on NCCL: {why}"
    if gpus:
        node = "this node" if here else "a node there"
        return f"emulated cluster: {ranks} ranks, {node} has {gpus} GPU{'s' if gpus > 1 else ''}: {why}"
    return f"emulated cluster: {ranks} ranks, no GPU {'here' if here else 'there'}"


def where_labs_run(gpus: int, machine: Cluster | None = None) -> None:
    """One line per lab (`lab_line`) for a node with `gpus` GPUs: this machine's, or one of `machine`'s
    nodes (a described preset: `labkit run` starts each notebook's ranks on one machine); then the labs that
    also run on a simulated machine."""
    from labkit.course.experiments import registry

    if machine is None:
        print("labs      where each runs here by default (its cluster, its ranks, and why):")
    else:
        print("labs      where labkit run would run each there by default (its cluster, its ranks, and why):")
    for name in registry.LABS:
        print(f"{_INDENT}{name:24} {lab_line(registry.params_of(name), gpus, here=machine is None)}")
    preset = machine.preset_name if machine is not None else "dgx-h100"
    simulable = [name for name in registry.LABS if _runs_simulated(registry.params_of(name))]
    if simulable:
        print(
            f"simulated labs {', '.join(n[:2] for n in simulable)} also run as scripts on a simulated DGX at "
            f"GPU sizes, no GPU needed, e.g. python -m {registry.module_of(simulable[0])} --cluster "
            f"sim:{preset} --world-size {gpus if machine is not None else 8} (README: A simulated DGX)"
        )


def describe_machine(machine: Cluster) -> int:
    """`labkit doctor --as`: the described `machine` (a preset's nodes) and where each lab would run there
    by default, and why. It needs no GPU and starts no rank: it describes; 0."""
    print(f"machine   {machine.preset_name} as described (labkit doctor --as): no GPU needed, nothing runs")
    print(machine.describe())
    per_node = machine.gpus_per_node
    where_labs_run(per_node, machine)
    if machine.nodes > 1:
        print(
            f"nodes     labkit run starts each notebook's ranks on one machine: {per_node} GPUs of one node, "
            f"as above. A lab's script uses all {machine.world_size} GPUs of the {machine.nodes} nodes under "
            f"torchrun, started on each node: torchrun --nnodes {machine.nodes} --nproc-per-node {per_node} "
            "--rdzv-backend c10d --rdzv-endpoint HOST:29500 -m labkit.course.experiments.<lab> "
            "(README: several nodes); there lab 01's tensor parallelism crosses a real link between nodes"
        )
    return 0


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

    from labkit.machine.runtime import device

    t = torch.full((1024,), float(dist.get_rank() + 1), device=device())
    dist.all_reduce(t)
    return t[0].item()


def doctor(cluster_kind: str = "auto", recalibrate: bool = False) -> int:
    """Print the machine, a smoke test on `cluster_kind` ("auto" | "cpu" | "gpu"), where each lab runs and a
    verdict; 0 when ready, `NOT_READY` when not."""
    import torch

    from labkit.cluster import Cluster
    from labkit.machine.launcher import launch

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
