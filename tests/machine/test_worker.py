"""labkit.machine.worker: what a rank sends back (detached, on the CPU, inside dataclasses too) and the
environment it runs in, as torchrun would set it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import Cluster
from labkit.links import Link
from labkit.machine import emulate, runtime
from labkit.machine.worker import _rank_env, to_cpu


def test_results_come_back_detached_inside_dataclasses_too():
    @dataclass(frozen=True)
    class Result:
        grads: torch.Tensor
        rows: list
        name: str = "r"

    w = torch.ones(3, requires_grad=True)
    out = to_cpu({"r": Result(grads=w * 2, rows=[(w * 3, 1)])})
    # pytree walks dicts, lists and tuples but not dataclasses: a CUDA tensor there came back on the GPU
    assert not out["r"].grads.requires_grad and not out["r"].rows[0][0].requires_grad
    assert out["r"].rows[0][1] == 1 and out["r"].name == "r" and out["r"].grads.tolist() == [2.0, 2.0, 2.0]


def test_a_rank_gets_torchruns_variables_and_its_cluster():
    cluster = Cluster.emulated(nodes=2, gpus_per_node=2, intra_node=Link(1.0), inter_node=Link(0.1))
    env = _rank_env(3, 4, cluster, cluster.to_json(), "/tmp/run")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "4",
        "1",
        "2",
    )
    assert Cluster.from_json(env[runtime.CLUSTER_ENV]) == cluster
    assert env[emulate.RECORD_DIR_ENV] == "/tmp/run" and env[emulate.CLOCK_ENV] == "virtual"
