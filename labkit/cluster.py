"""What the course runs on: a real GPU node (NCCL) or an emulated cluster (CPU processes, gloo).

`Cluster.detect()` reads the real machine; `Cluster.emulated(...)` describes a pretend one;
`Cluster.resolve("auto" | "cpu" | "gpu" | Cluster, world_size)` is what `labkit.launch`
uses to pick one, and it says which it picked. `Cluster.preset("dgx-a100-80gb", nodes=192)`
describes a published machine nobody here has (`kind="described"`): `labkit.planner` plans for
it, `launch` refuses it. `Cluster.preset("dgx-h100").simulated()` (or `cluster="sim:dgx-h100"`) is
that machine *simulated* (`kind="simulated"`): `launch` runs the ranks as CPU processes on tensors
without storage, each operator timed on the described GPU (`labkit.op_time`), each collective by
the preset's links, memory counted against the card's.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from dataclasses import asdict, dataclass, field, replace

import torch

from labkit import calibrate, gpu_links, validate
from labkit.links import FLOP_PER_BYTE_INTER, FLOP_PER_BYTE_INTRA, Link, Topology, default_links
from labkit.op_time import FP32_PEAK_TFLOPS, GpuSpec

__all__ = ["GPU", "PRESETS", "Cluster"]


def _memory_words(gib: float | None) -> str:
    """Each rank's memory in words; a lab may give it less than the card (lab 02: 48 MiB)."""
    if gib is None:
        return "no memory budget"
    return f"{gib:g} GiB" if gib >= 1 else f"{gib * 1024:g} MiB"


@dataclass(frozen=True)
class GPU:
    """One GPU of a cluster, as torch.cuda reports it."""

    index: int
    name: str
    memory_gib: float


