"""`Machine`: where a lab runs, resolved once where it starts (a notebook, a script, `labkit run`) and passed
down. Labs and notebooks ask it what differs between machines; they do not test the machine's kind.

    m = Machine.resolve(p.cluster, p.world_size)     # or p.machine() for a lab's Params
    labkit.launch(fn, world_size=m.ranks, cluster=m.limited(p.memory_mib))
    print(f"{step_ms:.1f} ms ({m.label})")

Three kinds stand behind one value (`kind`): real GPUs ("gpu", NCCL, CUDA's caching allocator; CI's fake
CUDA machine, `labkit.machine.emulate.fake_cuda`, is one too, with tensors on the CPU), the emulated cluster
("emulated": CPU processes, gloo under the link model, the virtual clock) and a simulated described machine
("simulated": FakeTensors, each operator timed on the described GPU). A script's ranks that torchrun started
are described by `labkit.course.experiments.script.Where` instead. What each answers:

* where values are checked: `computes_values`, `for_values()` (a simulated machine computes none, so
  numerics are checked on the emulated cluster at the same ranks);
* time: `times_noisy` (repeated steps differ), `judged_by_verdict` (the lesson is judged by the course's
  targets, `labkit.course.forecast.verdict`, not by the emulated cluster's exact checks), `gpu_name`,
  `times_host_python` (a tokenizer in the loop costs time), `fp32_peak()` (MFU's denominator),
  `runs_cuda_kernels` (what Nsight Systems traces);
* memory: `limited(mib)` and `counting()` (the cluster to run a step under a cap, or where nothing runs out),
  `caps_reserved` and `allocator_headroom_bytes` (on a card the cap limits the allocator's reserved
  segments), `optimizer_foreach` (whose temporaries `labkit.memory.estimate` counts),
  `grad_sync_extra_bytes` (what its gradient sync holds beside the gradients), `torch_ddp`;
* records: `records()`, the keys every lab writes about where it ran.

Inside a rank, `labkit.machine.runtime` (device, clock, optimizer options) and `labkit.machine.device_memory`
answer for the rank's own process; this value is the notebook's and the driver's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from labkit import calibrate
from labkit.cluster import Cluster
from labkit.op_time import FP32_PEAK_TFLOPS

__all__ = ["LARGE_SEGMENT_BYTES", "Machine"]

# CUDA's caching allocator serves requests of 1-10 MiB from 20 MiB segments (kLargeBuffer in
# c10/cuda/CUDACachingAllocator.cpp) and reserves a new one when no cached block fits: under a cap on
# reserved memory one CUDA-only tensor of a few MiB (a workspace, a cast cache, NCCL's buffers) needs that
# much room, which is what the one H200 run of lab 02 ran out of ("Tried to allocate 20.00 MiB").
LARGE_SEGMENT_BYTES = 20 * 2**20


@dataclass(frozen=True)
class Machine:
    """The machine a lab runs on: its cluster (resolved for `ranks`) and what differs there (module docs)."""

    cluster: Cluster
    ranks: int

    @classmethod
    def resolve(cls, spec: Cluster | str, ranks: int) -> Machine:
        """The machine for `spec` ("auto" | "cpu" | "gpu" | "sim:<preset>[:nodes]" | a `Cluster`) and
        `ranks`, resolved once (`Cluster.resolve` checks that the ranks fit and says why it picked it)."""
        return cls(Cluster.resolve(spec, ranks), ranks)

    # ------------------------------------------------------------------ what it is

    @property
    def kind(self) -> str:
        """The kind of machine: "gpu", "emulated" or "simulated"."""
        return self.cluster.kind

    @property
    def label(self) -> str:
        """Written next to every number measured here ("emulated", "simulated H100-SXM5-80GB", ...)."""
        return self.cluster.label

    @property
    def nodes(self) -> int:
        return self.cluster.nodes

    def describe(self) -> str:
        return self.cluster.describe()

    @property
    def gpu_name(self) -> str:
        """The GPU the numbers stand for: the card's name, the described GPU, or "emulated GPU"."""
        if self.cluster.gpus:
            return self.cluster.gpus[0].name
        return self.cluster.gpu_name or "emulated GPU"

    @property
    def runs_cuda_kernels(self) -> bool:
        """Do its ranks launch CUDA kernels, which Nsight Systems (`nsys`) and torch.profiler's CUDA activity
        trace? Real GPUs only: not CI's fake CUDA machine (its tensors stay on the CPU), nor the emulated
        cluster or a simulated machine."""
        return self.cluster.kind == "gpu" and not self.cluster.is_fake_cuda

    def fp32_peak(self) -> tuple[float | None, str]:
        """The fp32 matmul rate a rank's device peaks at, in FLOP/s (MFU's denominator), and what it is: this
        CPU's calibrated rate on one core where the ranks compute on this CPU (the emulated cluster, CI's fake
        CUDA machine), else the GPU's fp32 datasheet peak (`labkit.op_time.FP32_PEAK_TFLOPS`; a simulated
        machine's described GPU). (None, "") for a GPU whose peak is not known."""
        if self.cluster.kind == "emulated" or self.cluster.is_fake_cuda:
            gflops = self.cluster.cpu_gflops or calibrate.cpu_gflops().gflops
            return gflops * 1e9, f"this CPU's calibrated fp32 matmul rate, {gflops:.1f} GFLOP/s per core"
        name = self.gpu_name
        tflops = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in name.upper()), None)
        if tflops is None:
            return None, ""
        return tflops * 1e12, f"{name}'s fp32 datasheet peak, {tflops:.0f} TFLOP/s"

    # ------------------------------------------------------------------ values

    @property
    def computes_values(self) -> bool:
        """Does it compute values (losses, gradients)? Not a simulated machine: its tensors hold no data."""
        return not self.cluster.is_simulated

    def for_values(self) -> Machine:
        """Where this lab's numerics are checked: here, or the emulated cluster at the same ranks and nodes
        when this machine computes no values."""
        if self.computes_values:
            return self
        emulated = Cluster.emulated(nodes=self.cluster.nodes, gpus_per_node=self.cluster.gpus_per_node)
        return Machine(replace(emulated, reason="the numerics of a simulated machine"), self.ranks)

    def values_note(self) -> str:
        """One line on where values are checked, or "" where they are computed here."""
        if self.computes_values:
            return ""
        return "the exercises' checks run on the emulated cluster: a simulated machine computes no values"

    # ------------------------------------------------------------------ time

    @property
    def times_noisy(self) -> bool:
        """Do repeated steps take different times (measured), or the same modelled time (simulated)?"""
        return not self.cluster.is_simulated

    @property
    def times_host_python(self) -> bool:
        """Does a rank's time count Python work on its host beside the operators (a tokenizer in the training
        loop)? Not on a simulated machine: its clock advances by each operator's modelled kernel time and
        dispatch, and its tensors hold no tokens to work on."""
        return not self.cluster.is_simulated

    @property
    def judged_by_verdict(self) -> bool:
        """Is a lesson judged by the course's targets (`labkit.course.forecast.verdict`: real or fake GPUs, a
        simulated machine), rather than by the emulated cluster's exact checks?"""
        return self.cluster.kind in ("gpu", "simulated")

    @property
    def collectives_modelled(self) -> bool:
        """Does a collective take its links' α-β time here (`labkit.links`): the emulated cluster on its
        virtual clock, a simulated machine, CI's fake CUDA machine (its collectives run on the emulated
        backend)? Not real GPUs, whose NCCL reaches about 80 % of the line rate, or more with NVLS, nor the
        wall clock."""
        if self.cluster.kind == "gpu":
            return self.cluster.is_fake_cuda
        return self.cluster.is_emulated and self.cluster.clock in ("virtual", "simulated")

    @property
    def gpu_sized(self) -> bool:
        """Do labs take their GPU sizes here (`LabParams.GPU_SIZES`)?"""
        return self.cluster.gpu_sized

    def spare_gpu(self) -> Machine | None:
        """A GPU of this host that the lab's ranks leave idle, as a one-rank machine to measure on: where they
        run on the emulated cluster although the host has a GPU (fewer GPUs than ranks). None where the ranks
        are on GPUs (real, fake or simulated) or the host has none."""
        if self.cluster.kind != "emulated":
            return None
        one = Machine.resolve("auto", 1)
        return one if one.cluster.kind == "gpu" else None

    # ------------------------------------------------------------------ memory

    def limited(self, memory_mib: float) -> Cluster:
        """The cluster with `memory_mib` per rank: the emulated budget, the simulated card's limit, or a cap
        on a GPU's reserved memory above its warm baseline."""
        return replace(self.cluster, memory_gib=memory_mib / 1024)

    def counting(self) -> Cluster:
        """The cluster where a step's memory is read without running out: a budget (or a simulated card) too
        large to hit, which only counts; on a GPU the whole card."""
        return replace(self.cluster, memory_gib=1024 if self.cluster.is_emulated else None)

    @property
    def caps_reserved(self) -> bool:
        """Does a memory cap limit the allocator's reserved segments (a GPU's), not live tensor bytes?"""
        return self.cluster.kind == "gpu"

    @property
    def memory_is_tensor_bytes(self) -> bool:
        """Is a step's measured memory exactly its tensors' bytes (the emulated budget, a simulated card's
        count), so that a prediction from tensor sizes must match it? Not on a GPU (CI's fake one too), where
        CUDA's caching allocator rounds every block and, on a real card, libraries hold workspaces."""
        return self.cluster.kind != "gpu"

    @property
    def allocator_headroom_bytes(self) -> int:
        """Room a step keeps under a cap for the caching allocator's segments: one large segment
        (`LARGE_SEGMENT_BYTES`) on a GPU, and on a simulated one, which counts tensor bytes but stands for a
        card (so that its choices are the card's); none on the emulated cluster, whose budget is the
        lesson."""
        return LARGE_SEGMENT_BYTES if self.cluster.kind in ("gpu", "simulated") else 0

    @property
    def optimizer_foreach(self) -> bool:
        """Do its optimizers take torch's for-each implementation (the default for CUDA tensors, which a
        simulated GPU takes too: `labkit.machine.runtime.optimizer_options`)?"""
        return self.cluster.kind in ("gpu", "simulated")

    @property
    def torch_ddp(self) -> bool:
        """Does torch's DistributedDataParallel run here? Its C++ reducer reads storage, which a simulated
        machine's tensors lack: labkit's `OverlappedDDP` stands in there."""
        return not self.cluster.is_simulated

    @property
    def ddp_name(self) -> str:
        return "torch DDP" if self.torch_ddp else "labkit's OverlappedDDP (torch DDP needs storage)"

    def grad_sync_extra_bytes(self, grad_bytes: int) -> int:
        """What a training job's gradient sync ("ddp") holds beside `grad_bytes` of gradients all step: none
        under torch DDP (`gradient_as_bucket_view=True`: the gradients are views of its buckets), one more
        copy under labkit's `OverlappedDDP`, whose flat buckets are their own tensors."""
        return 0 if self.torch_ddp else grad_bytes

    # ------------------------------------------------------------------ records

    def records(self) -> dict[str, Any]:
        """What every lab records about where it ran."""
        return {"emulated": self.cluster.is_emulated, "machine": self.kind, "where": self.label}
