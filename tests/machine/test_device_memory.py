"""labkit.machine.device_memory: the memory numbers of a rank in both worlds.

* on the CPU: the emulated `MemoryBudget` counts, `tracked()` opens a counting budget where nothing does, and
  `step_peak` measures one step from either;
* on a GPU (CUDA mocked here, so that it runs anywhere): the warm baseline recorded once, every number net of
  it, the cap set above what the warm process reserves (`set_per_process_memory_fraction` caps *reserved*
  memory), and `memory_limit` lifting its cap afterwards. The real allocator is checked against the estimate
  under the `gpu` mark (tests/test_memory.py).
"""

from __future__ import annotations

import types

import pytest
import torch

from labkit.machine import device_memory, emulate, runtime
from labkit.machine.device_memory import StepPeak

MiB = 2**20


@pytest.fixture
def cpu_process(monkeypatch) -> None:
    """A plain process without CUDA, outside labkit.launch."""
    monkeypatch.delenv(runtime.CLUSTER_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _step(mib: list[int]):
    """A step that makes tensors of these sizes one after another, keeping each until the next is made."""

    def step() -> str:
        held = None
        for m in mib:
            new = torch.empty(m * MiB, dtype=torch.uint8)
            del held
            held = new
        del held
        return "done"

    return step


# ---------------------------------------------------------------------- on the CPU


def test_step_peak_on_an_emulated_budget_counts_from_what_the_step_starts_with(cpu_process):
    with emulate.MemoryBudget(2**30, rank=1) as budget:
        weights = torch.empty(3 * MiB, dtype=torch.uint8)  # held before and after the step
        result, peak = device_memory.step_peak(_step([1, 2, 1]))  # at most 1 + 2 MiB alive at once
        assert result == "done"
        assert peak == StepPeak(start_bytes=3 * MiB, peak_bytes=6 * MiB, source="emulated budget")
        assert peak.added_bytes == 3 * MiB
        assert device_memory.memory_allocated() == budget.allocated == 3 * MiB
        assert device_memory.max_memory_allocated() == 6 * MiB
        device_memory.reset_peak_memory_stats()  # a new peak from what is held now
        assert device_memory.max_memory_allocated() == 3 * MiB
        assert device_memory.peak_bytes() == (3 * MiB, "emulated budget")
        del weights


def test_where_nothing_tracks_memory_step_peak_counts_the_steps_own_tensors(cpu_process):
    assert emulate.active_budget() is None and device_memory.peak_bytes() is None
    assert device_memory.memory_allocated() == 0 and device_memory.max_memory_allocated() == 0
    before = torch.empty(5 * MiB, dtype=torch.uint8)  # not counted: made outside any budget
    result, peak = device_memory.step_peak(_step([2, 1]))
    assert result == "done" and peak == StepPeak(0, 3 * MiB, "emulated budget")
    assert emulate.active_budget() is None  # the counting budget closed with the step
    del before


def test_tracked_opens_a_counting_budget_only_where_none_is_open(cpu_process):
    with device_memory.tracked():
        opened = emulate.active_budget()
        assert opened is not None and opened.limit_bytes >= 2**40  # counts, never refuses
        x = torch.empty(MiB, dtype=torch.uint8)
        assert device_memory.peak_bytes() == (MiB, "emulated budget")
        del x
    assert emulate.active_budget() is None
    with emulate.MemoryBudget(64 * MiB) as budget, device_memory.tracked():
        assert emulate.active_budget() is budget  # the rank's own budget keeps counting


def test_memory_limit_on_the_cpu_is_an_emulated_budget_naming_the_rank(cpu_process):
    with device_memory.memory_limit(4 * MiB, rank=2) as budget:
        assert isinstance(budget, emulate.MemoryBudget) and budget.limit_bytes == 4 * MiB
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 8.00 MiB\. Rank 2"):
            torch.empty(8 * MiB, dtype=torch.uint8)
    assert emulate.active_budget() is None


# ---------------------------------------------------------------------- on a GPU (mocked)


@pytest.fixture
def gpu(monkeypatch) -> dict:
    """A mocked 1 GiB GPU whose warm process holds 80 MiB reserved and 66 MiB allocated (context buffers and
    two cuBLAS workspaces), peaking at 100 MiB; every cap set is logged in `calls["fractions"]`."""
    calls: dict = {"fractions": [], "order": []}
    # the baseline lives in the environment: undone after the test, whatever the code under test sets
    monkeypatch.delenv("LABKIT_GPU_BASELINE_BYTES", raising=False)
    monkeypatch.delenv("LABKIT_GPU_BASELINE_RESERVED_BYTES", raising=False)
    monkeypatch.delenv(runtime.CLUSTER_ENV, raising=False)
    state = {"allocated": 66 * MiB, "reserved": 80 * MiB, "peak": 100 * MiB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(total_memory=1024 * MiB)
    )
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: calls["order"].append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls["order"].append("empty_cache"))
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda dev=None: calls["order"].append("reset_peak")
    )
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, dev=None: calls["fractions"].append(fraction),
    )
    monkeypatch.setattr(runtime, "device", lambda: torch.device("cuda", 0))
    calls["state"] = state
    return calls