@dataclass(frozen=True)
class Cluster:
    """A set of ranks, their nodes and links: real GPUs (`kind="gpu"`), emulated (`"emulated"`), a published
    machine to plan for (`"described"`) or that machine simulated (`"simulated"`)."""

    kind: str
    nodes: int
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    memory_gib: float | None = None
    gpus: tuple[GPU, ...] = ()
    topology_matrix: str = ""
    cpu_gflops: float | None = None
    calibration: str = ""  # where cpu_gflops came from (labkit.calibrate)
    torch_version: str = field(default_factory=lambda: torch.__version__)
    nccl_version: str | None = None
    reason: str = ""
    clock: str = "virtual"  # emulated: "virtual" (the rank's device clock) or "wall"; simulated: "simulated"
    peak_tflops: float | None = None  # described and simulated: dense 16-bit peak per GPU (datasheet)
    gpu_name: str = ""  # described and simulated
    sm_count: int | None = None  # described only: streaming multiprocessors per GPU (datasheet)
    memory_gb_s: float | None = None  # described only: HBM bandwidth per GPU, GB/s (datasheet)
    preset_name: str = ""  # described and simulated: the PRESETS name it came from
    nics_per_node: int = 1  # network ports (rails) per node, each an inter_node link (labkit.links.Topology)
    nvls_gb_s: float | None = None  # where the NVSwitch reduces (NVLS): a GPU's all-reduce rate through it

    # -- construction ----------------------------------------------------------

    @classmethod
    def emulated(
        cls,
        nodes: int = 1,
        gpus_per_node: int = 2,
        intra_node: Link | None = None,
        inter_node: Link | None = None,
        memory_gib: float | None = None,
        clock: str = "virtual",
    ) -> Cluster:
        """A pretend cluster of CPU processes. Links default to this CPU's scaled figures.

        `memory_gib` is each rank's memory budget (None: no budget is enforced). `clock`:
        "virtual" (default) times every rank on its own emulated-GPU clock (`labkit.machine.emulate.clock`),
        exact on a busy machine; "wall" times it on the wall clock, as it runs.
        """
        validate.one_of(
            "Cluster.emulated clock", clock, ("virtual", "wall"), "Cluster.emulated(clock='virtual')"
        )
        for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
            validate.positive_int(
                f"Cluster.emulated {name}", value, "Cluster.emulated(nodes=2, gpus_per_node=2)"
            )
        if memory_gib is not None:
            validate.positive_number(
                "Cluster.emulated memory_gib",
                memory_gib,
                "memory_gib=0.25 for a 256 MiB budget per rank, or None for none",
            )
        gflops, source = None, ""
        if intra_node is None or inter_node is None:
            calibration = calibrate.cpu_gflops()
            gflops, source = calibration.gflops, calibration.describe()
            d_intra, d_inter = default_links(gflops)
            intra_node = intra_node or d_intra
            inter_node = inter_node or d_inter
        return cls(
            kind="emulated",
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            intra_node=intra_node,
            inter_node=inter_node,
            memory_gib=memory_gib,
            clock=clock,
            cpu_gflops=gflops,
            calibration=source,
        )

    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> Cluster:
        """A published system, to plan for (`labkit.planner.plan`), never to run on.

        Known names: see `PRESETS` ("dgx-a100-80gb", "dgx-h100", "dgx-h200"); `nodes` of them.
        """
        if name not in PRESETS:
            raise ValueError(
                f"unknown cluster preset {name!r}; known presets: {', '.join(sorted(PRESETS))}. "
                "For another machine build Cluster(kind='described', nodes=..., gpus_per_node=..., "
                "intra_node=Link(...), inter_node=Link(...), memory_gib=..., peak_tflops=...)"
            )
        validate.positive_int("Cluster.preset nodes", nodes, f'Cluster.preset("{name}", nodes=2)')
        return replace(PRESETS[name], nodes=nodes, preset_name=name)

    def simulated(self) -> Cluster:
        """This described machine in simulated time: `launch` runs the lab's real program on its ranks, at GPU
        size on tensors without storage (FakeTensor), each operator taking its time on the described GPU
        (`labkit.op_time`), each collective its links' α-β time, memory counted against the card's.
        Numerics are not computed there: the emulated cluster checks them at small size."""
        if self.kind != "described":
            raise ValueError(
                f"only a described machine can be simulated, not a {self.kind!r} cluster; e.g. "
                'Cluster.preset("dgx-h100").simulated(), or cluster="sim:dgx-h100"'
            )
        return replace(self, kind="simulated", clock="simulated", reason=f"simulated {self.gpu_name} node(s)")

    def gpu_spec(self) -> GpuSpec:
        """The described GPU as the per-operator time model reads it (`labkit.op_time.GpuSpec`)."""
        if self.kind not in ("described", "simulated") or not (
            self.peak_tflops and self.sm_count and self.memory_gb_s and self.memory_gib
        ):
            raise ValueError(
                f"a {self.kind!r} cluster has no described GPU (peak_tflops, sm_count, memory_gb_s, "
                'memory_gib); use a preset, e.g. Cluster.preset("dgx-h100")'
            )
        fp32 = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in self.gpu_name.upper()), None)
        if fp32 is None:
            raise ValueError(
                f"no fp32 peak known for {self.gpu_name!r} (known: {', '.join(FP32_PEAK_TFLOPS)}); "
                "add it to labkit.op_time.FP32_PEAK_TFLOPS from the GPU's datasheet"
            )
        return GpuSpec(
            self.gpu_name, self.peak_tflops, fp32, self.memory_gb_s, self.sm_count, self.memory_gib
        )

    @classmethod
    def detect(cls) -> Cluster:
        """The GPUs of this machine (name, memory), their topology and NCCL version.

        With no GPU this returns a one-node cluster with no GPUs (`gpu_count == 0`).
        """
        gpus: list[GPU] = []
        nccl = None
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(GPU(i, p.name, round(p.total_memory / 2**30, 1)))
            try:
                nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
            except Exception:  # a CUDA build without NCCL
                nccl = None
        matrix = _nvidia_smi_topo() if gpus else ""
        intra = gpu_links.intra_node_link(matrix, [g.name for g in gpus]) if gpus else Link(1.0, 0.0, "none")
        inter = Link(50.0, 5.0, "InfiniBand NDR 400 Gb/s (assumed)")
        # CI's fake GPUs (labkit.machine.emulate.fake_cuda) compute on this CPU: links scaled to it, as on
        # the emulated cluster
        if gpus and gpus[0].name.endswith(gpu_links.FAKE_CUDA_SUFFIX):
            intra, inter = default_links(calibrate.cpu_gflops().gflops)
        return cls(
            kind="gpu",
            nodes=1,
            gpus_per_node=len(gpus),
            intra_node=intra,
            inter_node=inter,
            gpus=tuple(gpus),
            topology_matrix=matrix,
            nccl_version=nccl,
        )

    @classmethod
    def resolve(cls, spec: Cluster | str, world_size: int) -> Cluster:
        """Turn `"auto" | "cpu" | "gpu" | Cluster` into a cluster able to hold `world_size` ranks.

        "auto" takes NCCL with one process per GPU when this machine has a GPU for every rank (one
        GPU is enough for one rank: memory, profiling and one-rank runs use it), else the emulated
        cluster; `reason` says which and why.
        """
        validate.positive_int(
            "world_size", world_size, "launch(fn, world_size=2), or labkit run -p world_size 2"
        )
        if isinstance(spec, Cluster):
            cluster = spec
            if cluster.kind == "described":
                raise ValueError(
                    f"cluster={cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu_name or 'GPU'} only "
                    "describes a machine: nothing here can run on it. Plan for it with "
                    "labkit.planner.plan(model, cluster, global_batch); to run, use cluster='cpu' (the "
                    f"emulated cluster), e.g. Cluster.emulated(nodes={min(cluster.nodes, 2)}, "
                    f"gpus_per_node={min(cluster.gpus_per_node, 4)}), or cluster='gpu' on this machine's "
                    "GPUs."
                )
        elif isinstance(spec, str) and spec.startswith("sim:"):
            cluster = _simulated_spec(spec, world_size)
        elif spec in ("cpu", "emulated"):
            cluster = replace(cls.emulated(gpus_per_node=world_size), reason="asked for the emulated cluster")
        elif spec in ("gpu", "auto"):
            real = cls.detect()
            n = real.gpu_count
            if spec == "gpu" or (n >= 1 and n >= world_size):
                cluster = replace(real, reason=f"{n} GPU(s) found: NCCL, one process per GPU")
            else:
                why = (
                    "no GPU found"
                    if n == 0
                    else f"{n} GPU(s) found, {world_size} ranks asked (a lab needing {world_size} ranks "
                    "runs them here)"
                )
                cluster = replace(cls.emulated(gpus_per_node=world_size), reason=f"{why}: emulated cluster")
        else:
            raise ValueError(
                f"cluster={spec!r} is not known; use 'auto', 'cpu' (emulated), 'gpu', 'sim:dgx-h100' "
                "(a simulated node; 'sim:dgx-a100-80gb:2' for two) or a labkit.Cluster, e.g. "
                "Cluster.emulated(nodes=2, gpus_per_node=2)."
            )
        cluster._check_holds(world_size)
        return cluster

    # -- facts -----------------------------------------------------------------

    @property
    def is_emulated(self) -> bool:
        """Are the ranks CPU processes standing in for GPUs (emulated, or a simulated described machine)?"""
        return self.kind in ("emulated", "simulated")

    @property
    def is_simulated(self) -> bool:
        return self.kind == "simulated"

    @property
    def is_fake_cuda(self) -> bool:
        """Is it CI's fake CUDA machine (`labkit.machine.emulate.fake_cuda`): a GPU node's API over this
        CPU?"""
        fake = gpu_links.FAKE_CUDA_SUFFIX
        return self.kind == "gpu" and bool(self.gpus) and self.gpus[0].name.endswith(fake)

    @property
    def gpu_sized(self) -> bool:
        """Do labs take their GPU sizes here (real GPUs, or a simulated GPU machine)? Not on CI's fake CUDA
        machine, which computes on this CPU: its tests pass the GPU sizes a CPU can run (lab 02's)."""
        return self.kind == "simulated" or (self.kind == "gpu" and not self.is_fake_cuda)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def world_size(self) -> int:
        """How many ranks the cluster holds (all GPUs of all nodes)."""
        return self.nodes * self.gpus_per_node

    @property
    def label(self) -> str:
        """Appended to every number measured (or, for a described cluster, predicted) on this cluster."""
        if self.kind == "described":
            return "predicted, on paper"
        if self.kind == "simulated":
            return f"simulated {self.gpu_name}"
        if self.is_fake_cuda:
            return "emulated, fake CUDA"  # CI's stand-in for a GPU node (labkit.machine.emulate.fake_cuda)
        return "emulated" if self.is_emulated else "measured on GPU"

    def topology(self) -> Topology:
        return Topology(
            max(1, self.gpus_per_node), self.intra_node, self.inter_node, self.nics_per_node, self.nvls_gb_s
        )

    def _check_holds(self, world_size: int) -> None:
        """`resolve`'s last check: this cluster has a GPU (or an emulated or simulated one) for every rank."""
        if self.kind == "gpu" and self.gpu_count == 0:
            raise ValueError(
                f"world_size={world_size} is larger than the 0 GPU(s) present: cluster='gpu' was asked for, "
                f"but this machine has no GPU (torch.cuda.is_available() is {torch.cuda.is_available()}, "
                f"torch {torch.__version__}); use cluster='cpu' for the emulated cluster (labkit run "
                "--cluster cpu)."
            )
        if self.kind == "gpu" and world_size > self.gpu_count:
            raise ValueError(
                f"world_size={world_size} is larger than the {self.gpu_count} GPU(s) present; "
                f"use world_size<={self.gpu_count}, or cluster='cpu' for the emulated cluster."
            )
        if self.kind == "simulated" and world_size > self.world_size:
            raise ValueError(
                f"world_size={world_size} is larger than the simulated {self.nodes} node(s) x "
                f"{self.gpus_per_node} {self.gpu_name} = {self.world_size} GPUs; simulate more nodes, e.g. "
                f"cluster='sim:{self.preset_name or '<preset>'}:{-(-world_size // self.gpus_per_node)}'."
            )
        if self.kind == "emulated" and world_size > self.world_size:
            raise ValueError(
                f"world_size={world_size} is larger than the emulated cluster's {self.nodes} node(s) x "
                f"{self.gpus_per_node} GPU(s) = {self.world_size} ranks; build a larger one, e.g. "
                f"Cluster.emulated(nodes={self.nodes}, gpus_per_node={-(-world_size // self.nodes)})."
            )

    def describe(self) -> str:
        """A few lines for a notebook or `labkit doctor`."""
        lines = []
        if self.kind in ("described", "simulated"):
            memory = _memory_words(self.memory_gib)
            lines.append(
                ("Simulated cluster (each operator timed on the described GPU, no numerics): "
                 if self.kind == "simulated" else "Described cluster (planning only): ")
                + f"{self.nodes} node(s) x {self.gpus_per_node} "
                f"{self.gpu_name}, {memory} and {self.peak_tflops:g} TFLOP/s (dense 16-bit) "
                "each"
            )
            nvls = ""
            if self.nvls_gb_s:
                nvls = f"; all-reduce through the switch (NVLS) {self.nvls_gb_s:g} GB/s per GPU"
            lines.append(
                f"  intra-node link: {self.intra_node.bandwidth_gb_s:g} GB/s per GPU per direction, "
                f"{self.intra_node.latency_us:g} µs ({self.intra_node.name}){nvls}"
            )
            port = self.inter_node
            lines.append(
                f"  inter-node: {self.nics_per_node} port(s) per node of {port.bandwidth_gb_s:g} GB/s per "
                f"direction, {port.latency_us:g} µs ({port.name})"
            )
        elif self.is_emulated:
            lines.append(
                f"Emulated cluster: {self.nodes} node(s) x {self.gpus_per_node} emulated GPU(s); "
                "one CPU process per GPU on gloo, links held to an α-β model."
            )
            lines.append(
                f"  intra-node link: {self.intra_node.bandwidth_gb_s * 1000:.1f} MB/s, "
                f"{self.intra_node.latency_us:.0f} µs ({self.intra_node.name or 'custom'})"
            )
            lines.append(
                f"  inter-node link: {self.inter_node.bandwidth_gb_s * 1000:.1f} MB/s, "
                f"{self.inter_node.latency_us:.0f} µs ({self.inter_node.name or 'custom'})"
            )
            if self.cpu_gflops:
                lines.append(
                    f"  links scaled from this CPU's {self.cpu_gflops:.1f} GFLOP/s per core "
                    f"(1 byte per {FLOP_PER_BYTE_INTRA:,.0f} FLOP intra-node, {FLOP_PER_BYTE_INTER:,.0f} "
                    "inter-node)"
                )
                if self.calibration:
                    lines.append(f"  calibration: {self.calibration}")
            budget = "none" if self.memory_gib is None else f"{self.memory_gib * 1024:.0f} MiB"
            lines.append(f"  memory budget per rank: {budget}")
            if self.clock == "virtual":
                lines.append(
                    "  time: each rank's virtual device clock (its main thread's CPU time, plus waiting "
                    "for collectives as the link model says)"
                )
            else:
                lines.append("  time: the wall clock (every emulated GPU needs a free core)")
        else:
            lines.append(
                f"GPU node: {self.gpu_count} GPU(s), NCCL {self.nccl_version or '?'}, torch "
                f"{self.torch_version}"
            )
            for g in self.gpus:
                lines.append(f"  cuda:{g.index} {g.name} {g.memory_gib} GiB")
            if self.topology_matrix:
                lines.append(self.topology_matrix)
        if self.reason:
            lines.append(f"  chosen because: {self.reason}")
        return "\n".join(lines)

    # -- passing to workers ----------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> Cluster:
        d = json.loads(raw)
        d["intra_node"] = Link(**d["intra_node"])
        d["inter_node"] = Link(**d["inter_node"])
        d["gpus"] = tuple(GPU(**g) for g in d["gpus"])
        return cls(**d)


