"""Benchmark: how still the emulated cluster's virtual clock holds, and what it costs.

    python3 benchmarks/virtual_clock.py            # all four measurements, a table each
    python3 benchmarks/virtual_clock.py --check    # exit 1 when a target is missed

1. Lab 03's after/before and after/limit over `--runs` launches, idle and with both cores kept
   busy by two other processes: spread (max - min) / median <= 5 % idle, <= 10 % loaded.
2. Lab 00's all-reduce bus bandwidth against the α-β model, per size, over the same runs:
   spread <= 5 % idle, <= 10 % loaded.
3. 8 emulated ranks on 2 cores: a DDP step's virtual time within 15 % of the same per-rank
   work on 2 ranks (32 sequences per rank: compute-bound, so the 8-rank ring's 1.75x more
   link time hides under backward; with 8 sequences it does not, and the ratio is 1.6);
   2- and 8-rank launches alternate, the median ratio of 3 pairs is kept.
4. What the bookkeeping costs: wall time of a lab 03 measurement on the virtual clock vs the
   same on the wall clock (clock="wall"): <= 15 % extra.

Run it alone: other work on the machine is what items 1 and 2 measure on purpose.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import labkit
from labkit.bandwidth import bandwidth_test
from labkit.course.experiments.unoverlapped_comms import summarize_steps, train_steps
from labkit.links import collective_time_s
from labkit.models import GPTConfig

LAB03 = GPTConfig(n_layers=6, d_model=128, n_heads=4, vocab_size=256, seq_len=64)
SIZES = [4096, 65536, 1 << 20, 4 << 20]


def _spin(stop: float) -> None:
    while time.time() < stop:
        pass


def _lab03(cluster: labkit.Cluster) -> tuple[float, float, float]:
    runs = labkit.launch(
        train_steps,
        ["compute", "naive", "comm_overlapped", "overlapped"],
        LAB03,
        12,
        steps=5,
        warmup=1,
        bucket_cap_mb=0.5,
        check=False,
        world_size=2,
        cluster=cluster,
        timeout_s=120,
    )
    s = summarize_steps(runs)
    after, before = s["overlapped"].step_ms, s["naive"].step_ms
    compute = s["overlapped"].compute_ms or s["compute"].step_ms  # lab 03's limit: the step's own compute
    return after / before, after / max(compute, s["comm_overlapped"].step_ms), after


def _lab00(cluster: labkit.Cluster) -> list[float]:
    rows = labkit.launch(bandwidth_test, SIZES, iters=20, world_size=2, cluster=cluster)[0]
    link = cluster.intra_node
    return [r["time_ms"] / (collective_time_s("all_reduce", r["size_bytes"], 2, link) * 1e3) for r in rows]


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def stability(runs: int, loaded: bool) -> dict[str, float]:
    hogs = []
    if loaded:  # two processes keep both cores busy for the whole measurement
        ctx = mp.get_context("spawn")
        hogs = [ctx.Process(target=_spin, args=(time.time() + 3600,), daemon=True) for _ in range(2)]
        for h in hogs:
            h.start()
    try:
        cluster = labkit.Cluster.emulated(gpus_per_node=2)
        lab03 = [_lab03(cluster) for _ in range(runs)]
        lab00 = [_lab00(cluster) for _ in range(runs)]
    finally:
        for h in hogs:
            h.terminate()
    out = {"after/before": _spread([r[0] for r in lab03]), "after/limit": _spread([r[1] for r in lab03])}
    for i, size in enumerate(SIZES):
        out[f"busbw {size >> 10} KiB"] = _spread([r[i] for r in lab00])
    print(
        f"\n{'loaded' if loaded else 'idle'}: lab 03 after/before {[round(r[0], 3) for r in lab03]}, "
        f"after/limit {[round(r[1], 3) for r in lab03]}; lab 00 time/model per size "
        f"{[[round(v, 3) for v in r] for r in lab00]}"
    )
    for k, v in out.items():
        print(f"  spread of {k:>18}: {v:6.1%}")
    return out


def _ddp_step(world: int, per_rank: int) -> float:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.course.training.reference import rank_rows
    from labkit.models import seeded_model

    model = DDP(seeded_model(LAB03, 0), bucket_cap_mb=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for step in range(4):
        x, y = rank_rows(LAB03, per_rank * world, dist.get_rank(), world, step=step)
        dist.barrier()
        t0 = labkit.clock()
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        times.append(labkit.clock() - t0)
    return statistics.median(times[1:])


def scaling(per_rank: int = 32, pairs: int = 3) -> float:
    """Compute-bound (32 sequences per rank): the 8-rank ring's 1.75x more link time hides under backward.

    The processor's speed drifts over minutes on a shared host (a 2-rank step measured 281-490 ms of CPU
    time within ten minutes here), so 2-rank and 8-rank launches alternate and the median ratio is kept.
    """
    ratios, wall = [], []
    for _ in range(pairs):
        two = max(
            labkit.launch(
                _ddp_step, 2, per_rank, world_size=2, cluster=labkit.Cluster.emulated(gpus_per_node=2)
            )
        )
        t0 = time.perf_counter()
        eight = max(
            labkit.launch(
                _ddp_step,
                8,
                per_rank,
                world_size=8,
                cluster=labkit.Cluster.emulated(gpus_per_node=8),
                timeout_s=300,
            )
        )
        wall.append(time.perf_counter() - t0)
        ratios.append(eight / two)
        print(
            f"  DDP step, {per_rank} sequences per rank: 2 ranks {two * 1e3:.1f} ms, 8 ranks "
            f"{eight * 1e3:.1f} ms (virtual; the 8-rank launch took {wall[-1]:.0f} s of wall time), ratio "
            f"{eight / two:.2f}"
        )
    ratio = statistics.median(ratios)
    print(f"\n8 ranks vs 2 ranks on 2 cores: median ratio {ratio:.2f} over {pairs} alternating pairs")
    return abs(ratio - 1)


def overhead() -> float:
    walls = {}
    for clock in ("virtual", "wall"):
        cluster = labkit.Cluster.emulated(gpus_per_node=2, clock=clock)
        t0 = time.perf_counter()
        _lab03(cluster)
        walls[clock] = time.perf_counter() - t0
    extra = walls["virtual"] / walls["wall"] - 1
    print(
        f"\nlab 03 measurement wall time: virtual clock {walls['virtual']:.1f} s, wall clock "
        f"{walls['wall']:.1f} s ({extra:+.0%})"
    )
    return extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    print(labkit.Cluster.emulated(gpus_per_node=2).describe())
    missed = []
    for loaded, target in ((False, 0.05), (True, 0.10)):
        for key, spread in stability(args.runs, loaded).items():
            if spread > target:
                missed.append(f"{'loaded' if loaded else 'idle'} {key} spread {spread:.1%} > {target:.0%}")
    if scaling() > 0.15:
        missed.append("8 ranks vs 2 ranks differ by more than 15 %")
    if overhead() > 0.15:
        missed.append("bookkeeping costs more than 15 % wall time")
    print("\nmissed: " + "; ".join(missed) if missed else "\nall targets met")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
