"""A lab's experiment as a script: plain Python, or one process per GPU under torchrun.

    python -m labkit.experiments.oom_batch                        # labkit.launch starts 2 ranks (emulated on a CPU)
    torchrun --standalone --nproc-per-node 8 -m labkit.experiments.unoverlapped_comms --out 03.json
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m labkit.experiments.parallelism_choice --out 01.json

Each lab's driver module ends with `main(argv)`, which calls `run_lab` with its `headline(where, **params)`:
the lab's measurement in a few launches, returning the records its notebook writes (before, after, limit, unit,
meaning, metric and the extras that say why). Every rank runs the script; every `labkit.launch` inside gathers
the ranks' results onto every rank (`labkit.torchrun`), so every rank computes the same records from them and
rank 0 alone prints them (`labkit-record` lines, as `labkit.record` does outside a notebook) and writes them to
`--out`. `--set key value` overrides a parameter (JSON values; an unknown key is refused with the list); a
parameter the lab cannot run with ends the script with exit status 2 and the message (its value and the fix).

What the numbers are depends on where they ran, and the records say so (`where`): the emulated cluster when
`labkit.launch` starts the ranks on a machine without GPUs (virtual clock, modelled links, memory budget);
NCCL on GPUs; under torchrun on CPUs plain gloo on the wall clock (no link model, no memory budget: real
processes on one host, not a picture of GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from labkit import torchrun
from labkit.cluster import Cluster
from labkit.course.records import record

__all__ = ["Where", "emulated_cluster", "run_lab", "where"]


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

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`labkit.launch(fn, *args, world_size=..., cluster=..., **kwargs)` on these ranks (`cluster=` in
        `kwargs` replaces this one: the same ranks with another memory budget)."""
        from labkit.launcher import launch

        kwargs.setdefault("cluster", self.cluster)
        return launch(fn, *args, world_size=self.world_size, **kwargs)

    def rank(self) -> int:
        """This process's rank under torchrun (0 in a plain script: it is the parent of the ranks)."""
        return _rank()


def _rank() -> int:
    return int(os.environ["RANK"]) if torchrun.under_torchrun() else 0


def where(cluster: str, world_size: int) -> Where:
    """The ranks a script runs on: torchrun's when torchrun started it, else `world_size` ranks of `cluster`."""
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
            else f"torchrun on CPU: {n} processes on {nodes} node(s) over gloo, wall clock; no GPU, no link model"
        )
        return Where(n, "auto", nodes, per_node, True, gpu, label)
    resolved = Cluster.resolve(cluster, world_size)
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


def _parse(
    argv: list[str] | None, lab: str, defaults: dict[str, Any]
) -> tuple[argparse.Namespace, dict[str, Any]]:
    p = argparse.ArgumentParser(
        prog=f"python -m labkit.experiments.{lab.split('_', 1)[1]}",
        description=f"Lab {lab}: measure the mistake and its fix, write the records.",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=defaults.get("world_size", 2),
        help="ranks to start (ignored under torchrun: its WORLD_SIZE)",
    )
    p.add_argument(
        "--cluster", default="auto", help="auto, cpu (emulated) or gpu; under torchrun: auto or gpu"
    )
    p.add_argument("--out", default=f"records_{lab}.json", help="where rank 0 writes the records (JSON)")
    p.add_argument(
        "--set",
        nargs=2,
        action="append",
        metavar=("KEY", "VALUE"),
        default=[],
        help="override a parameter (values are JSON); the defaults: "
        + ", ".join(f"{k}={v!r}" for k, v in defaults.items() if k != "world_size"),
    )
    args = p.parse_args(argv)
    params = dict(defaults)
    params.pop("world_size", None)
    for key, raw in args.set:
        if key not in params:
            p.error(
                f"--set {key}: not a parameter of lab {lab}; its parameters: "
                + ", ".join(f"{k}={v!r}" for k, v in params.items())
            )
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw  # a bare word stays a string
    return args, params


def run_lab(
    lab: str, headline: Callable[..., dict[str, Any]], defaults: dict[str, Any], argv: list[str] | None = None
) -> int:
    """Parse the command line, run `headline(where, **params)`, print and write its records on rank 0."""
    args, params = _parse(argv, lab, defaults)
    talk = _rank() == 0
    t0 = time.perf_counter()
    try:
        w = where(args.cluster, args.world_size)
        if talk:
            print(f"lab {lab}: {w.world_size} ranks ({w.label}); parameters {params}", flush=True)
        records = headline(w, **params)
    except ValueError as err:  # a parameter the lab cannot run with: the message has the value and the fix
        if talk:
            print(f"lab {lab}: {err}", file=sys.stderr, flush=True)
        return 2
    records = {
        **records,
        "lab": lab,
        "where": w.label,
        "emulated": w.emulated,
        "torchrun": w.torchrun,
        "world_size": w.world_size,
        "nodes": w.nodes,
        "params": params,
    }
    if talk:
        for key, value in records.items():
            record(key, value)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(
            f"lab {lab}: before {records['before']}, after {records['after']}, limit {records['limit']} "
            f"{records['unit']} ({w.label}); {time.perf_counter() - t0:.1f} s; records in {out}",
            flush=True,
        )
    return 0
