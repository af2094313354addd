"""A lab's experiment as a script: plain Python, or one process per GPU under torchrun.

    python -m labkit.course.experiments.oom_batch     # labkit.launch starts 2 ranks (emulated on a CPU)
    torchrun --standalone --nproc-per-node 8 -m labkit.course.experiments.unoverlapped_comms --out 03.json
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m labkit.course.experiments.parallelism_choice --out 01.json

Each lab's driver module declares its `Params` (`labkit.course.experiments.params`) and
`headline(where, params)`, the lab's measurement in a few launches, returning the `LabRecords` its notebook
writes (before, after, limit, unit, meaning, metric and the extras that say why), and ends with
`main(__spec__.name)`, which runs `run_lab`.

Every rank runs the script; every `labkit.launch` inside gathers the ranks' results onto every rank
(`labkit.machine.torchrun`), so every rank computes the same records from them, and rank 0 alone prints their
headline (`summary`: the metric, then before, after and limit to 4 significant digits) and writes them all
to `--out`; `--print-records` also prints each as a `labkit-record` line, as `labkit.record` does outside a
notebook. `--set key value` overrides a parameter (JSON values; an unknown key is refused with the list;
`--help` lists the parameters with their docs); a parameter the lab cannot run with ends the script with
exit status 2 and the message (its value, the constraint and the fix) on every rank.

What the numbers are depends on where they ran, and the records say so (`where`): the emulated cluster when
`labkit.launch` starts the ranks on a machine without GPUs (virtual clock, modelled links, memory budget);
NCCL on GPUs; under torchrun on CPUs plain gloo on the wall clock (no link model, no memory budget: real
processes on one host, not a picture of GPUs).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from labkit.cluster import Cluster
from labkit.course.experiments.params import LabParams, ParamError
from labkit.course.records import record
from labkit.errors import RankError
from labkit.machine import torchrun

__all__ = [
    "LabRecords",
    "Meaning",
    "Where",
    "emulated_cluster",
    "main",
    "run_lab",
    "summary",
    "where",
]


@dataclass(frozen=True)
class Where:
    """Where a script's ranks run: pass `cluster` and `world_size` to every `labkit.launch`."""

    world_size: int
    cluster: Cluster | str  # a Cluster for ranks launch starts itself; "auto" under torchrun
    nodes: int
    gpus_per_node: int  # ranks per node
    torchrun: bool
    on_gpu: bool
    label: str  # next to every number the script prints

    @property
    def emulated(self) -> bool:
        return isinstance(self.cluster, Cluster) and self.cluster.is_emulated

    @property
    def simulated(self) -> bool:
        """A simulated GPU machine (emulated too): the lab runs at its GPU sizes in modelled time."""
        return isinstance(self.cluster, Cluster) and self.cluster.is_simulated

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`labkit.launch(fn, *args, world_size=..., cluster=..., **kwargs)` on these ranks (`cluster=` in
        `kwargs` replaces this one: the same ranks with another memory budget; `world_size=` runs fewer)."""
        from labkit.machine.launcher import launch

        kwargs.setdefault("cluster", self.cluster)
        kwargs.setdefault("world_size", self.world_size)
        return launch(fn, *args, **kwargs)

    def rank(self) -> int:
        """This process's rank under torchrun (0 in a plain script: it is the parent of the ranks)."""
        return _rank()


@dataclass(frozen=True)
class Meaning:
    """What a lab's three headline numbers are, in a sentence each."""

    before: str
    after: str
    limit: str


@dataclass(frozen=True)
class LabRecords:
    """A lab's records: the number before the fix, after it, the limit no fix beats (None where this machine
    has no figure for it), their unit and meaning, the metric, and the extras that say why; `nodes`: the nodes
    the lab spread its ranks over, where it chose them itself (lab 01), else those of `where`."""

    before: float
    after: float
    limit: float | None
    unit: str
    meaning: Meaning
    metric: str
    extras: dict[str, Any] = field(default_factory=dict)
    nodes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        head = {
            "before": self.before,
            "after": self.after,
            "limit": self.limit,
            "unit": self.unit,
            "meaning": asdict(self.meaning),
            "metric": self.metric,
        }
        return {**head, **self.extras}


