"""This rank's timer: `clock()` readings, and `Span` for the time of one span of its work.

Every duration the course reports is taken here. What the timer reads depends on where the rank runs
(`labkit.machine.runtime`):

* on the emulated cluster (clock="virtual"), the rank's virtual device clock
  (`labkit.machine.emulate.clock`): its main thread's CPU time plus the modelled waits for collectives, the
  same on a busy machine;
* on a GPU, the wall clock after the device has finished its queued work (kernels run asynchronously);
* elsewhere (a torchrun rank on CPUs, a plain process, the emulated cluster with clock="wall") the wall clock.

`Mark` and `Span` time work without stopping the device inside it: on a GPU a mark is a CUDA event recorded on
the current stream, waited for only when a time is read (CUDA semantics notes in PyTorch: `torch.cuda.Event`
with `enable_timing=True`, `elapsed_time` in milliseconds); elsewhere it is a `clock()` reading.
"""

from __future__ import annotations

import time
from types import TracebackType

import torch

from labkit.machine import _torch_compat, emulate, runtime
from labkit.machine.emulate.clock import VirtualClock

__all__ = [
    "CollectivesSpan",
    "Mark",
    "Span",
    "VirtualClock",
    "clock",
    "occupy_device",
    "virtual_clock",
    "waited",
]


def clock() -> float:
    """Seconds on this rank's timer (see the module docstring); take differences of two readings."""
    runtime.synchronize()  # a GPU's (or a simulated GPU's) host waits for its queued work
    if runtime.on_virtual_clock():
        return emulate.rank_clock().now()
    return time.perf_counter()


def virtual_clock() -> VirtualClock | None:
    """This rank's virtual clock, whose timeline is the emulated (or simulated) device's; None on a GPU and
    elsewhere, where the device keeps its own timeline (the profiler's CUDA kernels)."""
    return emulate.rank_clock() if runtime.on_virtual_clock() else None


def waited() -> float | None:
    """Seconds this rank's virtual clock has spent waiting for collectives and transfers so far (None off the
    virtual clock: elsewhere waiting is not told apart from computing)."""
    return emulate.rank_clock().waited() if runtime.on_virtual_clock() else None


def occupy_device(seconds: float) -> None:
    """Keep this rank's device stream busy for `seconds`, so that work queued behind it starts when it ends: a
    spin kernel on a GPU, the same on the virtual clock's emulated device (`VirtualClock.occupy`); nothing
    elsewhere (a CPU has no stream to queue on)."""
    if runtime.on_virtual_clock():
        emulate.rank_clock().occupy(seconds)
    elif runtime.on_gpu():
        _torch_compat.cuda_spin(seconds)


class Mark:
    """A point on this rank's timer: a CUDA event recorded on the current stream on a GPU (nothing waits for
    the device to record it), a `clock()` reading elsewhere. `later.ms_since(earlier)` is the time between."""

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None
        self._t = 0.0
        # On a GPU rank every mark is an event, even before CUDA is initialised: recording it initialises CUDA
        # (the rank is about to compute there anyway, and the context's creation then falls before the mark,
        # outside the span). A mark that read the clock while CUDA was not yet initialised could not be
        # compared with a later event: one end a host reading, the other a point on the device's timeline
        # (ms_since subtracted the host reading from the event mark's unused 0.0). One kind of mark per rank
        # keeps every pair comparable.
        if runtime.on_gpu():
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        else:
            self._t = clock()

    def ms_since(self, earlier: Mark) -> float:
        """Milliseconds from `earlier` to this mark (on a GPU, once this mark's event has completed)."""
        if (self._event is None) != (earlier._event is None):
            # marks of two kinds of rank (a CUDA event and a host clock reading) have no common time line
            raise ValueError(
                "Mark.ms_since: one mark is a CUDA event and the other a clock reading, so they cannot be "
                "compared; take both marks on the same rank (both on the GPU, or both off it)"
            )
        if self._event is not None and earlier._event is not None:
            self._event.synchronize()
            return float(earlier._event.elapsed_time(self._event))
        return (self._t - earlier._t) * 1e3


class Span:
    """The time of one span of this rank's work, in ms: `with Span() as span: ...` then `span.ms`.

    Its ends are `Mark`s: CUDA events on a GPU, so nothing inside the span waits for the device (reading `ms`
    waits for the end event), `clock()` readings elsewhere.
    """

    def __init__(self) -> None:
        self.start: Mark | None = None
        self.end: Mark | None = None

    def __enter__(self) -> Span:
        self.start = Mark()
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.end = Mark()

    @property
    def ms(self) -> float:
        """The span's length in milliseconds."""
        if self.start is None or self.end is None:
            raise RuntimeError("Span.ms is read after the span: with Span() as span: ...; then span.ms")
        return self.end.ms_since(self.start)


class CollectivesSpan(Span):
    """A `Span` around collectives launched back to back, timed as the device runs them.

    On a GPU it is a `Span`: CUDA events on the current stream, which bracket the queued collectives on the
    device once the host has enqueued them all (`labkit.bandwidth` keeps the stream busy meanwhile). On the
    virtual clock its ends are the emulated device's: this rank's issue of the first collective completed
    inside it and the completion of the last, from the rank's device timeline. The host's Python before the
    first launch and after the last wait is the host's time, which the CUDA events do not see either; a host
    slower than the link still shows, as the gaps it leaves between collectives on the timeline.
    """

    def __init__(self) -> None:
        super().__init__()
        self._device: tuple[float, float] | None = None  # the device timeline's ends, on the virtual clock
        self._logged = 0

    def __enter__(self) -> CollectivesSpan:
        super().__enter__()
        if runtime.on_virtual_clock():
            self._logged = emulate.rank_clock().collectives_logged
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        super().__exit__(kind, error, trace)
        if not runtime.on_virtual_clock():
            return
        clock = emulate.rank_clock()
        new = clock.collectives_logged - self._logged  # those completed inside (each one waited for)
        if new > len(clock.collectives):
            raise RuntimeError(f"{new} collectives in one span: more than the device timeline keeps")
        if new:
            timeline = list(clock.collectives)[-new:]
            self._device = (timeline[0][1], timeline[-1][2])

    @property
    def ms(self) -> float:
        """The span's length in milliseconds (see the class docstring for its ends)."""
        if self._device is None:  # on a GPU or the wall clock, or no collective inside
            return super().ms
        first_issued, last_done = self._device
        return (last_done - first_issued) * 1e3
