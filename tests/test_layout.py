"""labkit.layout: a dp x tp x pp layout on paper: ranks numbered tensor-parallel first, each kind's groups,
the links they cross, and the world size it needs."""

from __future__ import annotations

import pytest

from labkit import Cluster
from labkit.layout import Layout


def test_layout_numbers_tensor_parallel_first_and_finds_the_links():
    lay = Layout(dp=2, tp=2, pp=2)
    assert lay.groups_of("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups_of("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups_of("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(6) == {"tp": 0, "dp": 1, "pp": 1} and lay.rank_of(0, 1, 1) == 6
    topo = Cluster.emulated(nodes=2, gpus_per_node=4).topology()
    assert lay.links_crossed(topo) == {"tp": "intra", "dp": "intra", "pp": "inter"}
    assert Layout(tp=8).links_crossed(topo) == {"tp": "inter"}
    with pytest.raises(ValueError, match="needs dp x tp x pp = 4 ranks, the world has 8"):
        Layout(dp=2, tp=2).check_world_size(8)


def test_a_layout_is_checked_and_named():
    with pytest.raises(ValueError, match="Layout tp=0 must be a positive whole number"):
        Layout(tp=0)
    lay = Layout(dp=2, tp=2, pp=2)
    assert all(lay.rank_of(**lay.coords(r)) == r for r in range(8))
