"""labkit.trace.device: the emulated device timeline in virtual time, written next to the host trace and read
like a trace (compute is the step less its waits), and `read_timeline`, which picks a rank's device
timeline."""

from __future__ import annotations

import json

import pytest

from labkit.machine.emulate.clock import VirtualClock
from labkit.trace import overlap, read_timeline, read_trace
from labkit.trace.device import device_trace_path, write_device_trace


def test_device_timeline_reads_like_a_trace(tmp_path):
    """The emulated device timeline (virtual time): compute is the step minus its waits."""
    clock = VirtualClock()
    clock.waits.extend([(0.080, 0.100)])  # waited 20 ms for the last bucket
    clock.collectives.extend([("all_reduce #1", 0.040, 0.060, 64), ("all_reduce #2", 0.075, 0.100, 64)])
    path = write_device_trace(device_trace_path(tmp_path / "x_rank0.json"), clock, [(3, 0.0, 0.110)])
    assert path.name == "x_rank0.device.json"
    stats = overlap(read_trace(path))
    assert stats["step_ms"] == pytest.approx(110)
    assert stats["compute_ms"] == pytest.approx(90)  # 110 ms minus the 20 ms wait
    assert stats["comm_ms"] == pytest.approx(45)
    assert stats["overlapped_ms"] == pytest.approx(25)  # 40-60 fully, 75-80 of the second


def test_read_timeline_picks_the_device_timeline_next_to_a_host_trace(tmp_path):
    clock = VirtualClock()
    clock.collectives.append(("all_reduce #1", 0.010, 0.020, 64))
    host = tmp_path / "trace_rank1.json"
    host.write_text(json.dumps({"traceEvents": [], "distributedInfo": {"rank": 1}}))
    assert device_trace_path(host) == tmp_path / "trace_rank1.device.json"
    # without a device timeline (a GPU run, or the wall clock) the host trace is the timeline
    assert read_timeline(host).rank == 1
    write_device_trace(device_trace_path(host), clock, [(0, 0.0, 0.030)], 1)
    timeline = read_timeline(host)
    assert overlap(timeline)["comm_ms"] == pytest.approx(10) and overlap(timeline)[
        "step_ms"
    ] == pytest.approx(30)
