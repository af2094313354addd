"""labkit: helpers for the Multi-GPU Mistakes Lab notebooks.

The names notebooks and users call most are importable from here; each lives in the module named after its
idea (docs/architecture.md has the map and the whole public surface):

* the cluster and its ranks: `Cluster`, `GPU` (`labkit.cluster`), `Link` (`labkit.links`), `launch`
  (`labkit.machine.launcher`), `RankError` (`labkit.errors`); inside a rank `device`, `current_cluster`
  (`labkit.machine.runtime`), `clock` (`labkit.machine.timer`) and the memory stats
  (`labkit.machine.device_memory`);
* the model: `GPT`, `GPTConfig`, `seeded_model`, `synthetic_batch` (`labkit.models`);
* memory: `estimate`, `MemoryBreakdown` (`labkit.memory`), `korthikanti_activation_bytes`
  (`labkit.activations`), `measure`, `estimate_fake`, `find_max_batch` (`labkit.measured_memory`),
  `MemoryBudget` (`labkit.machine.emulate`);
* parallelism: `Layout` (`labkit.layout`), `plan` (`labkit.planner`), `OverlappedDDP`,
  `allreduce_gradients_naive` (`labkit.parallel.data`), `bandwidth_test` (`labkit.bandwidth`),
  `bus_bandwidth_factor` (`labkit.links`);
* the training job: `TrainingJob`, `MISTAKES` (`labkit.course.training`);
* traces: `capture`, `read_trace`, `overlap`, `plot_timeline`, `CommLog` (`labkit.trace`);
* the course: `record`, `read_records` (`labkit.course.records`), `save_figure` (`labkit.course.figures`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# CI's fake CUDA machine (labkit.machine.emulate.fake_cuda): installed in every process that imports labkit (a
# notebook's kernel, the launcher's fork server and its ranks) while $LABKIT_FAKE_CUDA names a GPU count.
if os.environ.get("LABKIT_FAKE_CUDA", "0") not in ("", "0"):
    importlib.import_module("labkit.machine.emulate.fake_cuda").install()

# Each public name and the module it lives in. They are imported on first use (PEP 562), so
# `labkit --help` and `import labkit` do not pay for importing torch until a name needs it.
_HOME = {
    "bandwidth_test": "labkit.bandwidth",
    "GPU": "labkit.cluster",
    "Cluster": "labkit.cluster",
    "read_records": "labkit.course.records",
    "record": "labkit.course.records",
    "save_figure": "labkit.course.figures",
    "MemoryBudget": "labkit.machine.emulate",
    "RankError": "labkit.errors",
    "MISTAKES": "labkit.course.training",
    "TrainingJob": "labkit.course.training",
    "launch": "labkit.machine.launcher",
    "Link": "labkit.links",
    "Machine": "labkit.machine.machine",
    "bus_bandwidth_factor": "labkit.links",
    "BatchSearch": "labkit.measured_memory",
    "estimate_fake": "labkit.measured_memory",
    "find_max_batch": "labkit.measured_memory",
    "measure": "labkit.measured_memory",
    "MemoryBreakdown": "labkit.memory",
    "estimate": "labkit.memory",
    "korthikanti_activation_bytes": "labkit.activations",
    "GPT": "labkit.models",
    "GPTConfig": "labkit.models",
    "seeded_model": "labkit.models",
    "synthetic_batch": "labkit.models",
    "Layout": "labkit.layout",
    "OverlappedDDP": "labkit.parallel.data",
    "allreduce_gradients_naive": "labkit.parallel.data",
    "plan": "labkit.planner",
    "clock": "labkit.machine.timer",
    "current_cluster": "labkit.machine.runtime",
    "device": "labkit.machine.runtime",
    "max_memory_allocated": "labkit.machine.device_memory",
    "memory_allocated": "labkit.machine.device_memory",
    "reset_peak_memory_stats": "labkit.machine.device_memory",
    "CommLog": "labkit.trace",
    "capture": "labkit.trace",
    "overlap": "labkit.trace",
    "plot_timeline": "labkit.trace",
    "read_trace": "labkit.trace",
}


def __getattr__(name: str) -> Any:
    """A public name (imported from its module), or a submodule (`labkit.memory`, ...)."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'labkit' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = [
    "GPT",
    "GPU",
    "MISTAKES",
    "BatchSearch",
    "Cluster",
    "CommLog",
    "GPTConfig",
    "Layout",
    "Link",
    "Machine",
    "MemoryBreakdown",
    "MemoryBudget",
    "OverlappedDDP",
    "RankError",
    "TrainingJob",
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
    "plan",
    "plot_timeline",
    "read_records",
    "read_trace",
    "record",
    "reset_peak_memory_stats",
    "save_figure",
    "seeded_model",
    "synthetic_batch",
]
