"""labkit: helpers for the Multi-GPU Mistakes Lab notebooks.

The names notebooks and users call most are importable from here; each lives in the module
named after its idea (docs/architecture.md has the map):

* the cluster and its ranks: `Cluster`, `Link` (`labkit.cluster`, `labkit.links`), `launch`,
  `RankError` (`labkit.launch`), and inside a rank `device`, `clock`, `current_cluster` and
  the memory stats (`labkit.runtime`);
* memory: `estimate` and friends (`labkit.memory`), `measure`, `estimate_fake`,
  `find_max_batch` (`labkit.measure`), `MemoryBudget` (`labkit.emulate`);
* communication: `OverlappedDDP`, `allreduce_gradients_naive` (`labkit.parallel.data`),
  `bandwidth_test` (`labkit.bandwidth`), `bus_bandwidth_factor` (`labkit.links`);
* traces: `capture`, `read_trace`, `overlap`, `plot_timeline`, `CommLog` (`labkit.trace`);
* the course: `record`, `read_records` (`labkit.course.records`).
"""

from labkit.bandwidth import bandwidth_test
from labkit.cluster import GPU, Cluster
from labkit.course.records import read_records, record
from labkit.emulate import MemoryBudget
from labkit.launch import RankError, launch
from labkit.links import Link, bus_bandwidth_factor
from labkit.measure import BatchSearch, estimate_fake, find_max_batch, measure
from labkit.memory import MemoryBreakdown, estimate, korthikanti_activation_bytes
from labkit.models import GPT, GPTConfig, synthetic_batch
from labkit.parallel.data import OverlappedDDP, allreduce_gradients_naive
from labkit.runtime import (
    clock,
    current_cluster,
    device,
    max_memory_allocated,
    memory_allocated,
    reset_peak_memory_stats,
)
from labkit.trace import CommLog, capture, overlap, plot_timeline, read_trace

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "GPU",
    "BatchSearch",
    "Cluster",
    "CommLog",
    "GPTConfig",
    "Link",
    "MemoryBreakdown",
    "MemoryBudget",
    "OverlappedDDP",
    "RankError",
    "allreduce_gradients_naive",
    "bandwidth_test",
    "bus_bandwidth_factor",
    "capture",
    "clock",
    "current_cluster",
    "device",
    "estimate",
    "estimate_fake",
    "find_max_batch",
    "korthikanti_activation_bytes",
    "launch",
    "max_memory_allocated",
    "measure",
    "memory_allocated",
    "overlap",
    "plot_timeline",
    "read_records",
    "read_trace",
    "record",
    "reset_peak_memory_stats",
    "synthetic_batch",
]
