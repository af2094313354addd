"""torch DDP's buckets step by step, on lab 03's GPT (2 gloo ranks): what lab 03 says of them.

With `find_unused_parameters=False` (the default) the constructor puts every parameter into one bucket
(`_BucketCapacityConfig.compute_bucket_size_limits` in torch/nn/parallel/distributed.py returns
`[sys.maxsize]`), so step 1 is a single all-reduce; the next forward rebuilds the buckets once, in the
order the gradients became ready, with `[first_bucket_bytes_cap, bucket_bytes_cap]` (`Reducer::
rebuild_buckets`, torch/csrc/distributed/c10d/reducer.cpp). The first cap is 1 MiB
(`dist._DEFAULT_FIRST_BUCKET_BYTES`) only where `bucket_cap_mb` is left unset. With
`find_unused_parameters=True` there is no rebuild, and step 1 already has the capped buckets.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labkit.course.experiments.unoverlapped_comms import Params
from labkit.course.training.grad_sync import CountingAllReduce
from labkit.models import seeded_model, synthetic_batch
from labkit.parallel.data import make_ddp

STEPS = 3
MIB = 2**20
LAB_CAP_MB = Params().bucket_cap_mb  # lab 03's bucket_cap_mb (0.5 MiB)


def _buckets_per_step(ddp: torch.nn.Module, config) -> list[list[tuple[int, int, bool]]]:
    """(bucket index, bytes, launched during backward) of every all-reduce, one list per step."""
    counter = CountingAllReduce()
    ddp.register_comm_hook(counter, CountingAllReduce.hook)
    launched, steps = 0, []
    for step in range(STEPS):
        x, y = synthetic_batch(config, 2, seed=dist.get_rank(), step=step)
        loss = ddp(x, y)
        counter.backward_running = True
        loss.backward()
        counter.backward_running = False
        calls = counter.calls[launched:]
        # every all-reduce so far was launched inside backward
        steps.append([(i, n, counter.in_backward == len(counter.calls)) for i, n in calls])
        launched = len(counter.calls)
    return steps


def worker() -> dict:
    config = Params().config()
    out = {}
    for name, make in {
        "lab_cap": lambda m: make_ddp(m, bucket_cap_mb=LAB_CAP_MB),
        "default_cap": lambda m: DistributedDataParallel(m),
        "find_unused": lambda m: DistributedDataParallel(m, find_unused_parameters=True),
    }.items():
        out[name] = _buckets_per_step(make(seeded_model(config, seed=0)), config)
    out["grad_bytes"] = 4 * config.num_params()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    from labkit.machine.launcher import launch

    return launch(worker, world_size=2, cluster="cpu", timeout_s=120)


def test_step_one_is_one_bucket_launched_when_backward_ends(results):
    for res in results:
        for name in ("lab_cap", "default_cap"):
            first = res[name][0]
            assert len(first) == 1, f"{name}: step 1 has {len(first)} buckets"
            ((_, nbytes, in_backward),) = first
            assert nbytes == res["grad_bytes"] and in_backward, f"{name}: {first}"


def test_the_rebuilt_buckets_hold_from_step_two(results):
    for res in results:
        lab = res["lab_cap"]
        # ten buckets at lab 03's defaults (its section 5 says so)
        assert len(lab[1]) == 10 and [n for _, n, _ in lab[1]] == [n for _, n, _ in lab[2]]
        assert sum(n for _, n, _ in lab[1]) == res["grad_bytes"]
        # with bucket_cap_mb set, the first bucket shares the cap: every bucket but the last reaches it
        assert all(n >= LAB_CAP_MB * MIB for _, n, _ in lab[1][:-1])
        # unset: a 1 MiB first bucket, then one 25 MiB bucket for the rest of this ~5 MB model
        # (lab 03, section 6: "torch DDP itself would make two")
        default = [n for _, n, _ in res["default_cap"][1]]
        assert len(default) == 2 and MIB <= default[0] < default[1], default
        assert all(in_backward for step in res["lab_cap"] + res["default_cap"] for *_, in_backward in step)


def test_find_unused_parameters_starts_with_the_capped_buckets_and_keeps_them(results):
    for res in results:
        steps = [[n for _, n, _ in s] for s in res["find_unused"]]
        assert len(steps[0]) == 2 and steps[0] == steps[1] == steps[2], steps
        # the small bucket holds the parameters defined first (the embeddings' end), so it goes last
        assert MIB <= steps[0][1] < steps[0][0], steps
