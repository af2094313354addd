"""The emulated device timeline: what each emulated GPU did, in virtual time, as a Chrome trace.

On a GPU the kernel timeline shows when the device computed and when NCCL kernels ran. On
the emulated cluster's virtual clock (`labkit.machine.emulate.clock`) its counterpart is built from
what the clock records: a rank computes except while it waits (each wait is a forward jump
of its clock), and every collective runs from its issue to its modelled completion.
`capture` writes one such file per rank next to the torch.profiler host trace
(`trace_rank0.json` -> `trace_rank0.device.json`), with a `ProfilerStep#N` window per
profiled step, so `read_trace`, `overlap` and `plot_timeline` (`timeline.py`, `plots.py`)
read it as they read a host trace. It opens in Perfetto or chrome://tracing.

Compute segments are named "compute": which operator ran when is in the host trace. Named phases
(`phases.py`: data loading, logging, ...) are in a lane of their own, "emulated GPU: phases".
"""

from __future__ import annotations

from pathlib import Path

from labkit.machine.timer import VirtualClock
from labkit.trace.commlog import COMM_CATEGORY
from labkit.trace.phases import PHASE_CATEGORY, PHASE_PREFIX
from labkit.trace.timeline import Trace, dump_json, read_trace, subtract, union

__all__ = [
    "DEVICE_COMM",
    "DEVICE_COMPUTE",
    "DEVICE_PHASES",
    "device_trace_path",
    "read_timeline",
    "write_device_trace",
]

DEVICE_COMPUTE = "emulated GPU: compute"
DEVICE_COMM = "emulated GPU: communication"
DEVICE_PHASES = "emulated GPU: phases"


def device_trace_path(host_trace: str | Path) -> Path:
    """Where `capture` writes the device timeline that goes with a host trace."""
    p = Path(host_trace)
    if p.name.endswith(".json.gz"):
        return p.with_name(p.name[: -len(".json.gz")] + ".device.json.gz")
    return p.with_name(p.stem + ".device" + (p.suffix or ".json"))


def read_timeline(host_trace: str | Path, rank: int | None = None) -> Trace:
    """The device's timeline of one rank's profiled steps: the emulated device timeline written beside the
    host trace when there is one (virtual time), else the host trace itself (on a GPU its kernels are the
    device's lanes). This is what a timeline picture of the rank should draw."""
    device = device_trace_path(host_trace)
    return read_trace(device if device.exists() else host_trace, rank=rank)


def write_device_trace(
    path: str | Path, clock: VirtualClock, steps: list[tuple[int, float, float]], rank: int = 0
) -> Path:
    """Write the steps `[(number, start, end), ...]` (virtual seconds) of `clock`'s timeline."""
    path = Path(path)
    us = 1e6
    events: list[dict] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": rank,
            "args": {"name": f"rank {rank} (emulated GPU, virtual time)"},
        },
        {
            "ph": "M",
            "name": "thread_name",
            "pid": rank,
            "tid": DEVICE_COMPUTE,
            "args": {"name": DEVICE_COMPUTE},
        },
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": DEVICE_COMM, "args": {"name": DEVICE_COMM}},
        {
            "ph": "M",
            "name": "thread_name",
            "pid": rank,
            "tid": DEVICE_PHASES,
            "args": {"name": DEVICE_PHASES},
        },
    ]
    waits = list(clock.waits)
    collectives = list(clock.collectives)
    phases = list(clock.phases)
    for number, lo, hi in steps:
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{number}",
                "pid": rank,
                "tid": DEVICE_COMPUTE,
                "ts": lo * us,
                "dur": (hi - lo) * us,
            }
        )
        for a, b in subtract([(lo, hi)], union(waits)):
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": "compute",
                    "pid": rank,
                    "tid": DEVICE_COMPUTE,
                    "ts": a * us,
                    "dur": (b - a) * us,
                }
            )
        for name, issued, done, nbytes in collectives:
            if lo <= issued < hi:  # a collective belongs to the step that issued it
                events.append(
                    {
                        "ph": "X",
                        "cat": COMM_CATEGORY,
                        "name": f"comm:{name}",
                        "pid": rank,
                        "tid": DEVICE_COMM,
                        "ts": issued * us,
                        "dur": (done - issued) * us,
                        "args": {"bytes": nbytes},
                    }
                )
        for name, a, b in phases:
            if lo <= a < hi:
                events.append(
                    {
                        "ph": "X",
                        "cat": PHASE_CATEGORY,
                        "name": PHASE_PREFIX + name,
                        "pid": rank,
                        "tid": DEVICE_PHASES,
                        "ts": a * us,
                        "dur": (b - a) * us,
                    }
                )
    path.parent.mkdir(parents=True, exist_ok=True)
    dump_json(path, {"traceEvents": events, "distributedInfo": {"rank": rank}, "displayTimeUnit": "ms"})
    return path
