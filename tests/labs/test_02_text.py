"""Numbers in the labs' prose against their sources: NCCL's per-protocol buffers (lab 02, from NCCL's
`src/init.cc` and `src/include/device.h`), the ring's share of NVLink (lab 00, nccl-tests issue 212), and lab 00's
cited `nvidia-smi topo -m` and NCCL variables."""

from __future__ import annotations

import json


def _text(repo, lab: str, start: str) -> str:
    """The solution's markdown cell that holds `start`, as one line (the markdown wraps anywhere)."""
    nb = json.loads((repo / "solutions" / f"{lab}.ipynb").read_text(encoding="utf-8"))
    cells = (" ".join("".join(c["source"]).split()) for c in nb["cells"] if c["cell_type"] == "markdown")
    return next(t for t in cells if start in t)


# NCCL's defaults (src/init.cc): DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD (8) x NCCL_LL_MAX_NTHREADS (512)
# x NCCL_STEPS (8) x sizeof(union ncclLLFifoLine) (16); DEFAULT_LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD (120)
# x NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS x sizeof(uint64_t); DEFAULT_BUFFSIZE = 1 << 22 (Simple)
LL_BYTES = 8 * 512 * 8 * 16
LL128_BYTES = 120 * 640 * 8 * 8
SIMPLE_BYTES = 1 << 22


def test_lab_02_sizes_ncclS_protocol_buffers_as_ncclS_source_does(repo):
    text = _text(repo, "02_oom_batch", "NCCL_BUFFSIZE")
    assert LL_BYTES == 512 * 2**10 and f"{LL_BYTES // 2**10} KiB for LL" in text
    assert LL128_BYTES > SIMPLE_BYTES and f"about {LL128_BYTES / 2**20:.2f} MiB for LL128" in text
    assert f"`NCCL_BUFFSIZE` bytes, {SIMPLE_BYTES // 2**20} MiB by default" in text
    assert "larger than Simple's" in text


def test_lab_00_gives_the_ring_its_measured_share_of_nvlink(repo):
    text = _text(repo, "00_cluster_tour", "A ring all-reduce reaches")
    ring, line = 370, 450  # GB/s: NCCL_ALGO=RING on 8 x H100 (nccl-tests issue 212), NVLink 4's 18 x 25
    assert f"~{ring} of {line} GB/s" in text and "NCCL_ALGO=RING" in text
    assert abs(ring / line - 0.80) < 0.03 and "about 80 %" in text


def test_lab_00_reads_a_cited_node_and_names_the_nccl_variables_an_engineer_sets(repo):
    topo = _text(repo, "00_cluster_tour", "reading `nvidia-smi topo -m`")
    assert "https://github.com/NVIDIA/nccl/issues/1264" in topo and "18 x 25 GB/s = 450 GB/s" in topo
    for cell in ("PIX", "PXB", "PHB", "NODE", "SYS"):
        assert f"| `{cell}` |" in topo
    nb = json.loads((repo / "solutions" / "00_cluster_tour.ipynb").read_text(encoding="utf-8"))
    assert any(
        "nearest_nics(HGX_H100_TOPO)" in "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
    )
    env = _text(repo, "00_cluster_tour", "The NCCL variables you will meet")
    assert "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html" in env
    for name in (
        "NCCL_DEBUG",
        "NCCL_ALGO",
        "NCCL_PROTO",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "NCCL_NVLS_ENABLE",
    ):
        assert f"`{name}" in env, name
    assert "`NCCL_P2P_LEVEL`" in env and "experiments only" in env
