"""Each rank's groups under a dp x tp x pp `labkit.layout.Layout`.

`make_groups` creates every tp, dp and pp group (every rank creates every group, in the same order, as
`torch.distributed.new_group` requires) and returns this rank's. No global state: the groups are returned,
and passed explicitly to the parallel building blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from labkit.layout import KINDS, Layout

__all__ = ["RankGroups", "make_groups"]


@dataclass
class RankGroups:
    """This rank's groups (None where the kind has one rank: nothing to talk to) and its coordinates."""

    layout: Layout
    rank: int
    tp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)


def make_groups(layout: Layout) -> RankGroups:
    """Create every tp, dp and pp group of `layout` (collective: every rank calls it) and keep this rank's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout.check_world_size(world)
    mine: dict[str, dist.ProcessGroup | None] = {}
    for kind in KINDS:
        mine[kind] = None
        if getattr(layout, kind) == 1:
            continue
        for ranks in layout.groups_of(kind):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return RankGroups(layout, rank, mine["tp"], mine["dp"], mine["pp"])
