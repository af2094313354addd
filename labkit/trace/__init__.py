"""Traces: capture a few steps with torch.profiler, read them into lanes, measure overlap, draw them.

* `commlog.py`: `CommLog`, each collective from issue to completion (the profiler cannot
  show an asynchronous collective's completion);
* `capture.py`: `capture`, a bounded profiler run per rank with the `CommLog` merged in;
* `device.py`: the emulated device timeline in virtual time, written next to the host trace;
* `timeline.py`: `read_trace`, lanes (compute, comm, idle) per step, `overlap`;
* `plots.py`: `plot_timeline`, and `plot_pipeline` (a pipeline step as a Gantt chart).
"""

from labkit.trace.capture import capture
from labkit.trace.commlog import CommLog, CommSpan
from labkit.trace.device import device_trace_path
from labkit.trace.plots import plot_pipeline, plot_timeline
from labkit.trace.timeline import Step, Trace, TraceEvent, classify, overlap, read_trace, step_lanes

__all__ = [
    "CommLog",
    "CommSpan",
    "Step",
    "Trace",
    "TraceEvent",
    "capture",
    "classify",
    "device_trace_path",
    "overlap",
    "plot_pipeline",
    "plot_timeline",
    "read_trace",
    "step_lanes",
]
