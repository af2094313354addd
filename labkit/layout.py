"""Layouts: which rank does which share of the work when data, tensor and pipeline parallelism combine.

A `Layout(dp, tp, pp)` puts dp x tp x pp ranks on a grid. Ranks are numbered with tensor parallelism
fastest, then data, then pipeline (Megatron-Core's default order "tp-cp-ep-dp-pp", without context and
expert parallelism: `initialize_model_parallel` in megatron/core/parallel_state.py):

    rank = (pp_index * dp + dp_index) * tp + tp_index

so that a tensor-parallel group is tp consecutive ranks, which sit in one node when tp divides the GPUs per
node, and the groups that talk least (pipeline, then data) are the ones that cross nodes. `groups_of`
lists every group of one kind; `links_crossed` says which link class each kind's groups need on a
`labkit.links.Topology`. A layout on paper: the planner (`labkit.planner`) scores them;
`labkit.parallel.groups.make_groups` creates a rank's `torch.distributed` groups for one.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit import validate
from labkit.links import Topology

__all__ = ["KINDS", "Layout"]

KINDS = ("tp", "dp", "pp")


@dataclass(frozen=True)
class Layout:
    """dp data-parallel replicas x tp tensor-parallel ranks x pp pipeline stages."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for kind in KINDS:
            validate.positive_int(f"Layout {kind}", getattr(self, kind), "Layout(dp=2, tp=4, pp=1)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"dp{self.dp} x tp{self.tp} x pp{self.pp}"

    def check_world_size(self, world_size: int) -> None:
        """Refuse a layout whose dp x tp x pp is not the number of ranks."""
        if self.world_size != world_size:
            raise ValueError(
                f"layout {self} needs dp x tp x pp = {self.world_size} ranks, the world has {world_size}: "
                f"choose dp, tp, pp whose product is {world_size}"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each kind: {"tp": .., "dp": .., "pp": ..}."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is not in 0..{self.world_size - 1} for layout {self}")
        return {"tp": rank % self.tp, "dp": rank // self.tp % self.dp, "pp": rank // (self.tp * self.dp)}

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups_of(self, kind: str) -> list[list[int]]:
        """Every group of one kind, each a sorted list of global ranks (the ranks that differ only in
        `kind`)."""
        validate.one_of("kind", kind, KINDS)
        # rank = (pp * dp + dp_index) * tp + tp_index (`rank_of`): along `kind` the ranks are `stride` apart,
        # and each group starts at the rank whose index along `kind` is 0 (groups in the order of their first
        # rank; the planner asks this of thousands of ranks per candidate)
        stride = {"tp": 1, "dp": self.tp, "pp": self.tp * self.dp}[kind]
        size = getattr(self, kind)
        starts = (r for r in range(self.world_size) if r // stride % size == 0)
        return [[start + i * stride for i in range(size)] for start in starts]

    def links_crossed(self, topology: Topology) -> dict[str, str]:
        """Per kind with more than one rank: "intra" if each of its groups sits in one node, else "inter"."""
        out = {}
        for kind in KINDS:
            if getattr(self, kind) > 1:
                spans = {len({topology.node_of(r) for r in g}) > 1 for g in self.groups_of(kind)}
                out[kind] = "inter" if True in spans else "intra"
        return out
