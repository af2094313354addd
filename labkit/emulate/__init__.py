"""The emulated cluster: what stands in for GPUs when there are none.

* `process_group.py`: `EmulatedProcessGroup`, gloo with every collective held to the α-β
  link model of `labkit.links`, registered as the backend "labkit_emulated";
* `record.py`: each rank's record of its collectives, and the diagnosis of a hang;
* `budget.py`: `MemoryBudget`, a per-rank memory limit that raises a CUDA-like OOM.

`labkit.runtime` sets these up on each rank; `labkit.launch` reads the records.
"""

from labkit.emulate.budget import MemoryBudget, active_budget
from labkit.emulate.process_group import (
    BACKEND_NAME,
    RECORD_DIR_ENV,
    TOPOLOGY_ENV,
    EmulatedProcessGroup,
    close_groups,
    register_backend,
    topology_from_env,
    topology_to_env,
)
from labkit.emulate.record import CollectiveRecord, diagnose_hang, read_records

__all__ = [
    "BACKEND_NAME",
    "RECORD_DIR_ENV",
    "TOPOLOGY_ENV",
    "CollectiveRecord",
    "EmulatedProcessGroup",
    "MemoryBudget",
    "active_budget",
    "close_groups",
    "diagnose_hang",
    "read_records",
    "register_backend",
    "topology_from_env",
    "topology_to_env",
]
