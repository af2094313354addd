"""labkit.gpu_links: the real node's link per GPU pair from `nvidia-smi topo -m`, per GPU generation."""

from __future__ import annotations

import pytest

from labkit.gpu_links import (
    HGX_H100_TOPO,
    LIMIT_MEANING,
    generation,
    intra_node_link,
    nearest_nics,
    pair_links,
    parse_topo_matrix,
)

# The shape `nvidia-smi topo -m` prints (a DGX H100: every pair joined by 18 NVLinks over NVSwitch).
DGX_H100 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t0-55,112-167\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t0-55,112-167\t0\t\tN/A
NIC0\tPXB\tSYS\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# A DGX-1 V100 hybrid cube-mesh corner: some pairs have 1 or 2 NVLinks, GPU0-GPU3 none (SYS).
DGX1_V100 = """\
\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\x1b[0m
GPU0\t X \tNV1\tNV2\tSYS\t0-19
GPU1\tNV1\t X \tNV2\tNV1\t0-19
GPU2\tNV2\tNV2\t X \tNV1\t0-19
GPU3\tSYS\tNV1\tNV1\t X \t0-19
"""

PCIE_A100 = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\t0-31\t0
GPU1\tPIX\t X \t0-31\t0
"""


def test_the_matrix_is_read_per_pair_and_ansi_underline_is_ignored():
    table = parse_topo_matrix(DGX1_V100)
    assert table["GPU0"] == {"GPU0": "X", "GPU1": "NV1", "GPU2": "NV2", "GPU3": "SYS"}
    assert pair_links(DGX_H100) == {(i, j): "NV18" for i in range(4) for j in range(4) if i < j}
    assert "NIC0" in parse_topo_matrix(DGX_H100)  # NICs are read, but pairs are GPUs only


def test_nvlink_bandwidth_is_the_link_count_times_the_generations_per_link_rate():
    # 25 GB/s per link per direction for NVLink 2-4: H100 18 links = 450, A100 12 = 300, V100 6 = 150.
    h100 = intra_node_link(DGX_H100, ["NVIDIA H100 80GB HBM3"] * 4, visible_env="")
    assert h100.bandwidth_gb_s == 450.0 and "NVLink4 x18" in h100.name
    a100 = intra_node_link(DGX_H100.replace("NV18", "NV12"), ["NVIDIA A100-SXM4-80GB"] * 4, visible_env="")
    assert a100.bandwidth_gb_s == 300.0 and "NVLink3" in a100.name
    assert generation("Tesla V100-SXM2-32GB")[:2] == ("NVLink2", 25.0)
    assert generation("NVIDIA B200")[:2] == ("NVLink5", 50.0)
    assert generation("NVIDIA H800")[:2] == ("NVLink4", 25.0)  # H800 boxes show NV8: 200 GB/s


def test_the_slowest_visible_pair_decides_and_visible_devices_limit_the_pairs():
    names = ["Tesla V100-SXM2-32GB"] * 4
    everything = intra_node_link(DGX1_V100, names, visible_env="")
    assert everything.bandwidth_gb_s == 15.75 and "SYS" in everything.name  # GPU0-GPU3: PCIe via the CPUs
    two = intra_node_link(DGX1_V100, names, visible_env="0,2")
    assert two.bandwidth_gb_s == 50.0 and "NVLink2 x2" in two.name
    one_link = intra_node_link(DGX1_V100, names, visible_env="1,3")
    assert one_link.bandwidth_gb_s == 25.0
    # UUIDs cannot be matched to nvidia-smi's indices: all GPUs are taken.
    assert intra_node_link(DGX1_V100, names, visible_env="GPU-1234,GPU-5678").bandwidth_gb_s == 15.75
    # A SLURM job's cgroup shows nvidia-smi only its GPUs (renumbered) while CUDA_VISIBLE_DEVICES keeps the
    # node's numbers: the matrix is the job's, all of it is taken (it used to be none: a PCIe guess)
    assert intra_node_link(DGX1_V100, names, visible_env="4,6") == everything


def test_an_hgx_h100_node_has_nvlink_between_every_pair_and_a_rail_per_gpu():
    """NVIDIA/nccl issue 1264's node: 28 pairs all NV18 (450 GB/s per direction), each GPU's nearest NIC
    its own (PIX), the two NICs near no GPU left out; a farther NIC is nearest only where none is closer."""
    assert set(pair_links(HGX_H100_TOPO).values()) == {"NV18"} and len(pair_links(HGX_H100_TOPO)) == 28
    assert intra_node_link(HGX_H100_TOPO, ["NVIDIA H100 80GB HBM3"], "").bandwidth_gb_s == 450.0
    nics = nearest_nics(HGX_H100_TOPO)
    assert nics == {g: [f"NIC{n}"] for g, n in enumerate((0, 1, 2, 5, 6, 7, 8, 9))}
    shared = "\tGPU0\tGPU1\tNIC0\tNIC1\nGPU0\t X \tNV4\tNODE\tSYS\nGPU1\tNV4\t X \tNODE\tSYS\n"
    assert nearest_nics(shared) == {0: ["NIC0"], 1: ["NIC0"]}  # two GPUs behind one NIC: no rail each
    assert nearest_nics("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n") == {}


def test_pcie_only_nodes_and_missing_matrices():
    pcie = intra_node_link(PCIE_A100, ["NVIDIA A100-PCIE-40GB"] * 2, visible_env="")
    assert pcie.bandwidth_gb_s == 31.5 and "PCIe 4.0" in pcie.name and "one PCIe switch" in pcie.name
    assumed = intra_node_link("", ["NVIDIA H100 PCIe"], visible_env="")
    assert assumed.bandwidth_gb_s == 63.0 and "assumed" in assumed.name


@pytest.mark.parametrize("word", ["line rate", "NVLS", "exceed", "212", "272"])
def test_the_limit_says_what_it_means_and_cites_the_measurements(word):
    assert word in LIMIT_MEANING


def test_cluster_detect_takes_the_link_of_the_visible_pairs(monkeypatch):
    # A mocked 4 x H100 node with CUDA_VISIBLE_DEVICES=0,1: Cluster.detect reads nvidia-smi's matrix.
    import types

    import torch

    from labkit import cluster as cluster_mod

    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(
        cluster_mod,
        "_nvidia_smi_topo",
        lambda: DGX_H100.replace("GPU1\tNV18", "GPU1\tNV8", 1).replace(
            "\tNV18\tNV18\tNV18\tPXB", "\tNV8\tNV18\tNV18\tPXB", 1
        ),
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    node = cluster_mod.Cluster.detect()
    assert node.gpu_count == 2 and node.nccl_version == "2.21.5"
    assert node.intra_node.bandwidth_gb_s == 450.0  # GPUs 2-3 are NV18; the NV8 pair 0-1 is not visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert cluster_mod.Cluster.detect().intra_node.bandwidth_gb_s == 200.0
