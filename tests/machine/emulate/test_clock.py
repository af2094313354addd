"""labkit.machine.emulate.clock: `VirtualClock`, an emulated rank's device time: its main thread's CPU time
plus the waits it jumps over, never backwards; the device timeline it keeps; one clock per rank process.

Every number here is CPU time or virtual time (a model output), not wall time: sleeping costs nothing."""

from __future__ import annotations

import time

import pytest

from labkit.machine.emulate.clock import VirtualClock, rank_clock


def busy(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time (known compute)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_clock_counts_cpu_time_not_sleep_and_jumps_forward_only():
    clock = VirtualClock()
    t0 = clock.now()
    time.sleep(0.05)  # waiting in wall time is not compute
    assert clock.now() - t0 < 0.01
    busy(0.02)
    assert 0.02 <= clock.now() - t0 < 0.03
    waited = clock.waited()
    assert clock.advance_to(t0 + 1.0) == pytest.approx(t0 + 1.0)
    assert clock.waited() - waited == pytest.approx(1.0 - 0.02, abs=0.01)  # the jump is waiting, not compute
    assert clock.advance_to(t0) >= t0 + 1.0  # never backwards
    with clock.paused():
        busy(0.02)
    assert clock.now() - t0 == pytest.approx(1.0, abs=0.005)


def test_the_clock_logs_its_waits_collectives_and_phases():
    clock = VirtualClock()
    start = clock.now()
    assert clock.advance_to(start + 0.5) == pytest.approx(start + 0.5)
    ((a, b),) = clock.waits
    assert a == pytest.approx(start, abs=0.005) and b == pytest.approx(start + 0.5)
    clock.advance_to(start)  # already past it: no wait logged
    assert len(clock.waits) == 1
    clock.log_collective("all_reduce #1", 0.1, 0.2, 64)
    clock.log_phase("data", 0.0, 0.05)
    assert list(clock.collectives) == [("all_reduce #1", 0.1, 0.2, 64)]
    assert list(clock.phases) == [("data", 0.0, 0.05)]


def test_a_kernel_occupying_the_stream_delays_the_work_queued_behind_it():
    clock = VirtualClock()
    assert clock.device_ready() == pytest.approx(clock.now(), abs=1e-3)  # nothing queued: work starts now
    t0 = clock.now()
    clock.occupy(0.5)
    assert clock.device_ready() == pytest.approx(t0 + 0.5, abs=1e-3)  # behind the spin
    clock.advance_to(t0 + 1.0)
    assert clock.device_ready() == pytest.approx(clock.now(), abs=1e-3)  # the spin has ended


def test_one_clock_per_rank_process():
    assert rank_clock() is rank_clock()
