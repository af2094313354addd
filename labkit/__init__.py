"""labkit: helpers for the Multi-GPU Mistakes Lab notebooks.

The public names most notebooks need are importable from here; each lives in the module
named after its idea (see DESIGN.md's code map).
"""

from labkit.cluster import GPU, Cluster
from labkit.comm import OverlappedDDP, allreduce_gradients_naive, bandwidth_test, bus_bandwidth_factor
from labkit.emulate import Link, MemoryBudget, max_memory_allocated, memory_allocated, reset_peak_memory_stats
from labkit.launch import RankError, current_cluster, device, launch
from labkit.memory import (
    BatchSearch,
    MemoryBreakdown,
    estimate,
    estimate_fake,
    find_max_batch,
    korthikanti_activation_bytes,
    measure,
)
from labkit.models import GPT, GPTConfig, synthetic_batch
from labkit.records import read_records, record
from labkit.trace import CommLog, capture, overlap, plot_timeline, read_trace

__version__ = "0.1.0"

__all__ = [
    "BatchSearch",
    "CommLog",
    "GPT",
    "GPTConfig",
    "GPU",
    "MemoryBreakdown",
    "estimate",
    "estimate_fake",
    "find_max_batch",
    "korthikanti_activation_bytes",
    "measure",
    "synthetic_batch",
    "OverlappedDDP",
    "allreduce_gradients_naive",
    "bandwidth_test",
    "bus_bandwidth_factor",
    "capture",
    "overlap",
    "plot_timeline",
    "read_trace",
    "Cluster",
    "Link",
    "MemoryBudget",
    "RankError",
    "current_cluster",
    "device",
    "launch",
    "max_memory_allocated",
    "memory_allocated",
    "read_records",
    "record",
    "reset_peak_memory_stats",
]
