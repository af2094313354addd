"""labkit.bandwidth: nccl-tests-style rows for every collective (algorithm and bus bandwidth from the time),
CUDA events around the collectives on a GPU (mocked here; the real one under the `gpu` mark), and the
sizes refused."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from labkit import Cluster, bandwidth, launch
from labkit.bandwidth import bandwidth_test
from labkit.links import Link, bus_bandwidth_factor, collective_time_s
from labkit.machine import runtime, timer


def worker_bandwidth() -> list[dict]:
    return (
        bandwidth_test([1024, 64 * 1024], op="all_reduce", iters=3)
        + bandwidth_test([4096], op="all_gather", iters=2)
        + bandwidth_test([4096], op="reduce_scatter", iters=2)
        + bandwidth_test([4096], op="broadcast", iters=2)
    )


def test_bandwidth_test_rows():
    rows0, rows1 = launch(worker_bandwidth, world_size=2, cluster="cpu", timeout_s=60)
    assert [r["op"] for r in rows0] == [
        "all_reduce",
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
    ]
    assert [r["size_bytes"] for r in rows0] == [1024, 65536, 4096, 4096, 4096]
    for r in rows0 + rows1:
        assert r["world_size"] == 2 and r["time_ms"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_bandwidth_factor(r["op"], 2))
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / (r["time_ms"] / 1e3) / 1e9)


def test_on_a_gpu_the_collectives_are_timed_by_cuda_events_around_them(monkeypatch):
    # Mocked CUDA: a spin kernel first, long enough for the host to enqueue every timed collective (so the
    # device does not wait for the host between them), then the start event before the first collective, the
    # end event after every work's wait (which makes the current stream wait for NCCL's); the span is divided
    # by the count.
    order, made = [], []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.name = ("start", "end")[len(made)]
            made.append(self)

        def record(self):
            order.append(f"record {self.name}")

        def synchronize(self):
            order.append("synchronize")

        def elapsed_time(self, other):
            return 12.0  # ms

    class Work:
        def wait(self):
            order.append("wait")

    monkeypatch.delenv(runtime.CLUSTER_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append(("spin", cycles)))
    monkeypatch.setattr(bandwidth, "_start", lambda *a: order.append("start op") or Work())
    seconds = bandwidth._run("all_reduce", 3, None, None, 0, None)
    (_, cycles), *order = order
    assert cycles >= 3 * bandwidth.ENQUEUE_S * 2.0e9  # at 2 GHz, an H100's boost clock or above
    assert order == [
        "record start",
        "start op",
        "start op",
        "start op",
        "wait",
        "wait",
        "wait",
        "record end",
        "synchronize",
    ]
    assert seconds == pytest.approx(12.0 / 1e3 / 3)


def _busy(seconds: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def _spans(link_s: float) -> dict[str, float]:
    full = torch.zeros(1024)
    dist.barrier()
    with timer.CollectivesSpan() as hidden:  # host work before the first launch and after the last wait
        _busy(0.05)
        works = [dist.all_reduce(full, async_op=True) for _ in range(4)]
        for work in works:
            work.wait()
        _busy(0.05)
    dist.barrier()
    with timer.CollectivesSpan() as gaps:  # a host slower than the link between the launches
        for _ in range(4):
            work = dist.all_reduce(full, async_op=True)
            _busy(2 * link_s)
        work.wait()
    dist.barrier()
    with timer.CollectivesSpan() as queued:  # the same slow host behind a spin as long as its launches
        timer.occupy_device(4 * 2 * link_s + 0.01)
        for _ in range(4):
            work = dist.all_reduce(full, async_op=True)
            _busy(2 * link_s)
        work.wait()
    dist.barrier()
    with timer.CollectivesSpan() as empty:  # no collective inside: the plain span
        _busy(0.01)
    spans = {"hidden": hidden, "gaps": gaps, "queued": queued, "empty": empty}
    return {name: span.ms / 1e3 for name, span in spans.items()}


def test_on_the_emulated_cluster_the_span_is_the_devices_first_to_last_collective():
    # As CUDA events read a GPU's stream: the host's Python around the launches is not link time, but a host
    # that launches slower than the link leaves gaps the device waits through, unless a spin queued first
    # keeps the stream busy until every launch is in.
    link = Link(0.001, 0.0)  # 4 KiB all-reduce over 2 ranks: 4.096 ms
    cluster = Cluster.emulated(gpus_per_node=2, intra_node=link, inter_node=link)
    link_s = collective_time_s("all_reduce", 4096, 2, link)
    for r in launch(_spans, link_s, world_size=2, cluster=cluster, timeout_s=60):
        assert r["hidden"] == pytest.approx(4 * link_s, rel=0.05)  # not 0.1 s more
        # each of the 3 gaps is the host's 2 link_s and its own launch of the next all-reduce (host Python,
        # under a millisecond even on a slow runner), which the device waits through too
        gaps = 3 * 2 * link_s + link_s
        assert 0.98 * gaps <= r["gaps"] <= gaps + 3 * 1e-3
        # bandwidth_test's spin: the collectives queue behind it and run back to back, as on a GPU's stream
        assert r["queued"] == pytest.approx(4 * link_s, rel=0.05)
        assert r["empty"] == pytest.approx(0.01, rel=0.3)


def _too_small() -> str:
    try:
        bandwidth_test([4], iters=1)
    except ValueError as exc:
        return str(exc)
    finally:
        dist.barrier()
    return ""


def test_a_size_smaller_than_one_element_per_rank_is_refused():
    (msg, _) = launch(_too_small, world_size=2, cluster="cpu", timeout_s=60)
    assert "size 4 bytes is smaller than world_size(2) * 4-byte elements" in msg and "sizes >= 8" in msg


@pytest.mark.gpu
def test_bandwidth_test_times_collectives_on_the_gpu_with_cuda_events():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 1:
        pytest.skip("no GPU")
    n = min(gpus, 2)
    rows = launch(bandwidth_test, [1 << 16, 1 << 26], iters=10, world_size=n, cluster="gpu", timeout_s=120)[0]
    assert all(r["time_ms"] > 0 for r in rows)
    if n > 1:  # on one rank NCCL's all-reduce moves nothing: which size is faster is a coin flip
        assert rows[1]["time_ms"] > rows[0]["time_ms"] and rows[1]["busbw_GBps"] > rows[0]["busbw_GBps"]
