"""The emulated cluster: what stands in for GPUs when there are none.

* `process_group.py`: `EmulatedProcessGroup`, gloo with every collective held to the α-β
  link model of `labkit.links`, registered as the backend "labkit_emulated";
* `record.py`: each rank's record of its collectives, and the diagnosis of a hang;
* `clock.py`: `VirtualClock`, the time a rank's emulated GPU would show (main-thread CPU
  time plus time spent waiting), one per rank process;
* `timing.py`: when a collective completes, on the virtual clock (default) or the wall clock;
* `alike.py`: one process standing for ranks that run the same operators on a simulated machine;
* `budget.py`: `MemoryBudget`, a per-rank memory limit that raises a CUDA-like OOM;
* `simulated_device.py`: `SimulatedDevice`, a simulated machine's GPU: each operator on tensors
  without storage timed on the described GPU (`labkit.op_time`), memory held to the card's.

`labkit.machine.rank_setup` sets these up on each rank; `labkit.launch` reads the records.
"""

from labkit.machine.emulate.alike import ALIKE_ENV, NotAlikeError
from labkit.machine.emulate.allocator import CachingAllocator
from labkit.machine.emulate.budget import MemoryBudget, active_budget
from labkit.machine.emulate.clock import CLOCK_ENV, VirtualClock, rank_clock
from labkit.machine.emulate.process_group import (
    BACKEND_NAME,
    RECORD_DIR_ENV,
    TOPOLOGY_ENV,
    EmulatedProcessGroup,
    close_groups,
    register_backend,
    topology_from_env,
    topology_to_env,
    wait_at_end_of_backward,
)
from labkit.machine.emulate.record import CollectiveRecord, diagnose_hang, read_collective_records
from labkit.machine.emulate.simulated_device import OpTimes, SimulatedDevice, active_simulated_device

__all__ = [
    "ALIKE_ENV",
    "BACKEND_NAME",
    "CLOCK_ENV",
    "RECORD_DIR_ENV",
    "TOPOLOGY_ENV",
    "CachingAllocator",
    "CollectiveRecord",
    "EmulatedProcessGroup",
    "MemoryBudget",
    "NotAlikeError",
    "OpTimes",
    "SimulatedDevice",
    "VirtualClock",
    "active_budget",
    "active_simulated_device",
    "close_groups",
    "diagnose_hang",
    "rank_clock",
    "read_collective_records",
    "register_backend",
    "topology_from_env",
    "topology_to_env",
    "wait_at_end_of_backward",
]