# Published systems (for planning only). Peak: dense bf16 Tensor Core FLOP/s without sparsity, from
# NVIDIA's A100 datasheet (312 TFLOP/s) and H100/H200 SXM datasheets (989 TFLOP/s). Links per GPU and
# direction: NVLink 3 on A100, 12 links x 25 GB/s = 300 GB/s; NVLink 4 on H100/H200, 18 x 25 = 450 GB/s
# (labkit.gpu_links). Between nodes one InfiniBand port per GPU: DGX A100 has eight 200 Gb/s HDR ports
# (25 GB/s), DGX H100/H200 eight 400 Gb/s NDR ports (50 GB/s) (NVIDIA DGX A100 and DGX H100 user
# guides). Latencies are assumptions of a few microseconds, NCCL's order for small messages.
# SMs and HBM bandwidth (the planner's GEMM efficiency, labkit.planner.gemm_s): A100 SXM4 80GB 108 SMs and
# 2,039 GB/s (NVIDIA A100 datasheet and Ampere architecture whitepaper); H100 SXM5 132 SMs and 3,350 GB/s;
# H200 SXM 132 SMs (the H100's GH100 die) and 4,800 GB/s (NVIDIA H100 and H200 datasheets).
_NVLINK3 = Link(300.0, 5.0, "NVLink 3 + NVSwitch")
_NVLINK4 = Link(450.0, 5.0, "NVLink 4 + NVSwitch")
_HDR = Link(25.0, 10.0, "InfiniBand HDR 200 Gb/s")
_NDR = Link(50.0, 10.0, "InfiniBand NDR 400 Gb/s")
# Eight ports per DGX, one beside each GPU (the DGX A100 and DGX H100 user guides): the rails NCCL spreads a
# collective's inter-node traffic over (labkit.links.Topology.rail_ring).
_RAILS = 8
# NVLink SHARP (NVLS) on H100 and H200 nodes: the third-generation NVSwitch reduces, so in an all-reduce each
# GPU sends its buffer once and receives the result once. Fitted to one published figure: 476 GB/s bus
# bandwidth, NCCL's default all-reduce on 8 H100s (nccl-tests issue 290, "in the expected range" by NCCL's
# maintainer), that is 476 / (2 x 7/8) = 272 GB/s per GPU through the switch. Held out: ~480 GB/s on another
# 8 x H100 node (nccl-tests issue 212) and ~470 GB/s on two such nodes over 8 x 400 Gb/s each (NVIDIA/nccl
# issue 2409, citing nccl-tests issue 309); tests/test_links.py holds both. NCCL's own tuner assumes more
# (nvlsEfficiency 0.85 of its NVLink figure, 18 x 20.6 GB/s, in src/graph/tuning.cc: 315 GB/s).
_NVLS_H100_GB_S = 272.0


