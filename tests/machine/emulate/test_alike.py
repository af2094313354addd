"""`launch(..., alike=True)`: on a simulated cluster one process stands for ranks that run the same operators
(labkit.machine.emulate.alike), with the times, bytes and results of every rank running."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.cluster import Cluster
from labkit.errors import RankError
from labkit.machine import device_memory, timer
from labkit.machine.emulate.alike import AlikePeers, NotAlikeError


def _tensor_parallel_step() -> dict:
    """A few collectives of different sizes on the world and on pairs, with matmuls between them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    mine = pairs[rank // 2]
    x, w = torch.empty(4096, 4096, dtype=torch.bfloat16), torch.empty(4096, 4096, dtype=torch.bfloat16)
    start = timer.clock()
    kept = []  # no tensor is freed: when a freed one's memory comes back is not what is compared here
    for size in (1, 64, 4096):
        kept.append(x @ w)
        dist.all_reduce(kept[-1][:size], group=mine)
        work = dist.all_reduce(x, async_op=True)  # overlaps the next matmul
        kept.append(kept[-1] @ w)
        work.wait()
    out = torch.empty(world * 4096, 4096, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, x)
    dist.barrier()
    # the peak before the objects: after the gather, every rank as a process peaks 100 bytes higher (world x
    # the pickle's 25 bytes: the real tensors' all-gather through gloo), one process for all does not
    peak = device_memory.max_memory_allocated()
    seen: list = [None] * world
    dist.all_gather_object(seen, {"world": world})  # pickled objects travel as real bytes
    return {"seconds": timer.clock() - start, "peak": peak, "seen": seen}


def test_one_process_for_alike_ranks_gives_what_every_rank_gives():
    """The same step on 4 simulated H100s, every rank a process and one process for all: the same clock to
    the nanosecond, the same peak memory, the same gathered objects."""
    node = Cluster.resolve("sim:dgx-h100", 4)
    every = labkit.launch(_tensor_parallel_step, world_size=4, cluster=node)
    one = labkit.launch(_tensor_parallel_step, world_size=4, cluster=node, alike=True)
    assert len(one) == 4 and one == every
    assert every[0]["seconds"] > 0 and every[0]["seen"] == [{"world": 4}] * 4
    one[1]["seen"].append("x")  # each rank's result is its own copy
    assert one[0]["seen"] == [{"world": 4}] * 4


def _rank_and_pid() -> tuple[int, int]:
    import os

    return dist.get_rank(), os.getpid()


def test_alike_changes_nothing_off_a_simulated_cluster():
    ranks = labkit.launch(_rank_and_pid, world_size=2, cluster="cpu", alike=True)
    assert [r for r, _ in ranks] == [0, 1] and ranks[0][1] != ranks[1][1]


def _send_to_the_next() -> None:
    t = torch.empty(8)
    if dist.get_rank() == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)


def test_a_transfer_between_two_ranks_is_refused_with_the_fix():
    with pytest.raises(
        RankError, match=r"NotAlikeError: a send to or from rank 1 .*launch it without alike=True"
    ):
        labkit.launch(_send_to_the_next, world_size=2, cluster="sim:dgx-h100", alike=True)


def test_alike_must_be_a_bool():
    with pytest.raises(ValueError, match=r"alike='yes' must be True or False; e\.g\. launch\(fn"):
        labkit.launch(_rank_and_pid, world_size=2, cluster="cpu", alike="yes")


class _Opts:
    def __init__(self, op=dist.ReduceOp.SUM, root: int = 0) -> None:
        self.reduceOp, self.rootRank = op, root


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (dist.ReduceOp.SUM, [4.0, 8.0]),
        (dist.ReduceOp.AVG, [1.0, 2.0]),
        (dist.ReduceOp.MAX, [1.0, 2.0]),
        (dist.ReduceOp.PRODUCT, [1.0, 16.0]),
    ],
)
def test_real_tensors_reduce_as_if_every_peer_held_the_same(op, expected):
    peers = AlikePeers(rank=0, size=4)
    t = torch.tensor([1.0, 2.0])
    peers.allreduce([t], _Opts(op)).wait()
    assert t.tolist() == expected


def test_real_tensors_gather_and_scatter_as_if_every_peer_held_the_same():
    peers = AlikePeers(rank=1, size=3)
    out = torch.empty(6)
    peers._allgather_base(out, torch.tensor([1.0, 2.0]), None)
    assert out.tolist() == [1.0, 2.0] * 3
    mine = torch.empty(2)
    peers._reduce_scatter_base(mine, torch.arange(6.0), _Opts())
    assert mine.tolist() == [6.0, 9.0]  # rank 1's chunk, [2, 3], from each of 3 peers
    lists = [[torch.empty(2) for _ in range(3)]]
    peers.allgather(lists, [torch.tensor([5.0, 6.0])], None)
    assert all(t.tolist() == [5.0, 6.0] for t in lists[0])
    with pytest.raises(NotAlikeError, match="alltoall_base"):
        peers.alltoall_base(out, out, [], [], None)
