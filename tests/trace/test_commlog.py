"""labkit.trace.commlog: `CommLog` records a collective from issue to completion (the profiler cannot show an
asynchronous collective's completion), keeps the newest `maxlen`, and logs nothing on a GPU rank (NCCL's
futures complete at enqueue; the trace's kernels have the times)."""

from __future__ import annotations

import torch

import labkit.machine.runtime
from labkit.trace import CommLog


def test_comm_log_records_issue_to_completion(monkeypatch):
    log = CommLog(maxlen=2)
    fut = torch.futures.Future()

    class FakeWork:
        def get_future(self):
            return fut

    logged = log.track(FakeWork(), "all_reduce x", 64, start_ns=100)
    assert len(log) == 0 and not logged.done()  # not complete yet
    fut.set_result(None)
    logged.wait()
    (span,) = log.spans()
    assert (span.name, span.start_ns, span.nbytes) == ("all_reduce x", 100, 64) and span.end_ns > 100
    with monkeypatch.context() as m:  # a GPU rank, as labkit.machine.runtime decides it
        m.setattr(labkit.machine.runtime, "on_gpu", lambda: True)
        assert log.track(FakeWork(), "cuda one") is None  # skipped: NCCL futures complete at enqueue
    log.add("a", 0, 1)
    log.add("b", 0, 1)
    assert [s.name for s in log.spans()] == ["a", "b"]  # maxlen keeps the newest