def _dgx(
    gpu_name: str,
    memory_gib: float,
    peak_tflops: float,
    sms: int,
    hbm_gb_s: float,
    nvlink: Link,
    ib: Link,
    nvls_gb_s: float | None = None,
) -> Cluster:
    """One DGX node: eight GPUs on NVSwitch, one InfiniBand port per GPU towards other nodes."""
    return Cluster("described", 1, 8, nvlink, ib, memory_gib=memory_gib, peak_tflops=peak_tflops,
                   gpu_name=gpu_name, sm_count=sms, memory_gb_s=hbm_gb_s, nics_per_node=_RAILS,
                   nvls_gb_s=nvls_gb_s)


PRESETS: dict[str, Cluster] = {
    "dgx-a100-80gb": _dgx("A100-SXM4-80GB", 80.0, 312.0, 108, 2039.0, _NVLINK3, _HDR),  # no NVLS: Hopper's
    "dgx-h100": _dgx("H100-SXM5-80GB", 80.0, 989.0, 132, 3350.0, _NVLINK4, _NDR, _NVLS_H100_GB_S),
    "dgx-h200": _dgx("H200-SXM-141GB", 141.0, 989.0, 132, 4800.0, _NVLINK4, _NDR, _NVLS_H100_GB_S),
}


def _simulated_spec(spec: str, world_size: int) -> Cluster:
    """'sim:<preset>' (as many nodes as `world_size` needs) or 'sim:<preset>:<nodes>', simulated."""
    _, _, rest = spec.partition(":")
    name, _, nodes = rest.partition(":")
    if name not in PRESETS or (nodes and not nodes.isdigit()) or nodes == "0":
        raise ValueError(
            f"cluster={spec!r} is not a simulated machine; use 'sim:<preset>' or 'sim:<preset>:<nodes>' with "
            f"a preset among {', '.join(sorted(PRESETS))}, e.g. 'sim:dgx-h100' or 'sim:dgx-a100-80gb:2'"
        )
    per_node = PRESETS[name].gpus_per_node
    return Cluster.preset(name, nodes=int(nodes) if nodes else -(-world_size // per_node)).simulated()


# Once per process: a node's topology does not change while it runs, and labkit run -p resolves every lab's
# machine before its kernels start (nvidia-smi takes a while each time)
@functools.cache
def _nvidia_smi_topo() -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        return subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
