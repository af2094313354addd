"""labkit.cluster: what "auto", "cpu" and "gpu" resolve to on any machine, the messages that name what the
user set, the emulated cluster's clocks and checks, and described clusters (planned for, never run on)."""

from __future__ import annotations

import pytest
import torch

from labkit import Cluster, launch
from labkit.cluster import GPU
from labkit.links import Link


def test_messages_name_what_the_user_set():
    with pytest.raises(ValueError, match=r"^world_size=0 .*labkit run -p world_size 2"):
        Cluster.resolve("cpu", 0)
    with pytest.raises(ValueError, match=r"cluster='tpu' is not known"):
        Cluster.resolve("tpu", 2)
    with pytest.raises(ValueError, match="nodes=0"):
        Cluster.emulated(nodes=0)
    small = Cluster.emulated(nodes=1, gpus_per_node=2, intra_node=Link(1.0), inter_node=Link(1.0))
    with pytest.raises(ValueError, match=r"world_size=5 .* 1 node\(s\) x 2 GPU\(s\).*Cluster.emulated"):
        Cluster.resolve(small, 5)


def test_cpu_is_the_emulated_cluster_sized_for_the_ranks():
    cluster = Cluster.resolve("cpu", 4)
    assert (
        cluster.is_emulated and cluster.world_size == 4 and "asked for the emulated cluster" in cluster.reason
    )
    assert Cluster.from_json(cluster.to_json()) == cluster


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_gpus_where_there_are_none_says_so():
    with pytest.raises(ValueError, match=r"no GPU.*--cluster cpu"):
        Cluster.resolve("gpu", 2)
    auto = Cluster.resolve("auto", 2)
    assert auto.is_emulated and "no GPU found" in auto.reason


def test_a_node_with_one_gpu_uses_it_for_one_rank_and_emulates_more(monkeypatch):
    # Common: one H200. "auto" used to need two GPUs, so even world_size=1 ran on the CPU.
    one = Cluster(
        kind="gpu",
        nodes=1,
        gpus_per_node=1,
        intra_node=Link(1.0, 0.0, "none"),
        inter_node=Link(50.0, 5.0, "InfiniBand (assumed)"),
        gpus=(GPU(0, "NVIDIA H200", 139.8),),
    )
    monkeypatch.setattr(Cluster, "detect", classmethod(lambda cls: one))
    alone = Cluster.resolve("auto", 1)
    assert alone.kind == "gpu" and alone.gpu_count == 1 and "1 GPU(s) found" in alone.reason
    two = Cluster.resolve("auto", 2)
    assert two.is_emulated and "1 GPU(s) found, 2 ranks asked" in two.reason
    with pytest.raises(ValueError):
        Cluster.resolve("gpu", 2)  # asked for two GPUs explicitly: refused, with the count


def test_the_wall_clock_stays_available():
    link = Link(0.1, 50.0)
    cluster = Cluster.emulated(gpus_per_node=2, intra_node=link, inter_node=link, clock="wall")
    assert "wall clock" in cluster.describe()
    with pytest.raises(ValueError, match="clock='sundial'"):
        Cluster.emulated(clock="sundial")


def test_a_described_cluster_is_planned_for_and_refused_by_launch():
    dgx = Cluster.preset("dgx-a100-80gb", nodes=192)
    assert dgx.world_size == 1536 and dgx.memory_gib == 80 and dgx.peak_tflops == 312
    assert dgx.intra_node.bandwidth_gb_s == 300 and dgx.inter_node.bandwidth_gb_s == 25
    assert Cluster.preset("dgx-h100").intra_node.bandwidth_gb_s == 450
    with pytest.raises(ValueError, match=r"only describes a machine.*labkit\.planner\.plan"):
        launch(print, world_size=8, cluster=dgx)
    with pytest.raises(ValueError, match=r"unknown cluster preset 'dgx-z'.*dgx-a100-80gb"):
        Cluster.preset("dgx-z")
