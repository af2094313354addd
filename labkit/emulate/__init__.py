"""The emulated cluster: what stands in for GPUs when there are none.

* `process_group.py`: `EmulatedProcessGroup`, gloo with every collective held to the α-β
  link model of `labkit.links`, registered as the backend "labkit_emulated";
* `record.py`: each rank's record of its collectives, and the diagnosis of a hang;
* `clock.py`: `VirtualClock`, the time a rank's emulated GPU would show (main-thread CPU
  time plus time spent waiting), one per rank process;
* `timing.py`: when a collective completes, on the virtual clock (default) or the wall clock;
* `budget.py`: `MemoryBudget`, a per-rank memory limit that raises a CUDA-like OOM.

`labkit.rank_setup` sets these up on each rank; `labkit.launch` reads the records.
"""

from labkit.emulate.allocator import CachingAllocator
from labkit.emulate.budget import MemoryBudget, active_budget
from labkit.emulate.clock import VirtualClock, rank_clock
from labkit.emulate.process_group import (
    BACKEND_NAME,
    CLOCK_ENV,
    RECORD_DIR_ENV,
    TOPOLOGY_ENV,
    EmulatedProcessGroup,
    close_groups,
    register_backend,
    topology_from_env,
    topology_to_env,
    wait_at_end_of_backward,
)
from labkit.emulate.record import CollectiveRecord, diagnose_hang, read_collective_records

__all__ = [
    "BACKEND_NAME",
    "CLOCK_ENV",
    "RECORD_DIR_ENV",
    "TOPOLOGY_ENV",
    "CachingAllocator",
    "CollectiveRecord",
    "EmulatedProcessGroup",
    "MemoryBudget",
    "VirtualClock",
    "active_budget",
    "close_groups",
    "diagnose_hang",
    "rank_clock",
    "read_collective_records",
    "register_backend",
    "topology_from_env",
    "topology_to_env",
    "wait_at_end_of_backward",
]
