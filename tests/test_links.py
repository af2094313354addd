"""labkit.links: the α-β model (ring step counts of Thakur et al. 2005), nccl-tests' bus-bandwidth factors,
the topology's slowest link, and the links scaled to this CPU."""

from __future__ import annotations

import pytest

from labkit.links import Link, Topology, bus_bandwidth_factor, collective_time_s, default_links


def test_ring_formulas():
    link = Link(bandwidth_gb_s=1.0, latency_us=0.0)
    n_bytes = 1_000_000_000
    assert collective_time_s("all_reduce", n_bytes, 2, link) == pytest.approx(1.0)  # 2(n-1)/n = 1
    assert collective_time_s("all_reduce", n_bytes, 4, link) == pytest.approx(1.5)  # 2*3/4
    assert collective_time_s("all_gather", n_bytes, 4, link) == pytest.approx(0.75)  # (n-1)/n
    assert collective_time_s("broadcast", n_bytes, 8, link) == pytest.approx(1.0)
    assert collective_time_s("all_reduce", n_bytes, 1, link) == 0.0
    lat = Link(bandwidth_gb_s=1e9, latency_us=10.0)
    assert collective_time_s("all_reduce", 0, 4, lat) == pytest.approx(6 * 10e-6)  # 2(n-1) steps


def test_bad_link_is_refused():
    with pytest.raises(ValueError, match="bandwidth_gb_s=0"):
        Link(0.0)
    with pytest.raises(ValueError, match="latency_us=-1"):
        Link(1.0, -1)


def test_bus_bandwidth_factor_numbers():
    # nccl-tests PERFORMANCE.md: all_reduce 2(n-1)/n, all_gather / reduce_scatter (n-1)/n, broadcast 1
    assert bus_bandwidth_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_bandwidth_factor("all_reduce", 2) == pytest.approx(1.0)
    assert bus_bandwidth_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_bandwidth_factor("reduce_scatter", 8) == pytest.approx(0.875)
    assert bus_bandwidth_factor("broadcast", 16) == 1.0
    assert bus_bandwidth_factor("all_reduce", 1) == 0.0
    # 1 GB all-reduced in 0.1 s on 8 ranks: algbw 10 GB/s, busbw 17.5 GB/s
    assert 1e9 / 0.1 / 1e9 * bus_bandwidth_factor("all_reduce", 8) == pytest.approx(17.5)
    with pytest.raises(ValueError, match="all_to_all"):
        bus_bandwidth_factor("all_to_all", 2)


def test_a_collective_across_nodes_crosses_the_inter_node_link():
    topo = Topology(4, Link(100.0, 5.0, "nvlink"), Link(10.0, 20.0, "ib"))
    assert topo.slowest_link([0, 1, 2, 3]).name == "nvlink"
    assert topo.slowest_link([3, 4]).name == "ib" and topo.node_of(7) == 1
    assert Topology.from_dict(topo.to_dict()) == topo


def test_the_links_scale_with_this_cpu():
    intra, inter = default_links(100.0)  # 100 GFLOP/s: 1 byte per 1,000 and per 10,000 FLOP
    assert intra.bandwidth_gb_s == pytest.approx(0.1) and inter.bandwidth_gb_s == pytest.approx(0.01)
    assert intra.latency_us < inter.latency_us