def test_the_warm_baseline_is_recorded_once_warm(gpu):
    # the warm-up (one matmul forward and backward) runs on the CPU here, standing in for the GPU
    assert device_memory.baseline_bytes() == 0
    assert device_memory.record_baseline(torch.device("cpu")) == 66 * MiB
    assert device_memory.baseline_bytes() == 66 * MiB
    assert gpu["order"] == ["synchronize"]  # read after the device finished the warm-up


def test_the_cap_sits_above_the_warm_baseline_and_peaks_are_net_of_it(gpu, monkeypatch):
    # A 48 MiB budget from zero would OOM on the workspaces; the cap goes above what the warm process holds.
    real_record = device_memory.record_baseline
    recorded = []

    def record(dev):  # the warm-up itself needs a real GPU: run it on the CPU, as above
        recorded.append(dev)
        return real_record(torch.device("cpu"))

    monkeypatch.setattr(device_memory, "record_baseline", record)
    dev = torch.device("cuda", 0)
    device_memory.cap_above_baseline(dev, 48 / 1024)
    assert recorded == [dev]  # no baseline yet: recorded first
    assert gpu["fractions"] == [pytest.approx((80 + 48) / 1024)]  # (reserved baseline + limit) / total
    device_memory.cap_above_baseline(dev, 0.5)
    assert recorded == [dev] and gpu["fractions"][-1] == pytest.approx((80 + 512) / 1024)  # recorded once
    monkeypatch.setattr(runtime, "on_gpu", lambda: True)
    assert device_memory.peak_bytes() == (
        34 * MiB,
        "torch.cuda.max_memory_allocated, net of the warm baseline",
    )
    assert device_memory.memory_allocated(dev) == 0  # the baseline itself is not the lab's
    assert device_memory.max_memory_allocated(dev) == 34 * MiB


def test_a_cap_larger_than_the_card_is_the_whole_card(gpu):
    device_memory.record_baseline(torch.device("cpu"))
    device_memory.cap_above_baseline(torch.device("cuda", 0), 4.0)  # 4 GiB on a 1 GiB card
    assert gpu["fractions"] == [1.0]


def test_memory_limit_caps_above_what_is_reserved_now_and_lifts_the_cap_afterwards(gpu):
    dev = torch.device("cuda", 0)
    with device_memory.memory_limit(16 * MiB, device=dev) as budget:
        assert budget is None  # the card's own allocator enforces it
        assert gpu["fractions"] == [pytest.approx((80 + 16) / 1024)]
    assert gpu["fractions"][-1] == 1.0  # lifted
    assert gpu["order"][:2] == [
        "synchronize",
        "empty_cache",
    ]  # cached blocks returned before reserved is read
    with pytest.raises(torch.OutOfMemoryError), device_memory.memory_limit(16 * MiB, device=dev):
        raise torch.OutOfMemoryError("the job's OOM")
    assert gpu["fractions"][-1] == 1.0  # lifted after an OOM too


def test_step_peak_on_a_gpu_reads_the_allocator_net_of_the_baseline(gpu, monkeypatch):
    device_memory.record_baseline(torch.device("cpu"))  # 66 MiB
    monkeypatch.setattr(runtime, "on_gpu", lambda: True)
    gpu["state"].update(allocated=76 * MiB, peak=130 * MiB)  # the model's 10 MiB; the step peaks at 64 MiB
    gpu["order"].clear()

    def step() -> int:
        gpu["order"].append("step")
        return 7

    result, peak = device_memory.step_peak(step)
    assert result == 7
    assert peak == StepPeak(10 * MiB, 64 * MiB, "torch.cuda.max_memory_allocated, net of the warm baseline")
    assert gpu["order"] == ["synchronize", "reset_peak", "step", "synchronize"]
