"""Lab 00's experiment as a script: the all-reduce bus bandwidth from the smallest to the largest message.

    python -m labkit.experiments.cluster_tour
    torchrun --standalone --nproc-per-node 8 -m labkit.experiments.cluster_tour --out 00.json

The notebook (`solutions/00_cluster_tour.ipynb`) explains it; this module runs its measurement anywhere
(`labkit.experiments.script`): `labkit.bandwidth.bandwidth_test` at each size, nccl-tests style, and the
limit no message size beats: the link's bandwidth (the emulated link's β; on GPUs the NVLink or PCIe figure of
the slowest pair, `labkit.gpu_links`). Under torchrun on CPUs, gloo's loopback has no such figure: the limit is
None and the records say why.
"""

from __future__ import annotations

from typing import Any

from labkit.bandwidth import bandwidth_test
from labkit.cluster import Cluster
from labkit.experiments.script import Where, run_lab

__all__ = ["DEFAULTS", "headline", "main"]

DEFAULTS: dict[str, Any] = {"sizes_kib": [4, 64, 1024, 4096], "iters": 20, "timeout_s": 60}


def headline(w: Where, sizes_kib: list[float], iters: int, timeout_s: float) -> dict[str, Any]:
    """Lab 00's records: bus bandwidth of the smallest and largest message, against the link's bandwidth."""
    if w.world_size < 2:
        raise ValueError(
            f"world_size={w.world_size}: a collective needs two or more ranks (the bus bandwidth of one "
            "rank is 0 by definition); use --world-size 2, or torchrun --nproc-per-node 2"
        )
    sizes = [int(k * 1024) for k in sizes_kib]
    rows = w.launch(bandwidth_test, sizes, iters=iters, timeout_s=timeout_s)[0]
    if w.emulated:
        assert isinstance(w.cluster, Cluster)
        limit, why = (
            w.cluster.topology().slowest_link(list(range(w.world_size))).bandwidth_gb_s,
            "the emulated link's β",
        )
    elif w.on_gpu and w.nodes == 1:
        from labkit.gpu_links import LIMIT_MEANING

        link = (
            w.cluster if isinstance(w.cluster, Cluster) else Cluster.detect()
        ).intra_node  # torchrun: detect
        limit, why = link.bandwidth_gb_s, f"{link.name}: {LIMIT_MEANING}"
    else:
        limit = None
        why = (
            "none known: gloo over this host's loopback (torchrun on CPUs) has no published link figure"
            if not w.on_gpu
            else "none known here: across nodes the slowest link is the network, which this script cannot read"
        )
    return {
        "before": rows[0]["busbw_GBps"],
        "after": rows[-1]["busbw_GBps"],
        "limit": limit,
        "unit": "GB/s (bus bandwidth)",
        "meaning": {
            "before": f"all_reduce bus bandwidth of the smallest message ({rows[0]['size_bytes']} bytes)",
            "after": f"bus bandwidth of the largest message ({rows[-1]['size_bytes']} bytes)",
            "limit": f"the link's bandwidth, which no message size beats: {why}",
        },
        "metric": "all_reduce bus bandwidth: smallest vs largest message",
        "sweep": rows,
    }


def main(argv: list[str] | None = None) -> int:
    return run_lab("00_cluster_tour", headline, DEFAULTS, argv)


if __name__ == "__main__":
    from labkit.experiments import (
        cluster_tour,
    )  # by its own name, so launch pickles its functions by reference

    raise SystemExit(cluster_tour.main())
