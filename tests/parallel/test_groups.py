"""labkit.parallel.groups: `make_groups` gives each rank its tp, dp and pp groups under a
`labkit.layout.Layout` (None where a kind has one rank), the same groups the layout lists on paper; a
layout that does not cover the world is refused."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit import launch
from labkit.layout import Layout
from labkit.parallel.groups import make_groups


def _groups(layout: Layout) -> dict:
    mine = make_groups(layout)
    out = {"rank": mine.rank, "coords": mine.coords}
    for kind in ("tp", "dp", "pp"):
        group = getattr(mine, kind)
        if group is None:
            out[kind] = None
            continue
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=group)  # the sum of the group's global ranks
        out[kind] = (dist.get_process_group_ranks(group), t.item())
    try:
        make_groups(Layout(dp=4, tp=2))
        out["refused"] = ""
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_each_rank_gets_its_groups_of_the_layout():
    layout = Layout(dp=2, tp=2, pp=1)
    for rank, got in enumerate(launch(_groups, layout, world_size=4, cluster="cpu", timeout_s=60)):
        assert got["rank"] == rank and got["coords"] == layout.coords(rank)
        assert got["pp"] is None  # one stage: nothing to talk to
        for kind in ("tp", "dp"):
            (ranks,) = [g for g in layout.groups_of(kind) if rank in g]
            assert got[kind] == (ranks, float(sum(ranks))), kind
        assert "needs dp x tp x pp = 8 ranks, the world has 4" in got["refused"]
