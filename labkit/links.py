"""The one α-β cost model of an interconnect: links, topology, collective times, bus bandwidth.

A `Link` is one class of wire (NVLink inside a node, InfiniBand between nodes) with a
per-message latency α and a one-direction bandwidth β. A `Topology` says which rank sits
on which node. `collective_time_s` gives the modelled seconds of a collective over the
slowest link its ranks cross; `bus_bandwidth_factor` turns nccl-tests' algorithm bandwidth
into bus bandwidth. The emulated process group (`labkit.machine.emulate`), the bandwidth test
(`labkit.bandwidth`) and the labs' "limit" numbers all use this model, and `default_links`
scales it to this CPU (`labkit.calibrate`) for the emulated cluster (`labkit.cluster`).

The α-β model and the ring-algorithm step counts follow Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005), which is also
what nccl-tests' bus-bandwidth factors assume
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

`Topology.collective_time_s` times a collective over a group of ranks as NCCL runs it, taking the
fastest of the forms this model knows:

* inside one node, a ring over the intra-node link, or, for an all-reduce where the NVSwitch reduces
  (NVLink SHARP, "NVLS": H100 and H200 nodes), one pass through the switch: each GPU sends its buffer
  once and receives the result once, at `nvls_gb_s`;
* across nodes, rings over the rails: a node has `nics_per_node` network ports (a DGX, one per GPU),
  NCCL runs one ring (channel) or more per port, so the data leaving a node is spread over
  min(ports, the group's ranks on that node) of them and a ring reaches min(intra-node, ports x port)
  bus bandwidth, where one flat ring over the slowest link reaches one port's;
* across nodes with NVLS, NCCL's NVLS tree: reduce-scatter through the switch inside each node, an
  all-reduce of each GPU's 1/g of the data over its own rail between the nodes, an all-gather
  through the switch; NCCL pipelines the three, so the slowest part sets the time.

NCCL's own tuner (src/graph/tuning.cc, ncclTopoTuneModel) picks among the same algorithms by the same
kind of estimate; its per-channel caps and protocol choice are not modelled here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from labkit import validate

__all__ = [
    "FLOP_PER_BYTE_INTER",
    "FLOP_PER_BYTE_INTRA",
    "Link",
    "Topology",
    "bus_bandwidth_factor",
    "collective_time_s",
    "default_links",
]


@dataclass(frozen=True)
class Link:
    """One class of link (for example NVLink inside a node, InfiniBand between nodes).

    `bandwidth_gb_s` is the bandwidth one rank sees in one direction, in GB/s (1e9 bytes);
    `latency_us` is the fixed cost α of one message, in microseconds.
    """

    bandwidth_gb_s: float
    latency_us: float = 10.0
    name: str = ""

    def __post_init__(self) -> None:
        validate.positive_number(
            "Link bandwidth_gb_s",
            self.bandwidth_gb_s,
            "Link(bandwidth_gb_s=25), the link's one-direction bandwidth in GB/s",
        )
        if (
            isinstance(self.latency_us, bool)
            or not isinstance(self.latency_us, (int, float))
            or self.latency_us < 0
        ):
            raise ValueError(
                f"Link latency_us={self.latency_us!r} must be a number >= 0; e.g. Link(..., latency_us=5)"
            )

    def to_dict(self) -> dict:
        return {"bandwidth_gb_s": self.bandwidth_gb_s, "latency_us": self.latency_us, "name": self.name}


def collective_time_s(op: str, nbytes: int, n: int, link: Link) -> float:
    """Modelled seconds for a collective over `n` ranks whose slowest link is `link`.

    `nbytes` is the size of the buffer each rank contributes (all_reduce, broadcast, the
    output of all_gather, the input of reduce_scatter, one point-to-point message).
    Ring algorithms: all_reduce is a reduce-scatter then an all-gather, 2(n-1) steps each
    moving nbytes/n, so T = 2(n-1)·(α + nbytes/(n·β)); all_gather and reduce_scatter take
    (n-1) such steps; a pipelined ring broadcast costs (n-1)·α + nbytes/β.
    """
    if n <= 1:
        return 0.0
    a = link.latency_us * 1e-6
    b = link.bandwidth_gb_s * 1e9
    if op in ("all_reduce", "barrier"):
        return 2 * (n - 1) * (a + nbytes / (n * b))
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * (a + nbytes / (n * b))
    if op in ("broadcast", "reduce", "gather", "scatter"):
        return (n - 1) * a + nbytes / b
    if op in ("send", "recv"):
        return a + nbytes / b
    raise ValueError(f"no time model for collective {op!r}")


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """busbw / algbw as nccl-tests defines it, so that bus bandwidth is comparable to link speed.

    all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n; broadcast 1
    (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
    """
    n = validate.positive_int("world_size", world_size, "bus_bandwidth_factor('all_reduce', 8)")
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
    }
    validate.one_of("op", op, sorted(factors))
    return factors[op]


# NCCL's own latency of an NVLS all-reduce on NVLink (src/graph/tuning.cc: hwLatencies[NCCL_HW_NVLINK][NVLS]
# [SIMPLE], 25 us; NVLS runs the Simple protocol only): one pass through the switch, but a slower start than a
# ring's low-latency protocols, which NCCL therefore keeps for small messages
NVLS_LATENCY_US = 25.0


@dataclass(frozen=True)
class Topology:
    """Which global rank sits on which node, the two link classes, and a node's way out: `nics_per_node`
    network ports (rails), each an `inter_node` link. `nvls_gb_s`: where the NVSwitch reduces (NVLink
    SHARP), what one GPU's buffer passes through it at in an all-reduce, GB/s (None: no NVLS)."""

    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    nics_per_node: int = 1
    nvls_gb_s: float | None = None

    def __post_init__(self) -> None:
        validate.positive_int("nics_per_node", self.nics_per_node, "Topology(8, nvlink, ib, nics_per_node=8)")
        if self.nvls_gb_s is not None:
            validate.positive_number("nvls_gb_s", self.nvls_gb_s, "Topology(..., nvls_gb_s=272) or None")

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.gpus_per_node

    def slowest_link(self, global_ranks: list[int]) -> Link:
        """The link a collective over these ranks must cross: inter-node if they span nodes."""
        nodes = {self.node_of(r) for r in global_ranks}
        return self.inter_node if len(nodes) > 1 else self.intra_node

    def rail_ring(self, global_ranks: list[int]) -> Link:
        """The link a ring over these ranks runs at: inside one node the intra-node link; across nodes
        min(intra-node, rails x one port), the rails being min(ports, the fewest ranks the group has on a
        node), at the slower latency."""
        per_node = Counter(self.node_of(r) for r in global_ranks)
        if len(per_node) <= 1:
            return self.intra_node
        rails = min(self.nics_per_node, min(per_node.values()))
        bandwidth = min(self.intra_node.bandwidth_gb_s, rails * self.inter_node.bandwidth_gb_s)
        latency = max(self.intra_node.latency_us, self.inter_node.latency_us)
        return Link(bandwidth, latency, f"{self.inter_node.name} x {rails} rail(s)")

    def collective_time_s(self, op: str, nbytes: int, global_ranks: list[int], *, nvls: bool = True) -> float:
        """Modelled seconds of `op` over these global ranks: the fastest form this model knows (module
        docstring); `nvls=False` leaves NVLS out, as NCCL_NVLS_ENABLE=0 does. A point-to-point transfer
        takes one link (across nodes, one port)."""
        n = len(global_ranks)
        if n <= 1:
            return 0.0
        if op in ("send", "recv"):
            return collective_time_s(op, nbytes, 2, self.slowest_link(global_ranks))
        seconds = collective_time_s(op, nbytes, n, self.rail_ring(global_ranks))
        if op == "all_reduce" and nvls and self.nvls_gb_s is not None:
            seconds = min(seconds, self._nvls_s(nbytes, global_ranks))
        return seconds

    def _nvls_s(self, nbytes: int, global_ranks: list[int]) -> float:
        """An all-reduce through the NVSwitch (one node), or NCCL's NVLS tree across nodes: the switch's pass
        and each GPU's share all-reduced over its rail, pipelined (the slower sets the time)."""
        assert self.nvls_gb_s is not None
        per_node = Counter(self.node_of(r) for r in global_ranks)
        switch = NVLS_LATENCY_US * 1e-6 + nbytes / (self.nvls_gb_s * 1e9)
        if len(per_node) == 1:
            return switch
        g = min(per_node.values())
        share = max(1, nbytes // g)  # each GPU's 1/g of the buffer goes out on its own rail
        port = self.inter_node.bandwidth_gb_s * min(1.0, self.nics_per_node / g)
        rail = collective_time_s("all_reduce", share, len(per_node), Link(port, self.inter_node.latency_us))
        return max(switch, rail)

    def to_dict(self) -> dict:
        return {
            "gpus_per_node": self.gpus_per_node,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "nics_per_node": self.nics_per_node,
            "nvls_gb_s": self.nvls_gb_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        return cls(
            d["gpus_per_node"],
            Link(**d["intra_node"]),
            Link(**d["inter_node"]),
            d.get("nics_per_node", 1),
            d.get("nvls_gb_s"),
        )


# ------------------------------------------------------- links scaled to this CPU
#
# Why these figures. The emulated link should cost as much *relative to this CPU's
# compute* as a real link costs relative to a GPU's compute, so that a lab's ratio of
# communication to computation looks like a GPU node's and not like a loopback socket's.
#
# Reference node: 8 x H100 SXM. Dense bf16 peak is 989 TFLOP/s per GPU (NVIDIA H100
# datasheet); training runs reach about 40-50 % of it, call it 450 TFLOP/s. NVLink 4's line
# rate is 450 GB/s per direction per GPU (18 links x 25 GB/s). NCCL does not reach it: on such a
# node its all-reduce bus bandwidth is ~370 GB/s with the ring (NVLink's protocol overhead, ~20 %)
# and ~480 GB/s with NVLink SHARP (NVLS), its default for all-reduce there, where the NVSwitch
# reduces (NCCL's maintainer in https://github.com/NVIDIA/nccl-tests/issues/212). 450 TFLOP/s
# against 370-480 GB/s is 940-1,220 FLOP per byte: about 1 byte of link per 1,000 FLOP. Between
# nodes each GPU has one 400 Gb/s NDR InfiniBand port, 50 GB/s (line rate), so about 1 byte per
# 10,000 FLOP.
#
# One core of this CPU (each emulated GPU is one process on one core) reaches a measured
# number of GFLOP/s in an fp32 matmul (`labkit.calibrate`); the links get that many FLOP/s divided by 1,000
# (intra)
# and 10,000 (inter), in bytes per second. Latency is not scaled by the compute ratio (that
# would give milliseconds per message): it is NCCL's few-microsecond latency multiplied by
# ten, about the factor by which a PyTorch CPU op is slower to launch than a CUDA kernel.
FLOP_PER_BYTE_INTRA = 1_000.0
FLOP_PER_BYTE_INTER = 10_000.0
LATENCY_US_INTRA = 50.0
LATENCY_US_INTER = 200.0


def default_links(cpu_gflops: float) -> tuple[Link, Link]:
    """Intra-node and inter-node links scaled to this CPU as an H100 node's are to an H100."""
    intra = Link(cpu_gflops * 1e9 / FLOP_PER_BYTE_INTRA / 1e9, LATENCY_US_INTRA, "emulated NVLink")
    inter = Link(cpu_gflops * 1e9 / FLOP_PER_BYTE_INTER / 1e9, LATENCY_US_INTER, "emulated InfiniBand")
    return intra, inter