def _rank() -> int:
    return int(os.environ["RANK"]) if torchrun.under_torchrun() else 0


def where(cluster: str, world_size: int) -> Where:
    """The ranks a script runs on: torchrun's when torchrun started it, else `world_size` ranks of
    `cluster`."""
    if torchrun.under_torchrun():
        torchrun.check_cluster(cluster)  # refuses the emulated cluster with the fix
        gpu = torch.cuda.is_available()
        if cluster not in ("auto", "gpu") or (cluster == "gpu" and not gpu):
            raise ValueError(
                f"--cluster {cluster} under torchrun: use auto (NCCL on GPUs, gloo on CPUs)"
                + ("" if gpu else f"; this machine has no GPU for gpu (torch {torch.__version__})")
            )
        n = int(os.environ["WORLD_SIZE"])
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", n))
        nodes = max(1, n // per_node)
        label = (
            f"measured on GPU, torchrun: {n} ranks on {nodes} node(s), NCCL"
            if gpu
            else f"torchrun on CPU: {n} processes on {nodes} node(s) over gloo, wall clock; no GPU, no link "
            "model"
        )
        return Where(n, "auto", nodes, per_node, True, gpu, label)
    resolved = Cluster.resolve(cluster, world_size)
    if resolved.is_simulated:  # the preset's nodes, as many as the ranks fill
        nodes, per_node = resolved.nodes, min(world_size, resolved.gpus_per_node)
        return Where(world_size, resolved, nodes, per_node, False, False, resolved.label)
    return Where(world_size, resolved, 1, world_size, False, not resolved.is_emulated, resolved.label)


def emulated_cluster(w: Where, **options: Any) -> Where:
    """`w` with the emulated cluster rebuilt from `options` (memory budget, nodes); unchanged elsewhere."""
    if not w.emulated:
        return w
    assert isinstance(w.cluster, Cluster)
    cluster = replace(Cluster.emulated(**options), reason=w.cluster.reason)
    return replace(
        w,
        cluster=cluster,
        world_size=cluster.world_size,
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node,
    )


def _parser(module: str, params: type[LabParams]) -> argparse.ArgumentParser:
    docs, defaults = params.field_docs(), params.defaults()
    width = max(len(f"{k} = {defaults[k]!r}") for k in docs)
    fields = "\n".join(f"  {f'{k} = {defaults[k]!r}':<{width}}  {doc}" for k, doc in docs.items())
    p = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=f"Lab {params.LAB}: measure the mistake and its fix, write the records.",
        epilog=f"parameters (--set KEY VALUE; values are JSON, a bare word is a string):\n{fields}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if params.RANKS:
        p.add_argument(
            "--world-size",
            type=int,
            default=None,
            help=f"ranks to start (sets {params.RANKS}; under torchrun its WORLD_SIZE instead)",
        )
    p.add_argument("--cluster", default=None, help="auto, cpu (emulated) or gpu; under torchrun: auto or gpu")
    p.add_argument(
        "--out", default=f"records_{params.LAB}.json", help="where rank 0 writes the records (JSON)"
    )
    p.add_argument(
        "--set",
        nargs=2,
        action="append",
        metavar=("KEY", "VALUE"),
        default=[],
        help="change a parameter (listed below)",
    )
    p.add_argument(
        "--print-records",
        action="store_true",
        help="also print each record as a `labkit-record {json}` line, for tools that read standard output "
        "(the --out file holds them all)",
    )
    return p


def _refused(lab: str, err: Exception) -> int:
    """A parameter the lab cannot run with: its message (value, constraint, fix) on every rank; exit 2."""
    rank = f" (rank {_rank()})" if torchrun.under_torchrun() else ""
    print(f"lab {lab}{rank}: {err}", file=sys.stderr, flush=True)
    return 2


def main(module: str) -> NoReturn:
    """`python -m` / `torchrun -m labkit.course.experiments.<lab>`: run the lab (`run_lab`) and exit with its
    status; a torchrun rank leaves without the interpreter's teardown (`labkit.machine.torchrun.leave`)."""
    status = run_lab(module)
    if torchrun.under_torchrun():
        torchrun.leave(status)
    raise SystemExit(status)


def run_lab(module: str, argv: list[str] | None = None) -> int:
    """Run lab `module`'s measurement as a script: parse the command line into its `Params`, run its
    `headline(where, params)` and print and write the records on rank 0; exit status 2 (on every rank) for a
    parameter it cannot run with. `module` is imported by its name, so that `launch` pickles its functions
    by reference (under `python -m` the running copy is `__main__`)."""
    lab = importlib.import_module(module)
    params_class: type[LabParams] = lab.Params
    name = params_class.LAB
    args = _parser(module, params_class).parse_args(argv)
    base = {} if args.cluster is None else {"cluster": args.cluster}
    if torchrun.under_torchrun() and args.cluster is None and "cluster" not in dict(args.set):
        base["cluster"] = "auto"  # a lab whose default is the emulated cluster runs on torchrun's ranks
    t0 = time.perf_counter()
    try:
        params = params_class.from_text(args.set, "set", base)
        if not getattr(args, "world_size", None) and not torchrun.under_torchrun():
            params = params.for_machine()  # one rank on a one-GPU machine, for a lab that has it
        w = where(params.cluster, getattr(args, "world_size", None) or params.ranks or 2)
        # GPU sizes on real GPUs (torchrun's too) and simulated ones; not on CI's fake CUDA machine, whose
        # ranks compute on this CPU (Cluster.gpu_sized)
        gpu_sized = w.cluster.gpu_sized if isinstance(w.cluster, Cluster) else w.on_gpu
        params = params.with_ranks(w.world_size).resolve(on_gpu=gpu_sized)
        if w.rank() == 0:
            print(f"lab {name}: {w.world_size} ranks ({w.label}); parameters {params.as_dict()}", flush=True)
        result: LabRecords = lab.headline(w, params)
    except ParamError as err:
        return _refused(name, err.in_form("set"))
    except ValueError as err:  # the value, the constraint and the fix, from labkit's own checks
        return _refused(name, err)
    except RankError as err:
        if err.exc_type not in ("ValueError", "ParamError"):
            raise
        return _refused(name, str(err).split("\n\n", 1)[0])
    records = {
        **result.as_dict(),
        "lab": name,
        "where": w.label,
        "emulated": w.emulated,
        "torchrun": w.torchrun,
        "world_size": w.world_size,
        "nodes": result.nodes or w.nodes,
        "params": params.as_dict(),
    }
    if w.rank() == 0:
        _write(records, Path(args.out), args.print_records)
        print(summary(result, w.label, name), flush=True)
        print(f"  {time.perf_counter() - t0:.1f} s; records in {args.out}", flush=True)
    return 0


def _write(records: dict[str, Any], out: Path, print_records: bool) -> None:
    """The records into `out` (JSON), and as `labkit-record` lines on standard output if asked."""
    if print_records:
        for key, value in records.items():
            record(key, value)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")


def _number(value: float | None) -> str:
    """A headline number as people read it: 4 significant digits ("186.3", "0.02907"); "-" for none."""
    return "-" if value is None else f"{value:.4g}"


def summary(result: LabRecords, label: str, lab: str) -> str:
    """The records' headline in a few lines: the metric, then before, after and limit with their unit and
    meaning, numbers rounded to 4 significant digits (the --out file keeps them whole)."""
    lines = [f"lab {lab} ({label}): {result.metric}"]
    for key in ("before", "after", "limit"):
        value = _number(getattr(result, key))
        lines.append(f"  {key:<6} {value:>9} {result.unit}  {getattr(result.meaning, key)}")
    return "\n".join(lines)
