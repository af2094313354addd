"""Traces: capture a few steps with torch.profiler, read them into lanes, measure overlap, draw them.

* `commlog.py`: `CommLog`, each collective from issue to completion (the profiler cannot
  show an asynchronous collective's completion);
* `capture.py`: `capture`, a bounded profiler run per rank with the `CommLog` merged in;
* `device.py`: the emulated device timeline in virtual time, written next to the host trace, and
  `read_timeline`, a rank's device timeline (that one, or a GPU trace's kernels);
* `timeline.py`: `read_trace`, lanes (compute, comm, memory, idle) per step, each GPU event in the step that
  launched it, `overlap`;
* `temporal.py`: `temporal_breakdown`, a rank's GPU time over its steps as Holistic Trace Analysis measures
  it (idle, compute, communication, memory, overlap);
* `plots.py`: `plot_timeline`, and `plot_pipeline` (a pipeline step as a Gantt chart);
* `phases.py`: `phase`, a named region in the host trace, NVTX and the device timeline;
* `analyze.py`: `analyze`, where each rank's step went (compute, comm, waiting, data, host syncs), and
  `read_timelines`, every rank's device timeline of one run;
* `diagnose.py`: `diagnose`, the likely bottleneck of a run with its evidence (`findings`: every rule that
  fires).
"""

from labkit.trace.analyze import RankBreakdown, analyze, read_timelines
from labkit.trace.capture import capture
from labkit.trace.commlog import CommLog, CommSpan
from labkit.trace.device import read_timeline
from labkit.trace.diagnose import Diagnosis, diagnose, findings
from labkit.trace.phases import phase
from labkit.trace.plots import mark_diagnosis, plot_pipeline, plot_timeline, typical_step
from labkit.trace.temporal import TemporalBreakdown, temporal_breakdown
from labkit.trace.timeline import Step, Trace, TraceEvent, classify, overlap, read_trace, step_lanes

__all__ = [
    "CommLog",
    "CommSpan",
    "Diagnosis",
    "RankBreakdown",
    "Step",
    "TemporalBreakdown",
    "Trace",
    "TraceEvent",
    "analyze",
    "capture",
    "classify",
    "diagnose",
    "findings",
    "mark_diagnosis",
    "overlap",
    "phase",
    "plot_pipeline",
    "plot_timeline",
    "read_timeline",
    "read_timelines",
    "read_trace",
    "step_lanes",
    "temporal_breakdown",
    "typical_step",
]
