"""A real node's GPU links: what `nvidia-smi topo -m` says joins each pair of GPUs, and how fast it is.

`Cluster.detect` calls `intra_node_link(matrix, gpu_names, visible)`: the slowest link between
any two *visible* GPUs, since a ring over them is as fast as its slowest hop. Its bandwidth is
the per-direction line rate: an `NV#` cell means # bonded NVLinks, each with the per-direction
rate of the GPU's NVLink generation; other cells are PCIe at the generation's x16 rate. These are
datasheet figures. What they mean as a limit (see `LIMIT_MEANING`): NCCL's ring all-reduce
reaches about 80 % of them on NVLink 4 (protocol overhead; nccl-tests issue 212); NCCL's NVLink
SHARP (NVLS) all-reduce on NVSwitch nodes reduces inside the switch, and its *bus* bandwidth can
go above the line rate.
The emulated cluster's links are in `labkit.links`.
"""

from __future__ import annotations

import os
import re

from labkit.links import Link

__all__ = [
    "FAKE_CUDA_SUFFIX",
    "HGX_H100_TOPO",
    "LIMIT_MEANING",
    "generation",
    "intra_node_link",
    "nearest_nics",
    "pair_links",
    "parse_topo_matrix",
]

# The end of a GPU's name on CI's fake CUDA machine (labkit.machine.emulate.fake_cuda): its links are not
# a node's
FAKE_CUDA_SUFFIX = "(fake CUDA)"

# Per GPU family: (NVLink generation, GB/s per link per direction, PCIe generation, GB/s of an x16
# slot per direction). NVLink 2, 3 and 4 all run 25 GB/s per link per direction; the totals differ
# by the link count: V100 6 links = 150 GB/s, A100 12 = 300, H100/H200 18 = 450 (NVIDIA's V100,
# A100 and H100 datasheets quote twice these, both directions added; NCCL's Sylvain Jeaugey gives
# 25 GB/s per link per direction in nccl-tests issue 149). NVLink 5 (Blackwell): 50 GB/s per link.
# PCIe x16 per direction: gen3 15.75, gen4 31.5, gen5 63 GB/s (PCI-SIG).
_FAMILIES = (
    (("B100", "B200", "B300", "GB200", "GB300"), ("NVLink5", 50.0, "PCIe 5.0", 63.0)),
    (("H100", "H200", "H800", "H20", "GH200"), ("NVLink4", 25.0, "PCIe 5.0", 63.0)),
    (("A100", "A800", "A30"), ("NVLink3", 25.0, "PCIe 4.0", 31.5)),
    (("V100",), ("NVLink2", 25.0, "PCIe 3.0", 15.75)),
    (("P100",), ("NVLink1", 20.0, "PCIe 3.0", 15.75)),
)
_UNKNOWN = ("NVLink", 25.0, "PCIe 4.0", 31.5)
_NVLINK_ALPHA_US, _PCIE_ALPHA_US = 3.0, 5.0  # per-step latency, the order nccl-tests shows at 8 B

# What the cells other than NV# mean (the legend `nvidia-smi topo -m` prints).
_PCIE_PATHS = {
    "PIX": "one PCIe switch",
    "PXB": "several PCIe switches",
    "PHB": "a PCIe host bridge",
    "NODE": "host bridges within one NUMA node",
    "SYS": "the CPU sockets' interconnect",
}

LIMIT_MEANING = (
    "the per-direction line rate of the slowest link between two visible GPUs (datasheet); NCCL's ring "
    "reaches about 80 % of it on NVLink (protocol overhead: nccl-tests issue 212 gives ~370 GB/s of 450 on "
    "H100 with NCCL_ALGO=RING); NCCL's NVLS all-reduce on NVSwitch nodes reduces in the switch, and its bus "
    "bandwidth can exceed the line rate (~480 GB/s on 8 x H100 or H200: nccl-tests issues 212 and 272)"
)


def generation(gpu_name: str) -> tuple[str, float, str, float]:
    """(NVLink generation, GB/s per link per direction, PCIe generation, x16 GB/s) of a GPU by name."""
    upper = gpu_name.upper()
    for names, figures in _FAMILIES:
        if any(re.search(rf"\b{n}\b", upper) for n in names):
            return figures
    return _UNKNOWN


