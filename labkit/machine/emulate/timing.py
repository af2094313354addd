"""When an emulated collective completes: on the rank's virtual clock, or on the wall clock.

`EmulatedProcessGroup` (`process_group.py`) asks a timing object two things: at issue, on
the calling thread, `issue(...)` returns a token; on the group's completion thread, after
the real gloo transfer, `complete(token)` returns the completion time that the work's
`wait()` then moves the rank's clock to (None on the wall clock, where it has slept instead).

* `VirtualTiming` (the default): a collective starts, in virtual time, when the last rank
  of the group has issued it and the group's previous collective has finished (one stream
  per group, like NCCL's), and completes `collective_time_s` later. Ranks exchange their
  issue times through the group's store (one `set` at issue, one `multi_get` after the
  gloo transfer, which cannot finish before every rank has issued). A send starts when the
  sender issues it and the previous send to that peer is done; the receive completes at
  max(the receiver's post time, the send's start + transfer time). Messages between two
  ranks are matched in the order they are sent (tags are not looked at).
* `WallTiming` (`Cluster.emulated(clock="wall")`): the completion thread sleeps until the
  modelled time has passed since the issue, serialised per group: the behaviour before the
  virtual clock, kept for comparison.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from labkit.machine import _torch_compat as compat
from labkit.machine.emulate.clock import VirtualClock

__all__ = ["VirtualTiming", "WallTiming", "called_by_ddp_reducer", "caller_frame"]


class WallTiming:
    """Completion no earlier than the modelled time after issue, serialised per link direction."""

    virtual = False

    def __init__(self) -> None:
        self._busy_until = {"coll": 0.0, "send": 0.0, "recv": 0.0}
        self._lock = threading.Lock()

    def issue(
        self, op: str, seconds: float, peer: int | None, name: str = "", nbytes: int = 0
    ) -> tuple[float, float | None]:
        lane = "coll" if peer is None else op
        with self._lock:
            start = max(time.perf_counter(), self._busy_until[lane])
            self._busy_until[lane] = start + seconds
        # A receive cannot finish before its data has crossed the link after the send began;
        # gloo finishing tells us the sender has started, so the model's time is added after it.
        return start + seconds, (seconds if op == "recv" else None)

    def complete(self, token: tuple[float, float | None]) -> None:
        done_at, after_inner = token
        if after_inner is not None:
            done_at = max(done_at, time.perf_counter() + after_inner)
        delay = done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return None


class VirtualTiming:
    """Completion times on the ranks' virtual clocks, from every rank's issue time and the model."""

    virtual = True

    def __init__(self, store: dist.Store, rank: int, size: int, clock: VirtualClock) -> None:
        self.clock = clock
        self._store = store
        self._rank = rank
        self._size = size
        self._collectives = 0  # issued on this group, the same count on every rank
        self._sent: dict[int, int] = {}  # peer -> messages sent to it
        self._received: dict[int, int] = {}  # peer -> messages received from it
        self._send_busy: dict[int, float] = {}  # peer -> virtual time the last send to it ends
        self._group_busy = 0.0  # virtual time the group's last collective ends (completion thread)
        self._backward_works: list[Any] = []
        self._backward_task = -1  # the autograd graph task whose end we wait at

    def issue(self, op: str, seconds: float, peer: int | None, name: str = "", nbytes: int = 0) -> tuple:
        now = self.clock.device_ready()  # behind a kernel still running on the stream (`VirtualClock.occupy`)
        span = (name or op, now, nbytes)  # for the device timeline
        if peer is None:
            self._collectives += 1
            key = f"labkit/vt/c{self._collectives}/"
            self._store.set(key + str(self._rank), repr(now))
            return ("coll", span, key, seconds)
        if op == "send":
            n = self._sent[peer] = self._sent.get(peer, 0) + 1
            start = max(now, self._send_busy.get(peer, 0.0))
            self._send_busy[peer] = start + seconds
            self._store.set(f"labkit/vt/p{self._rank}-{peer}/{n}", repr(start))
            return ("send", span, start + seconds)
        n = self._received[peer] = self._received.get(peer, 0) + 1
        return ("recv", span, f"labkit/vt/p{peer}-{self._rank}/{n}", now, seconds)

    def complete(self, token: tuple) -> float:
        done = self._done(token)
        name, issued, nbytes = token[1]
        self.clock.log_collective(name, issued, done, nbytes)
        return done

    def _done(self, token: tuple) -> float:
        kind = token[0]
        if kind == "coll":
            _, _, key, seconds = token
            issued = self._store.multi_get([key + str(r) for r in range(self._size)])
            start = max(max(float(v) for v in issued), self._group_busy)
            self._group_busy = start + seconds
            return self._group_busy
        if kind == "send":
            return token[2]
        _, _, key, posted, seconds = token
        sent = float(self._store.get(key))
        return max(posted, sent + seconds)

    # -- DDP waits for its buckets inside backward, in C++ ------------------------------

    def wait_at_end_of_backward(self, work: Any) -> None:
        """Move the clock to `work`'s completion when the current backward ends.

        DDP's reducer waits for every bucket's future in C++ at the end of backward
        (`finalize_backward`), where no Python `wait()` runs; an autograd final callback,
        queued after DDP's own, waits for them here instead.
        """
        task = compat.graph_task_id()
        if task != self._backward_task:
            self._backward_task, self._backward_works = task, []
            compat.queue_backward_callback(self._end_of_backward)
        self._backward_works.append(work)

    def _end_of_backward(self) -> None:
        works, self._backward_works, self._backward_task = self._backward_works, [], -1
        for work in works:
            work.wait()


def called_by_ddp_reducer(frame: Any) -> bool:
    """Was a group method called by DDP's C++ reducer inside backward (frame: the method's caller)?

    torch.distributed's Python API (`dist.all_reduce`, pipelining, ...) calls a group from a
    `torch.distributed` module; DDP's reducer calls it from C++, so the nearest Python frame
    is autograd's (`loss.backward()`).
    """
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    return compat.in_backward() and not module.startswith("torch.distributed")


def caller_frame(depth: int = 2) -> Any:
    """The frame `depth` levels above the caller of this function."""
    return sys._getframe(depth + 1)
