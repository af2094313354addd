"""Lab 00's experiment as a script: the all-reduce bus bandwidth from the smallest to the largest message.

    python -m labkit.course.experiments.cluster_tour
    torchrun --standalone --nproc-per-node 8 -m labkit.course.experiments.cluster_tour --out 00.json

The notebook (`solutions/00_cluster_tour.ipynb`) explains it; this module runs its measurement anywhere
(`labkit.course.experiments.script`): `labkit.bandwidth.bandwidth_test` at each size, nccl-tests style, and
the limit no message size beats: the link's bandwidth (the emulated link's β; on GPUs the NVLink or PCIe
figure of the slowest pair, `labkit.gpu_links`). Under torchrun on CPUs, gloo's loopback has no such figure:
the limit is None and the records say why."""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.bandwidth import bandwidth_test
from labkit.cluster import Cluster
from labkit.course.experiments.params import LabParams, param, simulable_cluster
from labkit.course.experiments.script import LabRecords, Meaning, Where, main
from labkit.gpu_links import LIMIT_MEANING

__all__ = ["Params", "headline"]


@dataclass(frozen=True)
class Params(LabParams):
    """Lab 00's parameters."""

    cluster: str = simulable_cluster()
    world_size: int = param(
        2, "ranks (processes), one per GPU or emulated GPU; a collective needs two", minimum=2
    )
    sizes_kib: list[float] | None = param(
        None,
        "message sizes (KiB) for the bandwidth sweep; None: 4 KiB-4 MiB emulated, 4 KiB-1 GiB on GPUs",
        minimum=0,
        strict=True,
        example=[4, 64, 1024],
    )
    iters: int = param(
        20, "collectives launched back to back per size, as nccl-tests does (the mean is kept)", minimum=1
    )
    timeout_s: float = param(
        60, "every collective must finish within this many seconds", minimum=0, strict=True
    )

    LAB = "00_cluster_tour"
    NOTEBOOK_SIMULATED = True  # its sweep runs there; the all-reduce exercise on the emulated cluster
    RANKS_WHY = (
        "its lesson is the link between GPUs: all of the node's, as nccl-tests runs (one GPU has no link: 2 "
        "emulated ranks)"
    )
    TEST = {"cluster": "cpu", "sizes_kib": [4, 256, 2048], "iters": 20}
    SMOKE = {"sizes_kib": [4, 64], "iters": 3}

    @classmethod
    def ranks_on(cls, gpus: int) -> int | None:
        # any count of 2 or more: a ring all-reduce and its bus bandwidth are defined for every world size
        return gpus if gpus >= 2 else None

    def resolve(self, *, on_gpu: bool = False) -> Params:
        if self.sizes_kib is not None:
            return self
        # nccl-tests sweeps to 1 GiB and beyond: NVLink reaches its peak only at large messages
        return replace(self, sizes_kib=[4 * 4**i for i in range(10)] if on_gpu else [4, 64, 1024, 4096])


def headline(w: Where, p: Params) -> LabRecords:
    """Lab 00's records: bus bandwidth of the smallest and largest message, against the link's bandwidth."""
    sizes = [int(k * 1024) for k in p.sizes_kib]
    rows = w.launch(bandwidth_test, sizes, iters=p.iters, timeout_s=p.timeout_s, alike=True)[0]
    if w.emulated:
        assert isinstance(w.cluster, Cluster)
        link = w.cluster.topology().rail_ring(list(range(w.world_size)))
        limit = link.bandwidth_gb_s
        why = f"the simulated link's β ({link.name})" if w.simulated else "the emulated link's β"
    elif w.on_gpu and w.nodes == 1:
        # torchrun: detect
        link = (w.cluster if isinstance(w.cluster, Cluster) else Cluster.detect()).intra_node
        limit, why = link.bandwidth_gb_s, f"{link.name}: {LIMIT_MEANING}"
    else:
        limit = None
        why = (
            "none known: gloo over this host's loopback (torchrun on CPUs) has no published link figure"
            if not w.on_gpu
            else "none known here: across nodes the slowest link is the network, which this script cannot "
            "read"
        )
    return LabRecords(
        rows[0]["busbw_GBps"],
        rows[-1]["busbw_GBps"],
        limit,
        "GB/s (bus bandwidth)",
        Meaning(
            before=f"all_reduce bus bandwidth of the smallest message ({rows[0]['size_bytes']} bytes)",
            after=f"bus bandwidth of the largest message ({rows[-1]['size_bytes']} bytes)",
            limit=f"the link's bandwidth, which no message size beats: {why}",
        ),
        "all_reduce bus bandwidth: smallest vs largest message",
        {"sweep": rows},
    )


if __name__ == "__main__":
    main(__spec__.name)