def parse_topo_matrix(matrix: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi topo -m` as {row: {column: cell}} for the GPU and NIC rows and columns."""
    clean = re.sub(r"\x1b\[[0-9;]*m", "", matrix)  # nvidia-smi underlines the header on a terminal
    columns: list[str] = []
    table: dict[str, dict[str, str]] = {}
    for line in clean.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        if not columns and re.fullmatch(r"GPU\d+", tokens[0]) and line[:1].isspace():
            columns = [t for t in tokens if re.fullmatch(r"(GPU|NIC)\d+", t)]
        elif columns and re.fullmatch(r"(GPU|NIC)\d+", tokens[0]):
            table[tokens[0]] = dict(zip(columns, tokens[1 : 1 + len(columns)]))
        elif columns and tokens[0].startswith("Legend"):
            break
    return table


# The GPU rows of `nvidia-smi topo -m` on an HGX H100 node (8 x H100 SXM, 10 NICs), as posted in
# NVIDIA/nccl issue 1264 (https://github.com/NVIDIA/nccl/issues/1264; its NIC rows and legend left out): NV18
# between every pair (18 NVLink 4 links through the NVSwitches), one NIC on each GPU's own PCIe switch (PIX:
# a "rail" per GPU), two more NICs (NIC3, NIC4) near no GPU, and the CPU socket (NUMA node) of each half.
_AFFINITY = ["CPU Affinity", "NUMA Affinity"]
_HEADER = ["", *(f"GPU{g}" for g in range(8)), *(f"NIC{n}" for n in range(10)), *_AFFINITY]
_RAILS = (0, 1, 2, 5, 6, 7, 8, 9)  # the NIC on each GPU's PCIe switch
HGX_H100_TOPO = "\n".join(
    [
        "\t".join(_HEADER),
        *(
            "\t".join(
                [
                    f"GPU{g}",
                    *(" X " if j == g else "NV18" for j in range(8)),
                    *("PIX" if n == _RAILS[g] else "SYS" for n in range(10)),
                    "0-55,112-167" if g < 4 else "56-111,168-223",
                    "0" if g < 4 else "1",
                ]
            )
            for g in range(8)
        ),
    ]
)

# How far a path goes, nearest first: the order of nvidia-smi's legend and of NCCL's path types
# (src/graph/topo.h: PATH_PIX < PATH_PXB < PATH_PHB < PATH_SYS; NODE sits between PHB and SYS).
_DISTANCE = ("PIX", "PXB", "PHB", "NODE", "SYS")


def nearest_nics(matrix: str) -> dict[int, list[str]]:
    """{GPU index: the NICs nearest to it}, by the path `nvidia-smi topo -m` shows. NCCL's topology search
    prefers a GPU's nearest NIC for its traffic between nodes, so a node with one PIX NIC per GPU has a rail
    per GPU."""
    table = parse_topo_matrix(matrix)
    out = {}
    for row, cells in table.items():
        if not row.startswith("GPU"):
            continue
        nics = {col: cell for col, cell in cells.items() if col.startswith("NIC") and cell in _DISTANCE}
        if nics:
            best = min(_DISTANCE.index(c) for c in nics.values())
            out[int(row[3:])] = [n for n, c in nics.items() if _DISTANCE.index(c) == best]
    return out


def _visible(env: str | None, count: int) -> list[int]:
    """The nvidia-smi indices CUDA may use: CUDA_VISIBLE_DEVICES when it lists indices, else all.

    UUIDs or MIG names cannot be matched to the matrix from here, so all GPUs are taken; CUDA
    also numbers GPUs fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which only matters on a
    node with mixed GPUs. An index beyond the matrix means the list numbers GPUs the matrix does not
    (a SLURM job whose device cgroup shows nvidia-smi only its own GPUs, renumbered from 0, while
    CUDA_VISIBLE_DEVICES keeps the node's numbers): then the matrix is the job's GPUs, all taken, not
    none (which left no pair and a PCIe guess).
    """
    if env is None or not env.strip():
        return list(range(count))
    picked = []
    for item in env.split(","):
        item = item.strip()
        if not item.isdigit():
            return list(range(count))
        if int(item) >= count:
            return list(range(count))
        picked.append(int(item))
    return picked


def pair_links(matrix: str, visible: list[int] | None = None) -> dict[tuple[int, int], str]:
    """{(i, j): cell} for each pair i < j of the visible GPUs (nvidia-smi indices), e.g. "NV18", "SYS"."""
    table = parse_topo_matrix(matrix)
    gpus = sorted(int(name[3:]) for name in table if name.startswith("GPU"))
    keep = set(gpus if visible is None else visible)
    return {
        (i, j): table[f"GPU{i}"].get(f"GPU{j}", "SYS")
        for i in gpus
        for j in gpus
        if i < j and i in keep and j in keep
    }


def _link(cell: str, gpu_name: str) -> Link:
    nvlink, per_link, pcie, x16 = generation(gpu_name)
    if cell.startswith("NV") and cell[2:].isdigit():
        n = int(cell[2:])
        return Link(n * per_link, _NVLINK_ALPHA_US, f"{nvlink} x{n} ({cell}, nvidia-smi topo -m)")
    path = _PCIE_PATHS.get(cell, cell)
    return Link(x16, _PCIE_ALPHA_US, f"{pcie} x16 through {path} ({cell}, nvidia-smi topo -m)")


def intra_node_link(matrix: str, gpu_names: list[str], visible_env: str | None = None) -> Link:
    """The slowest link between two visible GPUs of this node (one GPU or no matrix: PCIe, assumed).

    `visible_env` is CUDA_VISIBLE_DEVICES (read from the environment when None).
    """
    name = gpu_names[0] if gpu_names else ""
    table_gpus = [n for n in parse_topo_matrix(matrix) if n.startswith("GPU")]
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if visible_env is None else visible_env
    pairs = pair_links(matrix, _visible(env, len(table_gpus)))
    if not pairs:
        _, _, pcie, x16 = generation(name)
        return Link(x16, _PCIE_ALPHA_US, f"{pcie} x16 (assumed: no GPU pair in nvidia-smi topo -m)")
    return min((_link(cell, name) for cell in pairs.values()), key=lambda link: link.bandwidth_gb_s)
