"""The virtual device clock of an emulated rank: the time its emulated GPU would show.

SimGrid SMPI's "online simulation" (Casanova et al., "Versatile, scalable, and accurate
simulation of distributed applications and platforms", JPDC 2014): run the code for real,
measure its compute bursts, simulate the network. Here:

* **compute** advances the clock by the CPU time of the rank's main thread
  (`time.pthread_getcpuclockid`; one intra-op thread per emulated GPU, and CPU autograd runs
  backward and its hooks on the calling thread). Wall time does not count, so a busy
  machine or eight ranks on two cores give the same virtual times. gloo's and the
  emulator's own threads are not compute, and the emulator's bookkeeping on the main thread
  is excluded (`paused`);
* **waiting** moves the clock forward to the virtual time at which the awaited collective
  completes (`advance_to`), which `process_group.py` computes from every rank's issue time
  and the α-β model of `labkit.links`. Blocking in wall time while waiting is free: a rank
  blocked 307 ms in a gloo all-reduce spent 0.33 ms of main-thread CPU (DESIGN.md).

On a simulated machine (`Cluster.simulated()`, `$LABKIT_CLOCK` "simulated") compute is not CPU time but
the modelled time of each operator on the described GPU, which `simulated_device.SimulatedDevice` adds
with `spend`; waiting is the same.

There is one clock per rank process, as there is one GPU per rank: `rank_clock()`.
What it does not model: NCCL kernels competing with compute for SMs, the host launch
queue, and contention between groups that share a link.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Iterator

__all__ = ["CLOCK_ENV", "VirtualClock", "rank_clock"]

CLOCK_ENV = "LABKIT_CLOCK"  # "virtual" (default), "wall" or "simulated"


class VirtualClock:
    """Seconds of emulated-GPU time on this rank since the clock was made.

    `modelled`: compute is what `spend` adds (a simulated GPU's operator times), not CPU time."""

    def __init__(self, thread_id: int | None = None, modelled: bool = False) -> None:
        self.modelled = modelled
        self._modelled_ns = 0
        tid = thread_id if thread_id is not None else threading.main_thread().ident
        self._cpu_clock = time.pthread_getcpuclockid(tid)
        self._cpu0 = time.clock_gettime_ns(self._cpu_clock)
        self._waited_ns = 0  # forward jumps: time spent waiting for collectives
        self._excluded_ns = 0  # the emulator's own CPU time on the main thread
        self._stream_free = 0.0  # virtual time a kernel queued with `occupy` ends (0: none queued)
        self._lock = threading.Lock()
        # The device timeline (newest kept): when the rank waited, and each collective from
        # issue to completion, both in virtual seconds. Compute is the time between waits.
        self.waits: collections.deque[tuple[float, float]] = collections.deque(maxlen=100_000)
        self.collectives: collections.deque[tuple[str, float, float, int]] = collections.deque(maxlen=100_000)
        self.collectives_logged = 0  # every collective ever put on the timeline (the deque keeps the newest)
        # Named phases of the rank's own work (`labkit.trace.phase`: data loading, logging, ...).
        self.phases: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=100_000)

    def _cpu_ns(self) -> int:
        if self.modelled:
            return self._modelled_ns
        return time.clock_gettime_ns(self._cpu_clock) - self._cpu0

    def spend(self, seconds: float) -> None:
        """Compute for `seconds` of modelled device time (a simulated operator); modelled clocks only."""
        if not self.modelled:
            raise RuntimeError("spend() is for a modelled clock (a simulated GPU); this one counts CPU time")
        with self._lock:
            self._modelled_ns += round(seconds * 1e9)

    def occupy(self, seconds: float) -> None:
        """Queue a kernel that keeps the device's stream busy for `seconds` from now (CUDA's `_sleep` kernel
        on a GPU): a collective issued before it ends starts on the device when it ends."""
        self._stream_free = self.now() + seconds

    def device_ready(self) -> float:
        """When the device would start work issued now: now, or the end of a kernel `occupy` queued."""
        return max(self.now(), self._stream_free)

    def now(self) -> float:
        """This rank's virtual time in seconds (callable from any thread)."""
        with self._lock:
            return (self._cpu_ns() - self._excluded_ns + self._waited_ns) / 1e9

    def waited(self) -> float:
        """Seconds of this clock spent waiting for collectives (the rest is compute)."""
        with self._lock:
            return self._waited_ns / 1e9

    def advance_to(self, t: float) -> float:
        """Wait, in virtual time, until `t` (no-op if the clock is already past it); return now."""
        with self._lock:
            now_ns = self._cpu_ns() - self._excluded_ns + self._waited_ns
            target_ns = round(t * 1e9)
            if target_ns > now_ns:
                self._waited_ns += target_ns - now_ns
                self.waits.append((now_ns / 1e9, target_ns / 1e9))
                now_ns = target_ns
            return now_ns / 1e9

    def log_collective(self, name: str, issued: float, done: float, nbytes: int) -> None:
        """Put one collective on the device timeline (called by the group's completion thread)."""
        self.collectives.append((name, issued, done, nbytes))
        self.collectives_logged += 1

    def log_phase(self, name: str, start: float, end: float) -> None:
        """Put one named phase of this rank's work on the device timeline."""
        self.phases.append((name, start, end))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """CPU time the main thread spends inside this block is not compute (emulator bookkeeping)."""
        c0 = self._cpu_ns()
        try:
            yield
        finally:
            spent = self._cpu_ns() - c0
            with self._lock:
                self._excluded_ns += spent


_CLOCKS: dict[int, VirtualClock] = {}  # pid -> the clock of the rank living in that process


def rank_clock() -> VirtualClock:
    """The virtual clock of the rank in this process (made on first use, e.g. by its process group)."""
    pid = os.getpid()
    if pid not in _CLOCKS:
        _CLOCKS[pid] = VirtualClock(modelled=os.environ.get(CLOCK_ENV) == "simulated")
    return _CLOCKS[pid]
