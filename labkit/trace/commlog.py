"""`CommLog`: when each collective was issued and when it completed, for traces.

What the profiler shows for an *asynchronous* collective (measured, torch 2.13 CPU build,
gloo, 2 ranks, a 16 MB `dist.all_reduce(async_op=True)` overlapped with matmuls):

* the calling thread gets only `c10d::allreduce_`, about 60 us: the *issue*;
* the transfer is a `gloo:all_reduce` `user_annotation` on a `pt_gloo_runloop` thread with
  its real duration (96 ms, starting 3.7 ms after the issue), and gloo alternates between
  two such threads;
* `work.wait()` leaves no event at all;
* a `record_function` entered on the issuing thread and exited in the work's completion
  callback (another thread) is recorded with a wrong duration (199.9 ms for a collective
  that took 99.6 ms), so a profiler region cannot span issue to completion.

With plain gloo the `gloo:*` events are therefore enough. With the emulated interconnect
(`labkit.machine.emulate`) they are not: gloo finishes the real transfer, and the work completes
later, when the link model says so (that Python process group also leaves no
`c10d::allreduce_` event on the calling thread; the inner `gloo:all_reduce` events remain).
The convention, which works for both:

1. code that issues a collective logs it in a `CommLog`: `log.track(work, name, nbytes,
   start_ns=t0)` records the issue time now and the completion time in a callback on
   `work.get_future()`, both on `time.perf_counter_ns()`; `labkit.parallel.data`'s
   `OverlappedDDP` and `allreduce_gradients_naive` do this;
2. `capture(step_fn, comm_log=log)` (`capture.py`) puts a `labkit:clock_sync` region at the
   start of each step, which maps `perf_counter` to the profiler's clock (the two clocks
   differ), and writes the log's spans into the exported JSON as `comm:<name>` events
   (category `labkit_comm`) on their own "labkit comm" thread, so the file alone tells the
   story and opens as such in Perfetto or chrome://tracing;
3. `read_trace` (`timeline.py`) puts those events in the comm lane.

A completion time is taken in the future's callback, which torch runs just after it wakes
the waiters: it can be late by the completing thread's scheduling delay (about 1 ms
measured on a busy 2-core machine, where a span ended 1 ms after `wait()` had returned).

On CUDA an NCCL work's future completes when the kernel is *enqueued*
(`ProcessGroupNCCL::collective` calls `future_->markCompleted` right after the launch; it
is a CUDA-aware future), so `CommLog` skips collectives on a GPU rank (`labkit.machine.runtime.on_gpu`):
there the NCCL kernels in the trace are the comm lane.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from labkit.machine import runtime

__all__ = ["COMM_CATEGORY", "COMM_THREAD", "CommLog", "CommSpan"]

COMM_CATEGORY = "labkit_comm"
COMM_THREAD = "labkit comm (issue to completion)"


@dataclass(frozen=True)
class CommSpan:
    """One collective from issue to completion, on `time.perf_counter_ns()`."""

    name: str
    start_ns: int
    end_ns: int
    nbytes: int = 0

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class CommLog:
    """Thread-safe record of collectives (issue time, completion time), newest `maxlen` kept.

    Completion callbacks run on the thread that completes the work (a gloo or emulated-link
    thread), hence the lock.
    """

    def __init__(self, maxlen: int = 10_000) -> None:
        self._spans: collections.deque[CommSpan] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, name: str, start_ns: int, end_ns: int, nbytes: int = 0) -> None:
        """Record a collective whose start and end you measured yourself."""
        with self._lock:
            self._spans.append(CommSpan(name, int(start_ns), int(end_ns), int(nbytes)))

    def track(
        self,
        work: Any,
        name: str,
        nbytes: int = 0,
        *,
        start_ns: int | None = None,
    ) -> torch.futures.Future | None:
        """Record `work` from `start_ns` (default: now) until its future completes.

        Take `start_ns = time.perf_counter_ns()` just before issuing the collective. Returns
        a future that completes once the span is in the log: `work.wait()` can return a
        moment before the completion callback has run, so wait on this one too before
        reading the log. On a GPU rank nothing is logged and None is returned (an NCCL
        work's future completes at enqueue; the trace's NCCL kernels have the real times).
        """
        if runtime.on_gpu():
            return None
        t0 = time.perf_counter_ns() if start_ns is None else int(start_ns)

        def done(fut: torch.futures.Future) -> None:
            self.add(name, t0, time.perf_counter_ns(), nbytes)
            fut.wait()  # re-raise a failed collective's error to whoever waits on us

        return work.get_future().then(done)

    def spans(self) -> list[CommSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._spans)
