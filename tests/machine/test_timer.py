"""labkit.machine.timer: `clock()`, `Mark` and `Span` on each kind of rank, and `waited()`.

* off the virtual clock and without CUDA (a plain process, a CPU torchrun rank): `time.perf_counter`
  readings, here a fake counter so that every number is exact;
* on the emulated cluster's virtual clock (the rank's environment names it): the rank's `VirtualClock`,
  whose waits `waited()` reports;
* on a GPU (CUDA mocked: fake events): a mark is an event recorded on the current stream (the first one too,
  before CUDA is initialised, so that every pair compares), nothing waits for the device until a time is
  read, and `clock()` synchronizes first.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from labkit import Cluster
from labkit.links import Link
from labkit.machine import emulate, runtime, timer
from labkit.machine.timer import Mark, Span


@pytest.fixture
def fake_counter(monkeypatch) -> list[float]:
    """time.perf_counter as the timer reads it: 10.0, 10.25, 10.5, ... (each reading a quarter second on)."""
    readings: list[float] = []
    ticks = itertools.count()

    def perf_counter() -> float:
        readings.append(10.0 + 0.25 * next(ticks))
        return readings[-1]

    monkeypatch.setattr(timer.time, "perf_counter", perf_counter)
    return readings


@pytest.fixture
def cpu_process(monkeypatch) -> None:
    """A plain process without CUDA, outside labkit.launch (no cluster in its environment)."""
    monkeypatch.delenv(runtime.CLUSTER_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_off_the_virtual_clock_marks_and_spans_read_the_wall_clock(cpu_process, fake_counter):
    assert not runtime.on_virtual_clock() and not runtime.on_gpu()
    assert timer.clock() == 10.0 and timer.clock() == 10.25
    start = Mark()  # 10.5
    later = Mark()  # 10.75
    assert later.ms_since(start) == 250.0 and start.ms_since(later) == -250.0
    with Span() as span:  # 11.0 .. 11.25
        pass
    assert span.ms == 250.0 and span.start is not None and span.end is not None
    assert timer.waited() is None  # waiting is not told apart from computing here


def test_a_span_is_read_after_it_ends(cpu_process, fake_counter):
    span = Span()
    with pytest.raises(RuntimeError, match=r"Span.ms is read after the span: with Span\(\) as span"):
        _ = span.ms
    with span:
        with pytest.raises(RuntimeError, match="read after the span"):
            _ = span.ms
    assert span.ms == 250.0


@pytest.fixture
def virtual_rank(monkeypatch) -> emulate.VirtualClock:
    """This process as a rank of the emulated cluster on its virtual clock (as labkit.launch sets it up)."""
    link = Link(1.0, 10.0)
    cluster = Cluster.emulated(gpus_per_node=2, intra_node=link, inter_node=link)
    monkeypatch.setenv(runtime.CLUSTER_ENV, cluster.to_json())
    return emulate.rank_clock()


def test_on_the_virtual_clock_a_span_counts_compute_and_waits_in_virtual_time(virtual_rank):
    assert runtime.on_virtual_clock() and timer.clock() <= virtual_rank.now()
    w0 = timer.waited()
    with Span() as span:
        virtual_rank.advance_to(virtual_rank.now() + 0.5)  # waits half a second for a collective
    # the jump, less the µs of CPU time between reading the clock and advancing it
    assert timer.waited() - w0 == pytest.approx(0.5, abs=1e-3)
    # the wait, plus the CPU time the main thread spent between the readings (a few µs of Python)
    assert 500.0 <= span.ms < 505.0


def test_the_wall_clock_of_the_emulated_cluster_is_not_the_virtual_one(monkeypatch, fake_counter):
    link = Link(1.0, 10.0)
    wall = Cluster.emulated(gpus_per_node=2, intra_node=link, inter_node=link, clock="wall")
    monkeypatch.setenv(runtime.CLUSTER_ENV, wall.to_json())
    assert not runtime.on_virtual_clock() and timer.waited() is None
    assert timer.clock() == 10.0


class _Device:
    """A mocked CUDA device: events with fake timestamps, and a log of what waited for it."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.now_ms = 0.0

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing, "a timing event needs enable_timing=True"
                self.at: float | None = None

            def record(self) -> None:
                device.now_ms += 4.0  # the device is 4 ms further on at each record
                self.at = device.now_ms
                device.log.append(f"record {self.at:g}")

            def synchronize(self) -> None:
                device.log.append(f"wait for {self.at:g}")

            def elapsed_time(self, end: Event) -> float:
                assert self.at is not None and end.at is not None, "both events recorded"
                return end.at - self.at

        return Event


@pytest.fixture
def gpu_rank(monkeypatch) -> _Device:
    device = _Device()
    monkeypatch.delenv(runtime.CLUSTER_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: device.log.append("device synchronize"))
    return device


def test_on_a_gpu_marks_are_cuda_events_and_nothing_waits_until_a_time_is_read(gpu_rank):
    assert runtime.on_gpu()
    with Span() as span:
        pass
    assert gpu_rank.log == ["record 4", "record 8"]  # recorded on the stream; no synchronisation
    assert span.ms == 4.0  # the end event waited for, then start.elapsed_time(end)
    assert gpu_rank.log == ["record 4", "record 8", "wait for 8"]
    later = Mark()
    assert later.ms_since(span.start) == 8.0


def test_on_a_gpu_clock_synchronizes_the_device_first(gpu_rank, fake_counter):
    assert timer.clock() == 10.0 and gpu_rank.log == ["device synchronize"]
    assert timer.waited() is None


def test_a_mark_before_cuda_is_initialised_and_one_after_are_both_events(gpu_rank, monkeypatch, fake_counter):
    # The first mark of a GPU rank may come before anything touched CUDA: it records an event all the same
    # (recording initialises CUDA), so that it compares with the marks after. It once read the clock there,
    # and the pair subtracted that host reading (10.0 s) from the later event mark's 0.0: -10,000 ms.
    initialised = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(initialised))
    first = Mark()  # CUDA not initialised yet
    initialised.append(True)  # the rank's first kernel initialises it
    later = Mark()
    assert later.ms_since(first) == 4.0
    assert gpu_rank.log == ["record 4", "record 8", "wait for 8"] and fake_counter == []  # no clock read


def test_marks_of_two_kinds_are_refused_not_subtracted(gpu_rank, monkeypatch, fake_counter):
    on_gpu = Mark()  # an event
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    off_gpu = Mark()  # a clock reading (10.0)
    with pytest.raises(ValueError, match="one mark is a CUDA event and the other a clock reading"):
        off_gpu.ms_since(on_gpu)
    with pytest.raises(ValueError, match="cannot be compared"):
        on_gpu.ms_since(off_gpu)
