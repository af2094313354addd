"""labkit: helpers for the Multi-GPU Mistakes Lab notebooks.

The public names most notebooks need are importable from here; each lives in the module
named after its idea (see DESIGN.md's code map).
"""

from labkit.cluster import GPU, Cluster
from labkit.emulate import Link, MemoryBudget, max_memory_allocated, memory_allocated, reset_peak_memory_stats
from labkit.launch import RankError, current_cluster, device, launch
from labkit.records import read_records, record

__version__ = "0.1.0"

__all__ = [
    "GPU",
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
